"""Hook: ``get_req_to_token_extra_context_len`` (AROUND) -- rows wide enough for the DDTREE reservation.

Why: ``req_to_token`` rows are ``context_len + extra`` wide, with ``extra = 4 + N`` in SGLang 0.5.16
(N = verify width for DDTREE).  A round reserves up to ``committed + max(2N, N + B)``
(``sglang_ddtree/reservation.py``) with ``committed`` up to ``context_len - 1``, so a row would be
overrun (into the next request's row) near the context limit whenever ``max(2N, N + B) > N + 5``.
For DDTREE servers the extra becomes at least ``max(2N, N + B) + 1``.  Other algorithms: untouched.

Checked against: SGLang 0.5.16 (``sglang/srt/mem_cache/allocation_sizing.py``
``get_req_to_token_extra_context_len(server_args)``, imported by name into
``mem_cache/kv_cache_configurator.py``, which sizes the pool with it).
"""
from __future__ import annotations

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.get_req_to_token_extra_context_len"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def extra_context_len_with_block(original, server_args, *args, **kwargs):
    from sglang_ddtree.reservation import ddtree_shape, reserve_len

    value = original(server_args, *args, **kwargs)
    shape = ddtree_shape(server_args)
    return value if shape is None else max(value, reserve_len(*shape) + 1)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, extra_context_len_with_block, HookType.AROUND)
