"""Hook: ``DecodeCudaGraphRunner.get_spec_info`` (AROUND) -- capture the target verify graph WITH a mask.

Why: SGLang captures the target's TARGET_VERIFY CUDA graph with a dummy ``SpecInput`` built by
``get_spec_info``.  For the DFlash family it is a ``DFlashVerifyInput`` whose ``custom_mask`` is
None on triton / flashinfer / fa3 / trtllm (``dflash_utils.resolve_dflash_verify_mask_policy``:
a chain verify is plain causal attention).  The triton backend bakes that decision into the graph:
a graph captured without a mask replays causal attention and silently ignores the tree mask the
worker hands it (the classic bug: every sibling then sees its earlier siblings).  For DDTREE
algorithms this hook gives the *target* runner's capture input the runner's custom-mask buffer,
so the backend captures its masked path and copies each round's mask into its graph buffer on
replay.  The drafter's runner (block attention, no mask) and every other algorithm are untouched.

The adaptive budget (``sglang_ddtree/policy/adaptive.py``) captures one more target runner per extra verify
width; each goes through this hook with its own buffers, and the dummy input's width is that
runner's captured width (``get_spec_info`` reads it from the runner, not from server_args), so
nothing here depends on the width.

There is no SGLang hook for this (0.5.16 has no per-algorithm capture spec), hence the patch.
Checked against: SGLang 0.5.16 (``sglang/srt/model_executor/runner/decode_cuda_graph_runner.py``,
``get_spec_info`` at line 1293).  Exercised by the GPU lossless matrix (``bench/device/stage.py``
``*_ddtree_graph_*`` stages) and by ``tests/test_plugin.py`` (installation).
"""
from __future__ import annotations

TARGET = ("sglang.srt.model_executor.runner.decode_cuda_graph_runner."
          "DecodeCudaGraphRunner.get_spec_info")
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def get_spec_info_with_tree_mask(original, self, *args, **kwargs):
    spec_info = original(self, *args, **kwargs)
    from sglang_ddtree import switches
    from sglang_ddtree.spec_algo import DDTreeSpecAlgo

    mr = self.model_runner
    if (spec_info is not None and isinstance(mr.spec_algorithm, DDTreeSpecAlgo)
            and switches.CURRENT.graph_mask_patch
            and not mr.is_draft_worker and getattr(spec_info, "custom_mask", None) is None):
        spec_info.custom_mask = self.buffers.custom_mask
    return spec_info


# The test-bed switch ``graph_mask_patch`` = False (``sglang_ddtree/switches.py``; stage suffix
# ``nomaskpatch``) makes this hook pass the mask-less input through at capture, reproducing the
# mask-dropping graph so the test bed can check that its lossless check catches it.  Read at
# capture, not here: the switch may be set by a plugin that runs after this one.


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, get_spec_info_with_tree_mask, HookType.AROUND)
