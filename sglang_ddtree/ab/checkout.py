"""Where the sglang-ddtree checkout is, for the few things of the benchmark that live only there.

The installed command needs no checkout for a user's own model (``--model-path`` / ``--draft-model-path``,
built-in or ``--prompts`` prompts).  Only these read checkout files:
  - ``--pair text`` (the default when no model is given): ``bench/textpair/corpus_manifest.tsv``, the text
    pair's held-out files its prompts are drawn from;
  - ``--kernel-sweep``: ``bench/tree_kernels.py`` (its input maker and timers);
  - the git commit recorded in a result's meta.

The checkout is, first found: the ``root`` argument of a call, the environment variable
``SGLANG_DDTREE_CHECKOUT``, the one ``bench/ab_serve.py`` registered (``use``: the checkout that wrapper
lives in), the folder this package was imported from when it is a checkout's (an editable install, the
GPU host's folder of symlinks: resolved through symlinks).  A missing file raises ``CheckoutMissing``
(a ``FileNotFoundError``) that says what needs it and how to point at a checkout.
"""
from __future__ import annotations

import os
from typing import Optional

ENV = "SGLANG_DDTREE_CHECKOUT"
_registered: Optional[str] = None


class CheckoutMissing(FileNotFoundError):
    """A checkout file the requested feature needs is not there."""


def _is_checkout(d: Optional[str]) -> bool:
    return bool(d) and os.path.isdir(os.path.join(d, "bench")) and os.path.isdir(os.path.join(d, "sglang_ddtree"))


def use(root: Optional[str]) -> None:
    """Register ``root`` as the checkout (``bench/ab_serve.py`` registers its own)."""
    global _registered
    _registered = os.path.abspath(root) if root else None


def detected() -> Optional[str]:
    """The checkout this package's files belong to (symlinks resolved), or None (a wheel install)."""
    pkg = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # .../sglang_ddtree
    root = os.path.dirname(pkg)
    return root if _is_checkout(root) else None


def root(explicit: Optional[str] = None) -> Optional[str]:
    """The checkout's root folder, or None when none is known."""
    for cand in (explicit, os.environ.get(ENV), _registered):
        if cand:
            return os.path.abspath(cand)
    return detected()


def path(*rel: str, what: str, root_dir: Optional[str] = None) -> str:
    """``<checkout>/<rel...>``, which must exist; else CheckoutMissing naming ``what`` needs it."""
    r = root(root_dir)
    name = "/".join(rel)
    if r is None:
        raise CheckoutMissing(
            f"{what} needs {name} from a sglang-ddtree checkout, and none was found (this package is installed "
            f"without one): set {ENV}=/path/to/checkout, or run bench/ab_serve.py from the checkout")
    p = os.path.join(r, *rel)
    if not os.path.exists(p):
        raise CheckoutMissing(f"{what} needs {name}, which is not in the checkout {r}"
                              + (f" ({ENV} is set)" if os.environ.get(ENV) else "")
                              + f": set {ENV}=/path/to/checkout")
    return p
