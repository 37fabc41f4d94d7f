"""sglang-ddtree: DDTree speculative decoding for SGLang, with every step on the GPU.

Public API: :mod:`sglang_ddtree.ddtree` (``topk_logprobs``, ``build_tree``, ``accept_greedy``).
The SGLang plugin entry point is :func:`sglang_ddtree.plugin.register`.
"""
import os as _os

__version__ = "0.1.0"


def _map_source_tree_folders():
    """Make ``sglang_ddtree.kernels`` / ``sglang_ddtree.patches`` importable from a source checkout.

    An installed wheel has them inside the package (pyproject maps the top-level folders
    ``kernels/`` and ``patches/`` into it).  When the checkout itself is on ``sys.path``
    (CI, the GPU host, ``python -m`` from the repo root) they sit next to this package, so
    the repo root is appended to the package's search path.  The check is specific to this
    repository (pyproject.toml + kernels/topk_logprobs.py), so an unrelated top-level
    ``kernels`` package (Hugging Face's, which SGLang imports) is never picked up.
    """
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    if _os.path.isdir(_os.path.join(here, "kernels")):
        return  # installed layout
    marker = _os.path.join(root, "kernels", "topk_logprobs.py")
    if _os.path.isfile(_os.path.join(root, "pyproject.toml")) and _os.path.isfile(marker):
        if root not in __path__:
            __path__.append(root)


_map_source_tree_folders()
