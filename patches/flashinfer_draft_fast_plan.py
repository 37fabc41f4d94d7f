"""Hook: ``FlashInferAttnBackend.init_forward_metadata_out_graph`` (AROUND) -- with the A/B switch
``draft_fast_plan`` (off by default until an A/B under load times it; lossless on the GPU test bed,
run 24, H100), the drafter's TARGET_VERIFY CUDA graphs re-plan through SGLang's sync-free
``fast_prefill_plan`` instead of flashinfer's ``plan()``.

Why: with ``--attention-backend flashinfer`` the DFlash drafter's attention is flashinfer too
(SGLang's ``_resolve_dflash_draft_attention_backend``), and its block forward is a TARGET_VERIFY
graph replay, before which ``init_forward_metadata_out_graph`` re-plans the graph's prefill
wrappers.  ``BatchPrefillWithPagedKVCacheWrapper.plan`` copies ``qo_indptr`` (and the KV indptr) to
the host with a blocking ``.to("cpu")``: every tree round's draft stage then waits until the GPU
has drained the previous round, and the GPU idles until the drafter is launched (s32's profile: 5-7
ms of host time in the draft stage against 2.5 ms of GPU at bs 16; run 24's ``_synccheck`` stage:
121 of 150 tree rounds synchronised in ``plan()``; with the switch none did there (33 of 155 at
other sites), bs-1 step 4.58 against 5.30 ms).  SGLang 0.5.16 installs ``fast_prefill_plan`` -- the same plan computed
from host-known lengths -- only for EAGLE's draft-extend graphs.  A DDTree drafter's block has a
fixed layout (``B`` queries a request, no custom mask), so the same function serves it, given a host
upper bound of every request's KV length (prefix + B: the worker passes its host prefix bound + B
as the forward's ``seq_lens_cpu`` while this is on, ``DDTreeWorker._draft_block``).  A bound above
the device length leaves empty KV chunks in the plan; below it would drop keys.

Applies only to a backend the worker marked (:func:`enable`: the drafter's, a plain
``FlashInferAttnBackend`` on the fa2 prefill path with no sliding-window / cross-attention
dispatch), at capture of a TARGET_VERIFY graph whose input has no custom mask; every other call
(the target, other modes, other algorithms, the switch off) is SGLang's, unchanged.

Checked against: SGLang 0.5.16 (``sglang/srt/layers/attention/flashinfer_backend.py``:
``init_forward_metadata_out_graph(self, forward_batch, in_capture=False)`` at line 703,
``prefill_cuda_graph_metadata[bs]`` filled at capture, ``fast_prefill_plan`` at line 187 and its
use in ``FlashInferIndicesUpdaterPrefill.call_begin_forward`` from ``seq_lens_cpu`` and
``spec_info.num_tokens_per_req``; ``prefill_backend`` / ``dispatch_reason``).
"""
from __future__ import annotations

import functools
from typing import Optional

TARGET = ("sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend."
          "init_forward_metadata_out_graph")
CHECKED_SGLANG_VERSIONS = ("0.5.16",)
MARK = "_ddtree_draft_fast_plan"


def not_covered(backend) -> Optional[str]:
    """Why ``backend`` cannot take the fast plan (None: it can)."""
    try:
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    except ImportError as e:   # no flashinfer on this machine
        return f"flashinfer backend unavailable ({e})"
    if not isinstance(backend, FlashInferAttnBackend):
        return f"the drafter's attention backend is {type(backend).__name__}, not FlashInferAttnBackend"
    if getattr(backend, "prefill_backend", None) != "fa2":
        return f"flashinfer prefill backend {getattr(backend, 'prefill_backend', None)!r}, not fa2"
    if getattr(backend, "dispatch_reason", None) is not None:
        return f"wrapper dispatch {backend.dispatch_reason} (sliding window / cross attention)"
    return None


def enable(backend) -> None:
    """Mark the drafter's flashinfer backend (ValueError with the reason where not covered)."""
    why = not_covered(backend)
    if why:
        raise ValueError(why)
    setattr(backend, MARK, True)


def fast_plan_out_graph(original, self, forward_batch, *args, **kwargs):
    out = original(self, forward_batch, *args, **kwargs)
    in_capture = kwargs.get("in_capture", args[0] if args else False)
    if not (in_capture and getattr(self, MARK, False) and forward_batch.forward_mode.is_target_verify()):
        return out
    spec = forward_batch.spec_info
    if getattr(spec, "custom_mask", None) is not None or getattr(spec, "ragged_verify_layout", None) is not None:
        return out
    from sglang.srt.layers.attention.flashinfer_backend import fast_prefill_plan

    for w in self.prefill_cuda_graph_metadata[forward_batch.batch_size]:
        w.begin_forward = functools.partial(fast_prefill_plan, w)
    return out


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, fast_plan_out_graph, HookType.AROUND)
