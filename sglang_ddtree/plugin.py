"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] ddtree``).

SGLang calls :func:`register` in every one of its processes (CLI, Engine, one scheduler per TP
rank, DP controller, detokenizer) through ``sglang.srt.plugins.load_plugins()``.  It registers

* ``DDTREE-GPU``: the DDTree worker with every tree step on the GPU (Triton kernels);
* ``DDTREE-CPU``: the same worker with the tree built by the exact CPU heap (the published ports'
  recipe), the baseline of the A/B benchmark;

and the hooks in ``sglang_ddtree.patches``.  Importing the worker (and SGLang's CUDA-side
modules) is deferred to the worker factory, which runs only in scheduler processes.
"""
import logging

logger = logging.getLogger(__name__)

_registered = False


def _worker_factory(server_args):
    from sglang_ddtree.worker import DDTreeWorker

    return DDTreeWorker


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_ddtree.patches import install_all
    from sglang_ddtree.spec_algo import (CPU_NAME, GPU_NAME, DDTreeCPUSpecAlgo, DDTreeGPUSpecAlgo,
                                         validate_server_args)

    for name, spec_class in ((GPU_NAME, DDTreeGPUSpecAlgo), (CPU_NAME, DDTreeCPUSpecAlgo)):
        if get_spec(name) is None:
            SpeculativeAlgorithm.register(name, supports_overlap=True,
                                          validate_server_args=validate_server_args,
                                          spec_class=spec_class)(_worker_factory)
    install_all()
    _registered = True
    logger.debug("sglang_ddtree: registered %s and %s", GPU_NAME, CPU_NAME)
