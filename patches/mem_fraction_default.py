"""Hook: ``ServerArgs._handle_gpu_memory_settings`` (AROUND) -- remember whether the user sized the KV pool.

Why: the adaptive default builds, after SGLang sized its KV pool, a target state per extra verify
width and one for no-speculation rounds, each with its own CUDA graphs (their logits buffers are
most of it: ~4.3 GB for the Qwen3-8B shape on an H100, ``verify_states.state_memory_gb``).  SGLang's
``--mem-fraction-static`` heuristic knows nothing of them, so on an 80 GB card the widths did not
fit (2.25 GB free after the no-speculation state, s29: widths 8 / 16 / 32 not built).  When the user
did not give ``--mem-fraction-static``, DDTree lowers SGLang's heuristic value by the states' estimate
(``spec_algo.reserve_adaptive_state_memory``); a value the user gave is left as it is.  SGLang fills the
field in this method (``mem_fraction_static is None`` -> its heuristic), before the speculative hook
runs, so this records the two facts DDTree needs on the object: whether the field was None here and
the GPU's memory (MB, None off-GPU).

Checked against: SGLang 0.5.16 (``sglang/srt/server_args.py``: ``ServerArgs.__post_init__`` calls
``self._handle_gpu_memory_settings(gpu_mem)`` with ``gpu_mem = get_device_memory_capacity(device)``,
then later ``handle_speculative_decoding(self)``).
"""
from __future__ import annotations

TARGET = "sglang.srt.server_args.ServerArgs._handle_gpu_memory_settings"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)
GIVEN_ATTR = "_ddtree_mem_fraction_given"   # True: the user's --mem-fraction-static; False: SGLang's heuristic
GPU_MEM_ATTR = "_ddtree_gpu_mem_mb"


def record_mem_fraction_source(original, self, gpu_mem, *args, **kwargs):
    object.__setattr__(self, GIVEN_ATTR, self.mem_fraction_static is not None)
    object.__setattr__(self, GPU_MEM_ATTR, gpu_mem)
    return original(self, gpu_mem, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, record_mem_fraction_source, HookType.AROUND)
