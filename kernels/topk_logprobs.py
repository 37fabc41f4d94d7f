"""Fused top-k + log-softmax over the vocabulary: one pass, no fp32 copy of the logits.

``topk_logprobs_triton(logits [R, V] bf16/fp16/fp32, k)`` -> ``(log_probs [R, k] fp32,
token_ids [R, k] int64)``: the k largest logits of each row (ties: smaller token id first),
sorted descending, minus the row's fp32 logsumexp.

One program per row streams the row once in chunks of ``BLOCK_V``:
* online logsumexp (running max ``m`` and rescaled sum ``s``, base-2 exponentials);
* running top-k as packed int64 keys ``(orderable fp32 bits << 32) | (2^32 - 1 - id)``, so a
  single integer compare orders by (value desc, id asc).  A chunk is looked at only when
  its max can beat the current k-th key; its keys are then inserted largest first until
  none beats the k-th key any more (each insertion: one max over the chunk, one min over k).

Reference: ``topk_logprobs_torch`` below (torch.sort on (value, id) + torch.logsumexp) and
the numpy reference ``sglang_ddtree.reference.topk_logprobs_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_MIN = -(2**63)
KEY_MAX = 2**63 - 1
_LOW32 = 2**32 - 1
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _packed_key(x, ids):
    """fp32 values + int ids -> int64 keys ordered by (value asc, id desc)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 are equal values: one key
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (4294967295 - ids.to(tl.int64))


@triton.jit
def _topk_logprobs_kernel(
    logits_ptr, out_lp_ptr, out_id_ptr, V, stride_row,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs_v = tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, KP)
    key_min = tl.full([KP], -9223372036854775808, tl.int64)
    # Distinct sentinels below every real key fill the k slots (so `top == thr` is one slot);
    # the padding slots k..KP-1 hold the max key so they are never the minimum.
    top = tl.where(offs_k < K, key_min + offs_k.to(tl.int64), 9223372036854775807)
    thr = tl.min(top, 0)
    m = tl.full([], -float("inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    zero_id = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        idx = start + offs_v
        in_row = idx < V
        x = tl.load(base + idx, mask=in_row, other=-float("inf")).to(tl.float32)
        cmax = tl.max(x, 0)
        m_new = tl.maximum(m, cmax)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp2((m - m_safe) * 1.4426950408889634) + tl.sum(
            tl.exp2((x - m_safe) * 1.4426950408889634), 0)
        m = m_new
        # the largest key this chunk can hold (its max value with id 0)
        if _packed_key(cmax, zero_id) > thr:
            ck = tl.where(in_row, _packed_key(x, idx), -9223372036854775808)
            best = tl.max(ck, 0)
            while best > thr:
                top = tl.where(top == thr, best, top)
                thr = tl.min(top, 0)
                ck = tl.where(ck == best, -9223372036854775808, ck)
                best = tl.max(ck, 0)
    logz = m + tl.log(s)
    top = tl.where(offs_k < K, top, -9223372036854775808)
    top = tl.sort(top, 0, descending=True)
    ordered = (top >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    val = bits.to(tl.float32, bitcast=True)
    ids = 4294967295 - (top & 4294967295)
    keep = offs_k < K
    tl.store(out_lp_ptr + row * K + offs_k, val - logz, mask=keep)
    tl.store(out_id_ptr + row * K + offs_k, ids, mask=keep)


def _block_v(V: int, KP: int) -> int:
    return max(KP, min(1024, triton.next_power_of_2(V)))


def topk_logprobs_triton(logits: torch.Tensor, k: int, out=None):
    """logits [R, V] -> (log_probs [R, k] fp32, token_ids [R, k] int64).  No host sync.

    ``out``: optional preallocated ``(log_probs, token_ids)`` (CUDA-graph friendly).
    """
    R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = (torch.empty((R, k), dtype=torch.float32, device=logits.device),
               torch.empty((R, k), dtype=torch.int64, device=logits.device))
    out_lp, out_id = out
    if R == 0:
        return out_lp, out_id
    KP = triton.next_power_of_2(k)
    BLOCK_V = _block_v(V, KP)
    num_warps = 4 if BLOCK_V <= 1024 else 8
    _topk_logprobs_kernel[(R,)](
        logits, out_lp, out_id, V, logits.stride(0),
        K=k, KP=KP, BLOCK_V=BLOCK_V, num_warps=num_warps,
    )
    return out_lp, out_id


def topk_logprobs_torch(logits: torch.Tensor, k: int):
    """Independent torch reference: exact (value desc, id asc) order via a stable sort."""
    x = logits.float()
    logz = torch.logsumexp(x, dim=-1, keepdim=True)
    # stable descending sort keeps the original (ascending id) order among equal values
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return (vals[..., :k] - logz), ids[..., :k].to(torch.int64)
