"""Fused top-k + log-softmax over the vocabulary: one pass, no fp32 copy of the logits.

``topk_logprobs_triton(logits [R, V] bf16/fp16/fp32, k)`` -> ``(log_probs [R, k] fp32,
token_ids [R, k] int64)``: the k largest logits of each row (ties: smaller token id first),
sorted descending, minus the row's fp32 logsumexp.

Non-finite logits (NaN, +inf, -inf) all rank as -inf, in the selection and in the logsumexp
(``_finite_or_neg_inf`` on every load): a drafter that emits NaN/+inf never yields ids out of
[0, V).  -inf entries keep the (value desc, id asc) order, so a row with fewer than k finite
logits ends with the smallest ids among its non-finite ones, at log-prob -inf; a row with no
finite logit gives log-probs all -inf (never NaN) and the ids 0..k-1.

Each row is split into ``S`` contiguous segments (``S > 1`` only when there are too few rows
to fill the GPU); one program streams one segment once, in chunks of ``BLOCK_V``:
* online logsumexp: running max ``m`` (one reduction per chunk) and a per-lane rescaled sum;
* running top-``KP`` as packed int64 keys ``(orderable fp32 bits << 32) | (2^32 - 1 - id)``,
  so one integer compare orders by (value desc, id asc).  A chunk is looked at only when its
  max can beat the current k-th key; its keys are then inserted largest first until none
  beats the k-th key (each insertion: one max over the chunk, one min over k);
* the next chunk's load is issued before the current chunk is processed.
With ``S > 1`` each program writes its partial (m, sum, top keys) and a second kernel
merges the ``S`` partials of a row.

Reference: ``topk_logprobs_torch`` below (stable sort on the values + torch.logsumexp) and
the numpy reference ``sglang_ddtree.reference.topk_logprobs_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_SM_COUNT = {}


@triton.jit
def _finite_or_neg_inf(x):
    """NaN and +-inf -> -inf (|NaN| < inf and |inf| < inf are both false)."""
    return tl.where(tl.abs(x) < float("inf"), x, -float("inf"))


@triton.jit
def _packed_key(x, ids):
    """fp32 values + int ids -> int64 keys ordered by (value asc, id desc)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 are equal values: one key
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (4294967295 - ids.to(tl.int64))


@triton.jit
def _store_sorted(keys, logz, out_lp_ptr, out_id_ptr, row, K: tl.constexpr):
    """Write the K largest of ``keys`` in descending order (K plain max-reductions).

    A -inf value stores -inf (not ``-inf - logz``, NaN when the row has no finite logit).  A key
    below every real one (a slot no logit filled: only when k > V, outside the API contract)
    stores (-inf, id 0), so an emitted id is never out of range.
    """
    for i in range(0, K):
        best = tl.max(keys, 0)
        keys = tl.where(keys == best, -9223372036854775808, keys)
        ordered = (best >> 32).to(tl.int32)
        bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        val = bits.to(tl.float32, bitcast=True)  # NaN for an unfilled slot
        real = ordered >= -2139095041  # the orderable bits of -inf: the smallest real key
        tl.store(out_lp_ptr + row * K + i, tl.where(val > -float("inf"), val - logz, -float("inf")))
        tl.store(out_id_ptr + row * K + i, tl.where(real, 4294967295 - (best & 4294967295), 0))


@triton.jit
def _topk_segment_kernel(
    logits_ptr, out_lp_ptr, out_id_ptr, part_m_ptr, part_s_ptr, part_key_ptr,
    V, stride_row, seg_len, id_offset,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr, SPLIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    nseg = tl.num_programs(1)
    base = logits_ptr + row * stride_row
    lo = seg * seg_len
    hi = tl.minimum(lo + seg_len, V)
    offs_v = tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, KP)
    key_min = tl.full([KP], -9223372036854775808, tl.int64)
    # The running top-k is an unsorted set.  Distinct sentinels below every real key fill
    # the k slots (so `top == thr` names one slot); padding slots k..KP-1 hold the max key
    # so they are never the minimum.
    top = tl.where(offs_k < K, key_min + offs_k.to(tl.int64), 9223372036854775807)
    thr = tl.min(top, 0)
    m = tl.full([], -float("inf"), tl.float32)
    s_lane = tl.zeros([BLOCK_V], tl.float32)
    zero_id = tl.full([], 0, tl.int32)
    idx = lo + offs_v
    x = _finite_or_neg_inf(tl.load(base + idx, mask=idx < hi, other=-float("inf")).to(tl.float32))
    for start in range(lo, hi, BLOCK_V):
        idx = start + offs_v
        in_seg = idx < hi
        nidx = idx + BLOCK_V
        x_next = _finite_or_neg_inf(
            tl.load(base + nidx, mask=nidx < hi, other=-float("inf")).to(tl.float32))
        cmax = tl.max(x, 0)
        m_new = tl.maximum(m, cmax)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s_lane = s_lane * tl.exp2((m - m_safe) * 1.4426950408889634) + tl.exp2(
            (x - m_safe) * 1.4426950408889634)
        m = m_new
        if _packed_key(cmax, zero_id) > thr:  # the chunk may hold a key above the k-th
            ck = tl.where(in_seg, _packed_key(x, idx + id_offset), -9223372036854775808)
            best = tl.max(ck, 0)
            while best > thr:  # insert largest first: exactly the chunk keys that stay
                top = tl.where(top == thr, best, top)
                thr = tl.min(top, 0)
                ck = tl.where(ck == best, -9223372036854775808, ck)
                best = tl.max(ck, 0)
        x = x_next
    s = tl.sum(s_lane, 0)
    top = tl.where(offs_k < K, top, -9223372036854775808)
    if SPLIT:
        part = row * nseg + seg
        tl.store(part_m_ptr + part, m)
        tl.store(part_s_ptr + part, s)
        tl.store(part_key_ptr + part * KP + offs_k, top)
    else:
        _store_sorted(top, m + tl.log(s), out_lp_ptr, out_id_ptr, row, K)


@triton.jit
def _topk_merge_kernel(part_m_ptr, part_s_ptr, part_key_ptr, out_lp_ptr, out_id_ptr, nseg,
                       K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr):
    """Merge the S partial top-KP key sets and the partial logsumexps of one row.

    The k largest keys are taken one at a time (k plain max-reductions over S * KP keys).
    """
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SP)
    in_row = offs_s < nseg
    pm = tl.load(part_m_ptr + row * nseg + offs_s, mask=in_row, other=-float("inf"))
    ps = tl.load(part_s_ptr + row * nseg + offs_s, mask=in_row, other=0.0)
    m = tl.max(pm, 0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    s = tl.sum(ps * tl.exp2((pm - m_safe) * 1.4426950408889634), 0)
    logz = m + tl.log(s)
    offs = tl.arange(0, SP * KP)
    keys = tl.load(part_key_ptr + row * nseg * KP + offs, mask=offs < nseg * KP,
                   other=-9223372036854775808)
    _store_sorted(keys, logz, out_lp_ptr, out_id_ptr, row, K)


def _block_v(V: int, KP: int) -> int:
    return max(KP, min(1024, triton.next_power_of_2(V)))


def _num_segments(R: int, V: int, block_v: int, KP: int, device) -> int:
    cap = max(1, min(64, 8192 // KP))  # the merge kernel holds S * KP keys in registers
    if device.type != "cuda":
        return 1 if V < 4 * block_v else 2  # the interpreter still exercises the split path
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-4 * _SM_COUNT[device.index] // R)  # ~4 programs per SM
    return max(1, min(want, V // (4 * block_v), cap))


def topk_logprobs_triton(logits: torch.Tensor, k: int, out=None):
    """logits [R, V] -> (log_probs [R, k] fp32, token_ids [R, k] int64).  No host sync.

    ``out``: optional preallocated ``(log_probs, token_ids)`` (CUDA-graph friendly).
    """
    R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    if out is None:
        out = (torch.empty((R, k), dtype=torch.float32, device=dev),
               torch.empty((R, k), dtype=torch.int64, device=dev))
    out_lp, out_id = out
    if R == 0:
        return out_lp, out_id
    KP = max(2, triton.next_power_of_2(k))
    BLOCK_V = _block_v(V, KP)
    S = _num_segments(R, V, BLOCK_V, KP, dev)
    seg_len = triton.cdiv(triton.cdiv(V, S), BLOCK_V) * BLOCK_V
    S = triton.cdiv(V, seg_len)
    num_warps = 4 if BLOCK_V <= 1024 else 8
    if S == 1:
        _topk_segment_kernel[(R, 1)](
            logits, out_lp, out_id, out_lp, out_lp, out_id, V, logits.stride(0), seg_len, 0,
            K=k, KP=KP, BLOCK_V=BLOCK_V, SPLIT=False, num_warps=num_warps)
        return out_lp, out_id
    part_m = torch.empty((R, S), dtype=torch.float32, device=dev)
    part_s = torch.empty((R, S), dtype=torch.float32, device=dev)
    part_key = torch.empty((R, S, KP), dtype=torch.int64, device=dev)
    _topk_segment_kernel[(R, S)](
        logits, out_lp, out_id, part_m, part_s, part_key, V, logits.stride(0), seg_len, 0,
        K=k, KP=KP, BLOCK_V=BLOCK_V, SPLIT=True, num_warps=num_warps)
    SP = triton.next_power_of_2(S)
    _topk_merge_kernel[(R,)](part_m, part_s, part_key, out_lp, out_id, S, K=k, KP=KP, SP=SP,
                             num_warps=4)
    return out_lp, out_id


def topk_partial_triton(logits: torch.Tensor, k: int, vocab_start: int):
    """One vocabulary shard (tensor parallelism): logits [R, V_shard] holding the columns
    ``vocab_start .. vocab_start + V_shard - 1`` of the full vocabulary.

    Returns the shard's partial ``(m [R] fp32, s [R] fp32, keys [R, KP] int64)``: max logit,
    sum of exp(logit - m), and its top-k as packed keys with global token ids (padding keys
    are the int64 minimum).  All shards' partials, gathered in any order, go to
    ``topk_merge_triton``.  Fixed shapes, no host sync: all-gather friendly.
    """
    R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    KP = max(2, triton.next_power_of_2(k))
    m = torch.empty((R,), dtype=torch.float32, device=dev)
    s = torch.empty((R,), dtype=torch.float32, device=dev)
    keys = torch.empty((R, KP), dtype=torch.int64, device=dev)
    if R == 0:
        return m, s, keys
    BLOCK_V = _block_v(V, KP)
    _topk_segment_kernel[(R, 1)](
        logits, m, keys, m, s, keys, V, logits.stride(0), triton.cdiv(V, BLOCK_V) * BLOCK_V,
        vocab_start, K=k, KP=KP, BLOCK_V=BLOCK_V, SPLIT=True,
        num_warps=4 if BLOCK_V <= 1024 else 8)
    return m, s, keys


def topk_merge_triton(m: torch.Tensor, s: torch.Tensor, keys: torch.Tensor, k: int, out=None):
    """Merge P shards' partials (m [P, R], s [P, R], keys [P, R, KP]) ->
    (log_probs [R, k] fp32, token_ids [R, k] int64), exactly as one pass over the full row."""
    P, R, KP = keys.shape
    dev = keys.device
    if out is None:
        out = (torch.empty((R, k), dtype=torch.float32, device=dev),
               torch.empty((R, k), dtype=torch.int64, device=dev))
    if R == 0:
        return out
    # the merge kernel reads row-major [R, P, ...] partials
    m_r, s_r = m.t().contiguous(), s.t().contiguous()
    keys_r = keys.transpose(0, 1).contiguous()
    _topk_merge_kernel[(R,)](m_r, s_r, keys_r, out[0], out[1], P, K=k, KP=KP,
                             SP=max(2, triton.next_power_of_2(P)), num_warps=4)
    return out


def topk_logprobs_torch(logits: torch.Tensor, k: int):
    """Independent torch reference: exact (value desc, id asc) order via a stable sort.

    Non-finite logits rank as -inf; a -inf value gives log-prob -inf (also when logZ is -inf)."""
    x = logits.float()
    x = torch.where(torch.isfinite(x), x, torch.full_like(x, float("-inf")))
    logz = torch.logsumexp(x, dim=-1, keepdim=True)
    # stable descending sort keeps the original (ascending id) order among equal values
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    vals = vals[..., :k]
    lp = torch.where(vals == float("-inf"), vals, vals - logz)
    return lp, ids[..., :k].to(torch.int64)
