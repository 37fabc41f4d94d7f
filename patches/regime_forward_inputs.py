"""Hook: ``resolve_forward_inputs`` (AROUND) -- a plain-regime decode batch gathers its input token.

Why: under SGLang 0.5.16 a decode batch's input ids (the token each request sampled last step, not
yet in the KV cache) come from ``FutureMap.output_tokens_buf[req_pool_indices]``, where the
previous step's result was relayed (``Scheduler._relay_forward_payload``: the sampled ids of a
plain step, the bonus token of a speculative round).  ``resolve_forward_inputs`` gathers them only
when the FutureMap's algorithm is NONE, i.e. on servers without speculation; a speculative batch
takes its tokens from its draft input instead.  A DDTREE server's FutureMap carries the server's
algorithm, so a batch made in the plain regime (``patches/regime_batch_algo.py``, its
``spec_algorithm`` NONE) would reach the worker without input ids.  This hook gathers them exactly
as the original does for a server without speculation: decode batches only, once
(``input_ids`` still None), from the same buffer.  Every other batch, and every batch of another
server, is left to SGLang's code.

Checked against: SGLang 0.5.16 (``sglang/srt/managers/overlap_utils.py``
``resolve_forward_inputs(batch, future_map)``; imported by name into
``sglang/srt/managers/scheduler.py``, which HookRegistry's propagation of the patch covers).
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.overlap_utils.resolve_forward_inputs"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def resolve_with_plain_batches(original, batch, future_map, *args, **kwargs):
    original(batch, future_map, *args, **kwargs)
    algo = getattr(batch, "spec_algorithm", None)
    if (batch.input_ids is None and algo is not None and algo.is_none()
            and not future_map.spec_algo.is_none() and batch.forward_mode.is_decode()):
        batch.input_ids = future_map.output_tokens_buf[batch.req_pool_indices]


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, resolve_with_plain_batches, HookType.AROUND)
