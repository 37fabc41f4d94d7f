"""Hook: ``ScheduleBatch.init_new`` (AROUND) -- a batch made in the plain regime takes SGLang's plain path.

Why: SGLang 0.5.16 chooses the speculative or the plain decode path per batch, from the batch's own
``spec_algorithm`` (``prepare_for_decode``: one KV slot a step instead of the speculative
reservation; ``Scheduler._forward_isolation``: no snapshot of every field; ``run_batch``: base's
overlap branch; the result processor: base's), but the scheduler gives every new batch the
server's algorithm.  While a DDTREE server's regime is plain (``sglang_ddtree/regime_state.py``),
this hook makes the new batch's ``spec_algorithm`` NONE, so it is prepared, run and processed as
plain decoding's (the DDTree worker hands it to the target: ``DDTreeWorker._forward_plain_batch``).
Any other server, and a DDTREE server in the speculative regime, keeps SGLang's value.

Checked against: SGLang 0.5.16 (``sglang/srt/managers/schedule_batch.py``: the classmethod
``ScheduleBatch.init_new(reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache,
model_config, enable_overlap, spec_algorithm, chunked_req=None, dllm_config=None)``, whose body
reads ``spec_algorithm`` only to store it; called by ``Scheduler`` for prefill batches, the idle
batch and hisparse decode batches).
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.init_new"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def init_new_in_regime(original, cls, *args, **kwargs):
    batch = original(cls, *args, **kwargs)
    from sglang_ddtree.regime_state import batch_algorithm

    batch.spec_algorithm = batch_algorithm(batch.spec_algorithm)
    return batch


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, init_new_in_regime, HookType.AROUND)
