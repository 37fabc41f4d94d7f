"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] ddtree``).

SGLang calls :func:`register` in every one of its processes (CLI, Engine, one scheduler per TP
rank, DP controller, detokenizer) through ``sglang.srt.plugins.load_plugins()``.  It registers

* ``DDTREE-GPU``: the DDTree worker with every tree step on the GPU (Triton kernels);
* ``DDTREE-CPU``: the same worker with the tree built by the exact CPU heap (the published ports'
  recipe), the baseline of the A/B benchmark;

and the hooks in ``sglang_ddtree.patches``.  Importing the worker (and SGLang's CUDA-side
modules) is deferred to the worker factory, which runs only in scheduler processes.

Version guard: the hooks reach into SGLang internals and were checked against
:func:`checked_sglang_versions` (the versions every patch module lists) only.  On any other SGLang the algorithms are still registered (so
the name is known) but refuse to start, with one line naming the checked versions, and no hook is
installed; ``SGLANG_DDTREE_ALLOW_UNCHECKED_SGLANG=1`` tries anyway, with a warning.
"""
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

ENV_ALLOW_UNCHECKED = "SGLANG_DDTREE_ALLOW_UNCHECKED_SGLANG"

_registered = False


def checked_sglang_versions() -> tuple:
    """The SGLang versions every hook of ``sglang_ddtree.patches`` was checked against."""
    from sglang_ddtree.patches import ALL
    common = None
    for mod in ALL:
        v = set(mod.CHECKED_SGLANG_VERSIONS)
        common = v if common is None else common & v
    return tuple(sorted(common or ()))


def version_refusal(version: str, env=None) -> Optional[str]:
    """None when ``version`` was checked (or the user allowed an unchecked one), else the refusal."""
    env = os.environ if env is None else env
    checked = checked_sglang_versions()
    if version in checked:
        return None
    msg = (f"sglang-ddtree was checked against SGLang {', '.join(checked)} only; this is SGLang "
           f"{version}. DDTREE-GPU / DDTREE-CPU refuse to run on it (their hooks reach into SGLang "
           f"internals). Install sglang=={checked[-1]}, or set {ENV_ALLOW_UNCHECKED}=1 to try anyway.")
    from .env_vars import flag

    if flag(env, ENV_ALLOW_UNCHECKED, False):
        logger.warning("%s (%s=1: trying anyway)", msg.split(" DDTREE-GPU")[0], ENV_ALLOW_UNCHECKED)
        return None
    return msg


def _worker_factory(server_args):
    from sglang_ddtree.worker import DDTreeWorker

    return DDTreeWorker


def register() -> None:
    global _registered
    if _registered:
        return
    import sglang
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_ddtree.patches import install_all
    from sglang_ddtree.spec_algo import (CPU_NAME, GPU_NAME, DDTreeCPUSpecAlgo, DDTreeGPUSpecAlgo,
                                         validate_server_args)

    refusal = version_refusal(getattr(sglang, "__version__", "unknown"))
    validate = validate_server_args
    if refusal is not None:
        logger.error("sglang_ddtree: %s", refusal)

        def validate(server_args, _msg=refusal):  # noqa: ARG001 - the refusal, at argument checking
            raise ValueError(_msg)

    for name, spec_class in ((GPU_NAME, DDTreeGPUSpecAlgo), (CPU_NAME, DDTreeCPUSpecAlgo)):
        if get_spec(name) is None:
            SpeculativeAlgorithm.register(name, supports_overlap=True,
                                          validate_server_args=validate,
                                          spec_class=spec_class)(_worker_factory)
    if refusal is None:
        install_all()
    _registered = True
    logger.debug("sglang_ddtree: registered %s and %s", GPU_NAME, CPU_NAME)
