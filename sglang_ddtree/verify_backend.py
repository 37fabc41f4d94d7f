"""The target's verify backend, as the worker meets it at start-up and in a round: which backend
object a TARGET_VERIFY runs on (behind SGLang's prefill / decode split and the hybrid-model
wrapper), what is refused there (a backend that would verify the tree as a causal chain), our
tree-verify attention enabled on it (and, with the A/B switch ``draft_attn``, on the drafter's), and
where a round's FULL_MASK goes when SGLang's masked kernel verifies (the captured graph buffer, an
eager verify, or a private buffer)."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Optional

import torch

from . import switches, verify_attn_hook

logger = logging.getLogger(__name__)


def verify_attention_backend(attn_backend):
    """The backend object a TARGET_VERIFY forward of the target runs on: unwraps SGLang's
    HybridAttnBackend (prefill / decode split, by speculative_attention_mode) and the hybrid-model
    wrapper (``full_attn_backend``)."""
    b = attn_backend
    for _ in range(4):
        if hasattr(b, "prefill_backend") and hasattr(b, "decode_backend"):
            b = b.decode_backend if getattr(b, "spec_attn_is_decode", False) else b.prefill_backend
        elif getattr(b, "full_attn_backend", None) is not None:
            b = b.full_attn_backend
        else:
            return b
    return b


def _find_graph_mask_buffer(attn_backend) -> Optional[torch.Tensor]:
    """The CUDA-graph custom-mask buffer (triton: ``cuda_graph_custom_mask``) of the backend the
    target's verify runs on: behind a prefill / decode split, the side speculative_attention_mode
    picks (the other side may have a buffer of that name too, e.g. flashinfer's)."""
    return getattr(verify_attention_backend(attn_backend), "cuda_graph_custom_mask", None)


def check_tree_verify_backend(attn_backend, algo: str) -> None:
    """Raise ValueError unless the target's verify runs on SGLang's triton backend, the one whose
    TARGET_VERIFY applies our tree mask (eager and under CUDA graphs).  Argument handling already
    resolves it; this guards a server whose resolution was bypassed or overridden, which would
    otherwise verify the tree with a causal chain mask and emit wrong tokens."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    b = verify_attention_backend(attn_backend)
    if not isinstance(b, TritonAttnBackend):
        raise ValueError(f"{algo}: the target verifies on {type(b).__name__}, which does not apply "
                         "the tree attention mask; launch with --attention-backend triton")


def disable_causal_verify_shortcut(attn_backend, algo: str) -> bool:
    """Turn off SGLang 0.5.16's split-KV verify on the target's triton backend.  That path
    (``verify_splitkv_fwd``; on gfx95 GPUs, SGLANG_ENABLE_SPLITKV_VERIFY defaults to on) computes
    pure-causal attention and is enabled whenever speculative_eagle_topk == 1, which DDTree sets:
    it would verify the tree as a chain and emit wrong tokens.  The fallback, extend_attention_fwd,
    applies the tree mask.  True when it was on."""
    b = verify_attention_backend(attn_backend)
    if not getattr(b, "use_verify_splitkv", False):
        return False
    b.use_verify_splitkv = False
    logger.warning("%s: SGLang's split-KV verify (causal chain only) disabled on the target's "
                   "attention backend: the tree verify needs its mask", algo)
    return True


def _enable_or_fall_back(enable, *, must: bool, algo: str, var: str, what: str, fallback: str):
    """``enable()`` -> its state; where it raises: re-raised when ``must`` (``=ddtree``), else None
    with the reason logged as ``"<algo>: <what> = <fallback> (<var>=auto: why)"`` (a ValueError: not
    covered, INFO; anything else: enabling failed, WARNING)."""
    try:
        return enable()
    except ValueError as e:
        if must:
            raise
        logger.info("%s: %s = %s (%s=auto: %s)", algo, what, fallback, var, e)
    except Exception as e:  # noqa: BLE001 - auto: an optimisation; =ddtree surfaces it
        if must:
            raise
        logger.warning("%s: %s = %s (%s=auto; enabling ours failed: %s: %s)", algo, what, fallback, var,
                       type(e).__name__, e)
    return None


def enable_tree_verify_attention(attn_backend, model_runner, algo: str, drafter_backend=None):
    """Our tree-verify attention on the target's verify backend (``verify_attn_hook.enable``), its
    state; None when ``SGLANG_DDTREE_VERIFY_ATTN=sglang``, or under ``auto`` (the default) when it
    does not cover this verify (the reason logged; SGLang's masked kernel then verifies).  With
    ``=ddtree`` what is not covered, or a drafter verifying on the same backend object, is a
    ValueError."""
    what, fallback = "target verify attention", "SGLang's masked extend kernel"
    if not verify_attn_hook.enabled(os.environ, algo):
        logger.info("%s: %s = %s (%s=sglang)", algo, what, fallback, verify_attn_hook.ENV)
        return None
    target = verify_attention_backend(attn_backend)

    def enable():
        if drafter_backend is not None and verify_attention_backend(drafter_backend) is target:
            raise ValueError(f"{algo}: {verify_attn_hook.ENV}: the drafter's attention backend is "
                             "the target's; the hook would also take the drafter's (unmasked) verify")
        return verify_attn_hook.enable(target, model_runner.model, algo)
    state = _enable_or_fall_back(enable, must=verify_attn_hook.required(os.environ, algo), algo=algo,
                                 var=verify_attn_hook.ENV, what=what, fallback=fallback)
    if state is not None:
        logger.info("%s: %s = sglang_ddtree tree_verify_attention%s (bitmask %s, %d prefix splits)", algo,
                    what, "_mla" if state.use_mla else "", tuple(state.mask_words.shape), state.num_splits)
    return state


def enable_draft_block_attention(drafter_backend, draft_model, block_size: int, req_to_token,
                                 algo: str, target_backend=None):
    """Our kernel for the drafter's block forward (the A/B switch ``draft_attn``, off by default):
    the state (an all-set bitmask of ``block_size`` columns) on the backend the drafter's
    TARGET_VERIFY runs on; None when off, or under ``auto`` when not covered (the reason logged).
    ``req_to_token``: the pool the worker addresses the block's KV slots with; the drafter's backend
    must read the same one (the kernel finds prefix and block slots there).  ``=ddtree``: what is not
    covered is a ValueError."""
    m = verify_attn_hook.draft_mode()
    if m == "sglang":
        return None
    var, what = verify_attn_hook.DRAFT_SWITCH, "drafter block attention"

    def enable():
        if drafter_backend is None or draft_model is None:
            raise ValueError(f"{algo}: {var}: no drafter backend / model")
        backend = verify_attention_backend(drafter_backend)
        if target_backend is not None and backend is verify_attention_backend(target_backend):
            raise ValueError(f"{algo}: {var}: the drafter's attention backend is the target's")
        r2t = getattr(backend, "req_to_token", None)
        if r2t is None or r2t.data_ptr() != req_to_token.data_ptr() or r2t.shape != req_to_token.shape:
            raise ValueError(f"{algo}: {var}: the drafter's backend reads another req_to_token than the "
                             "one its block slots come from (a compact draft cache?)")
        return verify_attn_hook.enable(backend, draft_model, algo, num_verify=int(block_size),
                                       all_visible=True)
    state = _enable_or_fall_back(enable, must=m == "ddtree", algo=algo, var=var, what=what,
                                 fallback="SGLang's extend kernel")
    if state is not None:
        logger.info("%s: %s = sglang_ddtree tree_verify_attention%s (block %d, all visible, %d prefix "
                    "splits)", algo, what, "_mla" if state.use_mla else "", state.num_verify, state.num_splits)
    return state


def _graph_mask_capacity(graph_buf: torch.Tensor) -> int:
    """The elements a round's verify mask may use of the target's CUDA-graph mask buffer; the
    test-bed switch ``graph_mask_cap`` pretends it is smaller, so the eager-verify fallback of
    ``_mask_out_buffer`` runs at test-bed sizes (stage suffix ``maskcap<N>``)."""
    cap = switches.CURRENT.graph_mask_cap
    return min(cap, graph_buf.numel()) if cap else graph_buf.numel()


def plan_verify_mask_buffer(*, bs: int, need: int, graph_max_bs: Optional[int],
                            graph_buf_numel: Optional[int]) -> str:
    """Where a round's verify mask of (host upper bound) ``need`` elements goes:
    ``"graph"``: the target graph replays this batch and the mask fits its captured buffer;
    ``"eager"``: the graph would replay (bs <= its max batch) but the mask does not fit: the verify
    must run eagerly; ``"own"``: no graph replay for this batch, a private buffer."""
    graph_used = graph_max_bs is not None and graph_buf_numel is not None and bs <= graph_max_bs
    if not graph_used:
        return "own"
    return "graph" if need <= graph_buf_numel else "eager"


@contextlib.contextmanager
def _eager_verify(model_runner, eager: bool):
    """Make the target's decode graph runner decline this verify (``can_run_graph`` -> False), so
    ``prepare_for_verify`` builds eager attention metadata and ``ModelRunner._forward_raw`` runs the
    forward eagerly.  Restored on exit."""
    runner = model_runner.decode_cuda_graph_runner
    if not eager or runner is None:
        yield
        return
    runner.can_run_graph = lambda forward_batch: False
    try:
        yield
    finally:
        del runner.can_run_graph


def enable_draft_fast_plan(drafter_backend, algo: str) -> bool:
    """The A/B switch ``draft_fast_plan``: mark the drafter's flashinfer backend so its TARGET_VERIFY
    graphs re-plan with SGLang's sync-free ``fast_prefill_plan``
    (``patches/flashinfer_draft_fast_plan.py``).  True when marked; where not covered (another
    backend, a non-fa2 or dispatching flashinfer) the reason is logged and the drafter plans as
    SGLang does."""
    from sglang_ddtree.patches import flashinfer_draft_fast_plan as fp

    what = "drafter flashinfer plan"
    try:
        fp.enable(drafter_backend)
    except ValueError as e:
        logger.info("%s: %s = flashinfer's plan() (switch draft_fast_plan: %s)", algo, what, e)
        return False
    logger.info("%s: %s = SGLang's fast_prefill_plan from host lengths (switch draft_fast_plan)", algo, what)
    return True
