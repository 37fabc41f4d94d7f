"""Triton 3.6's interpreter (TRITON_INTERPRET=1, the CPU path of every kernel here) with NumPy >= 2.4.

Not a kernel: a compatibility shim, applied on import of ``sglang_ddtree.kernels``.  The interpreter
holds every scalar (a kernel's int argument, a ``tl.load`` of one element) as a one-element NumPy
array and converts it for ``range()`` bounds with ``int(array)``.  NumPy deprecated that conversion
for arrays with ndim > 0 in 1.25 and NumPy 2.4 raises ``TypeError: only 0-dimensional arrays can be
converted to Python scalars``: every kernel with a runtime loop bound then fails under the
interpreter (found on the GPU host, whose NumPy is newer than the CI venv's 2.3).  The shim makes
the interpreter read the single element instead; nothing changes on CUDA, where no interpreter runs.
"""
from __future__ import annotations

import os


def _scalar_index(self):
    data = self.handle.data
    return int(data.reshape(-1)[0]) if data.size == 1 else int(data)


def apply() -> bool:
    """Patch the interpreter's tensor ``__index__`` (idempotent).  True when the patch is active."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:  # a Triton without the interpreter module: nothing to patch
        return False
    original = interpreter._patch_lang_tensor
    if getattr(original, "_ddtree_scalar_index", False):
        return True

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    patched._ddtree_scalar_index = True
    interpreter._patch_lang_tensor = patched
    return True
