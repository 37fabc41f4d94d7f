"""Our tree-verify attention inside SGLang's triton backend (issue 13 item 2), chosen by
``SGLANG_DDTREE_VERIFY_ATTN``: ``auto`` (the default, unset or empty): ours wherever it covers the
target's verify (SGLang's masked ``extend_attention_fwd`` otherwise, the reason logged at start-up);
``ddtree``: ours or a ValueError at start-up naming what is not covered; ``sglang``: SGLang's own path
(the hook not even installed).  Why the default (bench/results/kimicost_trace_kernels_h200.md, H200,
SGLang 0.5.16): with the tree's custom mask SGLang's MLA extend kernel compiles to 128 registers per
thread (the causal variant DFLASH runs: 255) and costs 310 us a call at bs 16 against DFLASH's 132;
ours, 50 us; the DDTREE-GPU width-8 verify went from 1.16x DFLASH's per round to 0.96x.

With the hook on, the worker calls :func:`enable` at start-up on the backend object the target's
TARGET_VERIFY runs on (``verify_backend.verify_attention_backend``; one per verify width with the adaptive
budget).  :func:`enable` refuses (ValueError) what the hook does not cover and attaches a
:class:`VerifyAttnState` to that backend instance.  ``patches/triton_verify_attention.py`` hooks
``TritonAttnBackend.forward_extend``: on a backend carrying a state and a TARGET_VERIFY batch it runs
:func:`forward_tree_verify` (the tree's K/V written into the cache exactly as SGLang does, then
``tree_verify_attention`` / ``tree_verify_attention_mla`` over the cache with the round's bitmask);
every other call (the drafter's backend, which also runs TARGET_VERIFY, prefill, other servers) goes
to SGLang's code unchanged -- unless the A/B switch ``draft_attn`` (off by default) attached an
``all_visible`` state to the drafter's backend: its block forward (ENCODER_ONLY layers, each block
query sees the whole context and block) then runs the same kernel with every bit set.

Per round the worker writes ``Tree.mask_words [bs, N, ceil(N/32)] int32`` into the state's persistent
``mask_words [max_bs, N, ceil(N/32)]`` (:meth:`VerifyAttnState.write_mask`) and builds no FULL_MASK.
Under CUDA graphs the captured kernel reads that buffer (rows ``[:graph bs]``), the graph's static
``seq_lens`` (= prefix lengths) and ``req_pool_indices``, and ``req_to_token``; its fp32 split
workspace is a view of the backend's own ``cuda_graph_attn_logits`` / ``cuda_graph_attn_lse``
(decode-only buffers, idle during a verify) whenever it fits, else a per-call allocation.

Assumption (true for the DDTree worker: ``assign_extend_cache_locs`` reads them from there): the
tree's KV slots ``out_cache_loc[b*N + i]`` are ``req_to_token[req_pool_indices[b], prefix_b + i]``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Mapping, Optional

import torch

ENV = "SGLANG_DDTREE_VERIFY_ATTN"
STATE_ATTR = "_ddtree_verify_attn"
MODES = ("auto", "ddtree", "sglang")
DEFAULT_MODE = "auto"


# The drafter's block forward (DFLASH's, which DDTREE runs: TARGET_VERIFY on the drafter's own backend,
# every layer ENCODER_ONLY, so each block query sees the whole context and the whole block) through
# the same kernel with an all-set bitmask.  Off by default until it is served on the GPU host: at 32k
# prompts that forward costs 11.5 ms a round in SGLang's extend kernel (scale_h200 run 14).  The A/B
# switch draft_attn (switches.py; arm suffix _dattn) turns it on; not a server setting yet.
DRAFT_SWITCH = "switch draft_attn"


def _mode(var: str, default: str, env: Optional[Mapping[str, str]], algo: str) -> str:
    env = os.environ if env is None else env
    raw = (env.get(var) or "").strip().lower() or default
    if raw not in MODES:
        raise ValueError(f"{algo}: {var} must be one of {', '.join(MODES)} (unset = {default}), got "
                         f"{env.get(var)!r}")
    return raw


def mode(env: Optional[Mapping[str, str]] = None, algo: str = "DDTREE") -> str:
    """``"auto"`` (unset / empty / ``auto``), ``"ddtree"`` or ``"sglang"``; ValueError otherwise."""
    return _mode(ENV, DEFAULT_MODE, env, algo)


def draft_mode() -> str:
    """The switch ``draft_attn``: ``"sglang"`` (default: the drafter's block attention in SGLang's
    kernel), ``"auto"`` (ours where it covers the drafter, SGLang's otherwise) or ``"ddtree"`` (ours
    or a start-up error)."""
    from . import switches

    return switches.CURRENT.draft_attn


def enabled(env: Optional[Mapping[str, str]] = None, algo: str = "DDTREE") -> bool:
    """Whether our verify attention is wanted (``auto`` or ``ddtree``): the hook is installed and
    the worker tries :func:`enable` (``auto`` falls back where it is not covered)."""
    return mode(env, algo) != "sglang"


def required(env: Optional[Mapping[str, str]] = None, algo: str = "DDTREE") -> bool:
    """``ddtree``: a verify it cannot serve is a start-up error, not a fallback."""
    return mode(env, algo) == "ddtree"


@dataclasses.dataclass
class VerifyAttnState:
    """What the hooked verify of one target backend reads.  ``mask_words [max_bs, N, NW]`` int32
    (persistent, written by the worker each round); ``num_splits``: the kernel's prefix split count
    (host int, fixed: the captured grid depends on it)."""

    num_verify: int
    mask_words: torch.Tensor
    num_splits: int
    use_mla: bool
    calls: int = 0           # hooked layer calls (host counter; tests and logs)
    splits_fixed: bool = False   # switch verify_attn_splits set: every batch uses num_splits
    all_visible: bool = False    # the drafter's block: every bit set at start-up, never rewritten

    def splits_for(self, bs: int, M: int, Hkv: int, d1: int, dv: int) -> int:
        """The split count of a verify of ``bs`` requests with head dims ``d1`` (scores) / ``dv``
        (values) (host ints: a graph captured at one batch size keeps its grid): ``num_splits`` is
        the cap (it already holds the context-length bound), the kernel's occupancy rule picks
        below it (large batches need no split: each split costs a partial write + merge read)."""
        if self.splits_fixed:
            return self.num_splits
        from sglang_ddtree.kernels.tree_verify_attention import block_dim, num_sms, occupancy_num_splits
        dev = self.mask_words.device
        return occupancy_num_splits(bs, M, Hkv, 1 << 30, block_d1=block_dim(d1), block_dv=block_dim(dv),
                                    cap=self.num_splits, sms=num_sms(dev) if self.mask_words.is_cuda else None)

    @property
    def max_bs(self) -> int:
        return self.mask_words.shape[0]

    def write_mask(self, mask_words: torch.Tensor) -> None:
        """mask_words [bs, N, NW] int32 (``Tree.mask_words``) -> rows [:bs] of the buffer."""
        if self.all_visible:
            raise ValueError("the drafter block's bitmask is fixed (every query sees the whole block)")
        bs = mask_words.shape[0]
        if tuple(mask_words.shape[1:]) != tuple(self.mask_words.shape[1:]) or bs > self.max_bs:
            raise ValueError(f"tree mask_words {tuple(mask_words.shape)} do not fit the verify "
                             f"bitmask buffer {tuple(self.mask_words.shape)}")
        self.mask_words[:bs].copy_(mask_words)


def state_of(backend) -> Optional[VerifyAttnState]:
    s = getattr(backend, STATE_ATTR, None)
    return s if isinstance(s, VerifyAttnState) else None


def hook_installed() -> bool:
    """True when ``patches/triton_verify_attention.py``'s hook was applied to SGLang's
    ``TritonAttnBackend.forward_extend`` (registered with HookRegistry and patched)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_ddtree.patches import triton_verify_attention as P

    return P.TARGET in HookRegistry._patched and any(
        h is P.tree_verify_forward_extend for _, h, _ in HookRegistry._hooks.get(P.TARGET, ()))


def _layer_problems(model, all_visible: bool = False) -> List[str]:
    """Why ``model``'s attention layers are not covered: a target's must be causal decoder layers
    (the tree's ancestor mask), a drafter block's (``all_visible``) ENCODER_ONLY ones (no mask)."""
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention

    want = AttentionType.ENCODER_ONLY if all_visible else AttentionType.DECODER
    bad = []
    for name, m in model.named_modules():
        if not isinstance(m, RadixAttention):
            continue
        why = []
        if (m.logit_cap or 0) > 0:
            why.append(f"logit cap {m.logit_cap}")
        if m.sliding_window_size is not None and m.sliding_window_size > -1:
            why.append(f"sliding window {m.sliding_window_size}")
        if m.k_scale is not None or m.v_scale is not None:
            why.append("KV scales (quantized KV cache)")
        if (getattr(m, "xai_temperature_len", -1) or -1) > 0:
            why.append("xai temperature")
        if m.is_cross_attention or m.attn_type != want:
            why.append(f"attention type {m.attn_type} / cross={m.is_cross_attention}")
        if getattr(m, "use_irope", False):
            why.append("chunked (irope) attention")
        if why:
            bad.append(f"{name or type(m).__name__}: {', '.join(why)}")
    return bad


def backend_problems(backend, model, all_visible: bool = False) -> List[str]:
    """Why the hook cannot serve this backend / model's verify ([] = covered); ``all_visible``: the
    drafter's block forward instead."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    if not isinstance(backend, TritonAttnBackend):
        return [f"the verify runs on {type(backend).__name__}; only SGLang's TritonAttnBackend is "
                "covered (launch with --attention-backend triton)"]
    why = []
    if type(backend).forward_extend is not TritonAttnBackend.forward_extend:
        why.append(f"{type(backend).__name__} overrides forward_extend")
    if not hook_installed():
        why.append("the forward_extend hook is not installed (patches/triton_verify_attention.py)")
    if getattr(backend, "dcp_size", 1) != 1:
        why.append("decode context parallelism")
    if getattr(backend, "enable_deterministic", False):
        why.append("--enable-deterministic-inference")
    if (getattr(backend, "sliding_window_size", None) or 0) > 0 or getattr(
            backend, "use_sliding_window_kv_pool", False):
        why.append("sliding-window attention / SWA KV pool")
    if getattr(backend, "_translate_kv_loc", None) is not None:
        why.append("the unified (virtual-slot) KV pool")
    if getattr(backend, "page_size", 1) != 1:
        why.append(f"page size {backend.page_size}")
    if getattr(backend, "skip_prefill", False):
        why.append("a skip_prefill backend")
    pool_dtype = getattr(getattr(backend, "token_to_kv_pool", None), "dtype", None)
    if pool_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        why.append(f"KV cache dtype {pool_dtype}")
    return why + _layer_problems(model, all_visible)


def splits_override() -> Optional[int]:
    """The switch ``verify_attn_splits``: an integer in [1, 64], None when not set."""
    from . import switches

    return switches.CURRENT.verify_attn_splits


def default_splits(backend) -> int:
    """Prefix splits: the kernel's rule on the context length, capped so the workspace fits the
    backend's own decode buffers (``max_kv_splits`` per head); the switch ``verify_attn_splits``
    overrides (a larger workspace is then allocated per call)."""
    from sglang_ddtree.kernels.tree_verify_attention import default_num_splits

    n = splits_override()
    if n is not None:
        return n
    cap = max(1, int(getattr(backend, "max_kv_splits", 2)) - 1)
    return max(1, min(default_num_splits(int(backend.max_context_len)), cap))


def all_set_words(max_bs: int, N: int, device) -> torch.Tensor:
    """``[max_bs, N, ceil(N/32)]`` int32 with bits ``0 .. N-1`` of every row set: every query sees
    all N block tokens (the drafter's non-causal block)."""
    cols = torch.arange(32 * ((N + 31) // 32), dtype=torch.int64).view(-1, 32)
    bits = (cols < N).to(torch.int64) << (cols % 32)
    word = bits.sum(1)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)    # as int32 bit patterns
    return word.view(1, 1, -1).expand(max_bs, N, -1).contiguous().to(device)


def enable(backend, model, algo: str = "DDTREE", *, num_verify: Optional[int] = None,
           all_visible: bool = False) -> VerifyAttnState:
    """Attach a :class:`VerifyAttnState` to ``backend`` (start-up; ValueError when not covered).
    ``model``: the target's nn.Module (its RadixAttention layers are checked).  ``all_visible``: the
    drafter's backend and model instead: its block forward of ``num_verify`` tokens, every query
    seeing the whole context and block (the bitmask set once, here)."""
    var = DRAFT_SWITCH if all_visible else ENV
    why = backend_problems(backend, model, all_visible)
    if why:
        what = "the drafter's block attention" if all_visible else "this target's verify"
        raise ValueError(f"{algo}: {var}=ddtree cannot serve {what}: "
                         + "; ".join(why) + f". Unset {var} to run it with SGLang's kernel.")
    N = int(backend.num_draft_tokens if num_verify is None else num_verify)
    if N < 1:
        raise ValueError(f"{algo}: {var}: block / verify width must be >= 1, got {N}")
    max_bs = int(backend.req_to_token_pool.size)
    if all_visible:
        words = all_set_words(max_bs, N, backend.device)
    else:
        words = torch.zeros((max_bs, N, (N + 31) // 32), dtype=torch.int32, device=backend.device)
    state = VerifyAttnState(num_verify=N, mask_words=words, num_splits=default_splits(backend),
                            use_mla=bool(backend.use_mla), splits_fixed=splits_override() is not None,
                            all_visible=all_visible)
    setattr(backend, STATE_ATTR, state)
    return state


def _workspace(backend, T: int, H: int, NS: int, DV: int, device):
    """fp32 ([T, H, NS, DV], [T, H, NS]): views of the backend's decode buffers when they fit."""
    lo = getattr(backend, "cuda_graph_attn_logits", None)
    ll = getattr(backend, "cuda_graph_attn_lse", None)
    n_o, n_l = T * H * NS * DV, T * H * NS
    if (lo is not None and ll is not None and lo.dtype == torch.float32 and ll.dtype == torch.float32
            and lo.is_contiguous() and ll.is_contiguous() and lo.numel() >= n_o and ll.numel() >= n_l
            and lo.device == device):
        return lo.view(-1)[:n_o].view(T, H, NS, DV), ll.view(-1)[:n_l].view(T, H, NS)
    return (torch.empty((T, H, NS, DV), dtype=torch.float32, device=device),
            torch.empty((T, H, NS), dtype=torch.float32, device=device))


def forward_tree_verify(state: VerifyAttnState, backend, q, k, v, layer, forward_batch,
                        save_kv_cache=True, sinks=None, score_mod=None, aux_tensors=None):
    """``TritonAttnBackend.forward_extend`` for a TARGET_VERIFY batch of ``bs * N`` tokens:
    q ``[bs*N, Hq*D]`` (or ``[bs*N, Hq, D]``), k / v the tree's K/V ``[bs*N, Hkv, D / Dv]`` (None:
    already in the cache) -> ``[bs*N, Hq*Dv]``.  MLA (``backend.use_mla``): q ``[T, H, L+R]`` =
    cat(q_nope absorbed, q_rope), k ``[T, 1, L+R]``, v = its latent ``[T, 1, L]``."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_ddtree.kernels.tree_verify_attention import (tree_verify_attention,
                                                             tree_verify_attention_mla)

    if sinks is not None or score_mod is not None or aux_tensors is not None:
        raise RuntimeError(f"{ENV}=ddtree: layer {layer.layer_id} passes attention sinks / score_mod, "
                           "which the tree-verify kernel does not apply")
    if layer.k_scale is not None or layer.v_scale is not None:
        raise RuntimeError(f"{ENV}=ddtree: layer {layer.layer_id} has KV scales (not covered)")
    Hq, D, DV = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    N = state.num_verify
    T = q.shape[0]
    bs = T // N
    if T != bs * N or bs > state.max_bs or forward_batch.seq_lens.shape[0] < bs:
        raise RuntimeError(f"{ENV}=ddtree: verify batch of {T} tokens is not bs x {N} with bs <= "
                           f"{state.max_bs} (seq_lens {tuple(forward_batch.seq_lens.shape)})")

    attn_out = getattr(forward_batch, "_attn_output", None)
    if attn_out is not None:
        o = attn_out
    elif D != DV:
        o = q.new_empty((T, Hq * DV))
    else:
        o = torch.empty_like(q)

    # the tree's own K/V into the cache: the calls SGLang's forward_extend makes (k_scale None)
    if k is None and v is None:
        pass                                      # already in the cache (cross-layer KV sharing)
    elif k is None or v is None:
        raise ValueError("Both k and v should be None or not None")
    else:
        # save_kv_cache=False is SGLang's "the caller wrote the K/V already": Qwen3-MoE's attention
        # (SGLang 0.5.16, `enable_fused_set_kv_buffer`: bf16 cache on CUDA) stores k / v inside its
        # fused RoPE kernel.  SGLang's extend kernel reads the new tokens from k / v, ours reads them
        # from the cache, so the tree's K/V is written here in both cases: the same rows, the same
        # values (k after RoPE), T x Hkv x (D + Dv) elements a layer.  Without the write a caller
        # that did not store them would leave ours reading stale slots.
        md = backend.forward_metadata
        loc_info = KVWriteLoc(forward_batch.out_cache_loc, md.swa_out_cache_loc,
                              full_loc=md.out_cache_loc_full_physical)
        backend._set_kv_buffer(forward_batch, layer, loc_info, k, v)

    pool = backend.token_to_kv_pool
    Hkv = 1 if state.use_mla else layer.tp_k_head_num
    splits = state.splits_for(bs, N * (Hq // Hkv), Hkv, DV if state.use_mla else D, DV)
    common = dict(req_to_token=backend.req_to_token, req_pool_indices=forward_batch.req_pool_indices[:bs],
                  prefix_lens=forward_batch.seq_lens[:bs], mask_words=state.mask_words[:bs],
                  sm_scale=layer.scaling, num_splits=splits)
    NS = splits + 1
    q3 = q.view(T, Hq, D)
    out3 = o.view(T, Hq, DV)
    if state.use_mla:
        if layer.tp_k_head_num != 1 or D <= DV:
            raise RuntimeError(f"{ENV}=ddtree: MLA layer {layer.layer_id} is not in absorbed form "
                               f"(k heads {layer.tp_k_head_num}, qk {D}, v {DV})")
        tree_verify_attention_mla(q3[..., :DV], q3[..., DV:], pool.get_key_buffer(layer.layer_id),
                                  kv_lora_rank=DV, out=out3,
                                  workspace=_workspace(backend, T, Hq, NS, DV, q.device), **common)
    else:
        tree_verify_attention(q3, pool.get_key_buffer(layer.layer_id),
                              pool.get_value_buffer(layer.layer_id), out=out3,
                              workspace=_workspace(backend, T, Hq, NS, DV, q.device), **common)
    state.calls += 1
    return o
