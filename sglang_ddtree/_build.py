"""setuptools ``build_py`` of the wheel (pyproject.toml ``[tool.setuptools] cmdclass``).

The text pair's weights are committed xz-compressed (``data/textpair/*.safetensors.xz``: the bf16
files byte for byte, 6.8 -> 4.7 MB, so the checkout fits a GPU device call; issue 40).  The wheel
carries them decompressed, as plain ``.safetensors``: an installed package reads them directly, a
checkout (or an editable install) reads the ``.xz`` (:func:`sglang_ddtree.textpair.load_pair`).
Standard library + setuptools only: this runs at build time, before any dependency is installed."""
import lzma
import os
import shutil

from setuptools.command.build_py import build_py as _build_py


class BuildPy(_build_py):
    def run(self):
        super().run()
        for root, _, files in os.walk(os.path.join(self.build_lib, "sglang_ddtree", "data")):
            for f in files:
                if f.endswith(".safetensors.xz"):
                    src = os.path.join(root, f)
                    with lzma.open(src) as i, open(src[:-3], "wb") as o:
                        shutil.copyfileobj(i, o)
                    os.remove(src)
