"""Hook: ``get_alloc_len_per_decode`` (AROUND) -- account for the DDTREE reservation of max(2N, N + B).

Why: SGLang's scheduler sizes its decode memory checks (``get_alloc_reserve_per_decode`` = 2 x this,
``ScheduleBatch`` decode-memory checks) and the pool's per-request reserve from the per-decode
allocation length, which for DDTREE is the verify width N.  ``patches/dflash_prepare_for_decode.py``
reserves ``max(2N, N + B)`` when N < B; without this hook the scheduler would admit batches whose
reservation then does not fit the KV pool.  For DDTREE servers with N < B the length becomes
``ceil(max(2N, N + B) / 2)``; otherwise SGLang's value.  Registered on the function and on the name
``pool_configurator`` imported from it.

Checked against: SGLang 0.5.16 (``sglang/srt/mem_cache/allocation_sizing.py``:
``get_alloc_len_per_decode(server_args=None)``; ``model_executor/pool_configurator.py`` imports it by
name).
"""
from __future__ import annotations

TARGETS = ("sglang.srt.mem_cache.allocation_sizing.get_alloc_len_per_decode",
           "sglang.srt.model_executor.pool_configurator.get_alloc_len_per_decode")
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def alloc_len_with_block(original, server_args=None, *args, **kwargs):
    from sglang_ddtree.reservation import per_decode_len, short_reservation

    value = original(server_args, *args, **kwargs)
    sa = server_args
    if sa is None:
        from sglang.srt.runtime_context import get_server_args
        sa = get_server_args()
    shape = short_reservation(sa)
    return value if shape is None else max(value, per_decode_len(*shape))


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in TARGETS:
        HookRegistry.register(target, alloc_len_with_block, HookType.AROUND)
