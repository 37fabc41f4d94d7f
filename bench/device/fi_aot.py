"""Make the carried flashinfer JIT modules load without a rebuild (run by run_stages.sh after it
restores ``.kit/cache.tar.xz``).

flashinfer 0.6.14 loads a JIT module through ``JitSpec.build_and_load``, which always runs ninja on
``cached_ops/<name>/build.ninja``; there the ``<name>.so`` target depends on the module's object
files.  The device cache carries only the ``.so`` files (the objects are several times larger), so
ninja found the objects missing and rebuilt every carried module on every call (the first flashinfer
server of a call started ~100 s later than the next).  A module present in flashinfer's AOT directory
(``FLASHINFER_AOT_DIR/<name>/<name>.so``) is loaded as it is (``JitSpec.is_aot``).  This links each
carried ``<name>/<name>.so`` of the *current* JIT directory there; that directory's path names the
flashinfer version and the CUDA arch, so a module built for another GPU or version is never linked.
An AOT module already there is left alone.  (SGLang's own JIT kernels need nothing: ``load_jit``
loads an existing ``.so`` before it calls ninja.)

usage: python bench/device/fi_aot.py          (flashinfer's directories, from its environment)
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List


def link_carried_modules(jit_dir: Path, aot_dir: Path) -> List[str]:
    """Symlink every ``jit_dir/<name>/<name>.so`` to ``aot_dir/<name>/<name>.so`` unless that exists;
    returns the names linked."""
    linked = []
    for so in sorted(Path(jit_dir).glob("*/*.so")):
        name = so.parent.name
        if so.name != f"{name}.so":
            continue
        dst = Path(aot_dir) / name / so.name
        if dst.exists() or dst.is_symlink():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(so.resolve())
        linked.append(name)
    return linked


def main() -> int:
    from flashinfer.jit import env

    names = link_carried_modules(env.FLASHINFER_JIT_DIR, env.FLASHINFER_AOT_DIR)
    print(f"flashinfer: {len(names)} carried JIT modules linked as AOT into {env.FLASHINFER_AOT_DIR} "
          f"(from {env.FLASHINFER_JIT_DIR}): {', '.join(n[:40] for n in names) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
