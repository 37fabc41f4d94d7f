"""Exact best-first DDTree build on the GPU: one program per request, static shapes.

``build_tree_triton(log_probs [bs, D, K] fp32, token_ids [bs, D, K] int64, budget, root_tokens)``
-> ``(tokens [bs, N] int64, depth [bs, N] int32, parent [bs, N] int32, num_nodes [bs] int32)``
with ``N = budget + 1``.

The reference pops a heap keyed by ``(-score, rank_path)``.  Here the heap is a frontier
held in registers (``FP >= budget + 1`` slots: each pop removes one candidate and adds at
most two, so at most ``budget + 1`` are ever live).  Each step:
1. the best score (fp64 max over live slots);
2. among equal scores, the lexicographically smallest rank path: paths are packed as
   big-endian digits ``rank + 1`` (``BITS`` bits each, ``DPW`` digits per int64 word,
   ``NWORDS`` words), so a word-by-word min is Python's tuple compare;
3. pop it as node ``step + 1``; its slot takes the next sibling (score
   ``(s - lp[d, r]) + lp[d, r + 1]`` in fp64, exactly the reference's update, ``-inf`` kept),
   and a fresh slot takes the first child (``s + lp[d + 1, 0]``).
Node arrays live in registers and are stored once at the end, so every slot (padding
included) is written exactly once.

Every log-prob is read through ``_lp_or_neg_inf``: NaN and +inf count as -inf (so does the
reference), so garbage drafter output (``validate=False``) still pops only live slots and
emits only input token ids.  With rows sorted after that mapping (as topk_logprobs emits them)
the -inf nodes come after all finite ones, in rank-path order.

Reference: ``sglang_ddtree.reference.build_tree_ref`` (numpy + heapq).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_KEY_WORDS = 4


def key_layout(depth: int, k: int):
    """(bits per digit, digits per word, words) for packing rank paths of length <= depth."""
    bits = max(1, int(k).bit_length())  # digits are rank + 1 in 1..k
    dpw = 62 // bits  # < 2^62: no real key reaches the KEY_MAX marking dead slots
    words = max(1, -(-depth // dpw))
    return bits, dpw, words


@triton.jit
def _lp_or_neg_inf(v):
    """NaN and +inf -> -inf (both fail ``v < inf``)."""
    return tl.where(v < float("inf"), v, -float("inf"))


@triton.jit
def _first_wins(s1, a1, b1, c1, d1, s2, a2, b2, c2, d2):
    """Heap order: higher score, then the lexicographically smaller packed rank path."""
    return (s1 > s2) | ((s1 == s2) & ((a1 < a2) | ((a1 == a2) & ((b1 < b2) | ((b1 == b2) & (
        (c1 < c2) | ((c1 == c2) & (d1 < d2))))))))


@triton.jit
def _pick1(s1, a1, m1, s2, a2, m2):
    f = (s1 > s2) | ((s1 == s2) & (a1 < a2))
    return tl.where(f, s1, s2), tl.where(f, a1, a2), tl.where(f, m1, m2)


@triton.jit
def _pick2(s1, a1, b1, m1, s2, a2, b2, m2):
    f = (s1 > s2) | ((s1 == s2) & ((a1 < a2) | ((a1 == a2) & (b1 < b2))))
    return tl.where(f, s1, s2), tl.where(f, a1, a2), tl.where(f, b1, b2), tl.where(f, m1, m2)


@triton.jit
def _pick3(s1, a1, b1, c1, m1, s2, a2, b2, c2, m2):
    f = (s1 > s2) | ((s1 == s2) & ((a1 < a2) | ((a1 == a2) & ((b1 < b2) | ((b1 == b2) & (c1 < c2))))))
    return (tl.where(f, s1, s2), tl.where(f, a1, a2), tl.where(f, b1, b2), tl.where(f, c1, c2),
            tl.where(f, m1, m2))


@triton.jit
def _pick4(s1, a1, b1, c1, d1, m1, s2, a2, b2, c2, d2, m2):
    f = _first_wins(s1, a1, b1, c1, d1, s2, a2, b2, c2, d2)
    return (tl.where(f, s1, s2), tl.where(f, a1, a2), tl.where(f, b1, b2), tl.where(f, c1, c2),
            tl.where(f, d1, d2), tl.where(f, m1, m2))


@triton.jit
def _build_tree_kernel(
    lp_ptr, tok_ptr, root_ptr,
    out_tokens_ptr, out_depth_ptr, out_parent_ptr, out_num_ptr,
    budget, D, K,
    HAS_ROOT: tl.constexpr, FP: tl.constexpr, NP: tl.constexpr,
    BITS: tl.constexpr, DPW: tl.constexpr, NWORDS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    lp_row = lp_ptr + b * D * K
    tok_row = tok_ptr + b * D * K
    N = budget + 1
    f = tl.arange(0, FP)
    n_offs = tl.arange(0, NP)
    NEG_INF = -float("inf")
    KEY_MAX: tl.constexpr = 9223372036854775807

    if HAS_ROOT:
        root_tok = tl.load(root_ptr + b)
    else:
        root_tok = tl.full([], -1, tl.int64)
    node_tok = tl.where(n_offs == 0, root_tok, -1).to(tl.int64)
    node_dep = tl.zeros([NP], tl.int32)
    node_par = tl.full([NP], -1, tl.int32)

    # frontier: score (fp64), meta = parent << 32 | depth << 24 | rank, key words
    start = (budget > 0) & (D > 0)
    s0 = _lp_or_neg_inf(tl.load(lp_row, mask=start, other=0.0)).to(tl.float64)
    slot0 = f == 0
    score = tl.where(slot0, s0, NEG_INF)
    valid = slot0 & start
    meta = tl.where(slot0, 1 << 24, 0).to(tl.int64)
    first_digit = tl.full([FP], 1, tl.int64) << (BITS * (DPW - 1))
    w0 = tl.where(slot0 & start, first_digit, KEY_MAX)
    w1 = tl.where(slot0 & start, 0, KEY_MAX).to(tl.int64)
    w2 = tl.where(slot0 & start, 0, KEY_MAX).to(tl.int64)
    w3 = tl.where(slot0 & start, 0, KEY_MAX).to(tl.int64)

    n_valid = start.to(tl.int32)
    n_used = tl.full([], 1, tl.int32)
    n_nodes = tl.full([], 1, tl.int32)
    for _step in range(0, budget):
        live = n_valid > 0
        # one reduction picks (max score, then min rank-path key); invalid slots carry
        # score -inf and key words KEY_MAX, above every real key (keys use < 63 bits)
        if NWORDS == 1:
            best, k0, mt = tl.reduce((score, w0, meta), 0, _pick1)
            k1 = tl.zeros([], tl.int64)
            k2 = tl.zeros([], tl.int64)
            k3 = tl.zeros([], tl.int64)
            sel = valid & (score == best) & (w0 == k0)
        elif NWORDS == 2:
            best, k0, k1, mt = tl.reduce((score, w0, w1, meta), 0, _pick2)
            k2 = tl.zeros([], tl.int64)
            k3 = tl.zeros([], tl.int64)
            sel = valid & (score == best) & (w0 == k0) & (w1 == k1)
        elif NWORDS == 3:
            best, k0, k1, k2, mt = tl.reduce((score, w0, w1, w2, meta), 0, _pick3)
            k3 = tl.zeros([], tl.int64)
            sel = valid & (score == best) & (w0 == k0) & (w1 == k1) & (w2 == k2)
        else:
            best, k0, k1, k2, k3, mt = tl.reduce((score, w0, w1, w2, w3, meta), 0, _pick4)
            sel = valid & (score == best) & (w0 == k0) & (w1 == k1) & (w2 == k2) & (w3 == k3)
        par = (mt >> 32).to(tl.int32)
        dep = ((mt >> 24) & 255).to(tl.int32)
        rk = (mt & 16777215).to(tl.int32)
        node = n_nodes

        # pop: record the node
        at = (dep - 1) * K + rk
        t = tl.load(tok_row + at, mask=live, other=-1)
        here = (n_offs == node) & live
        node_tok = tl.where(here, t, node_tok)
        node_dep = tl.where(here, dep, node_dep)
        node_par = tl.where(here, par, node_par)

        # the popped slot takes the next sibling
        has_sib = live & (rk + 1 < K)
        lp_r = _lp_or_neg_inf(tl.load(lp_row + at, mask=live, other=0.0)).to(tl.float64)
        lp_r1 = _lp_or_neg_inf(tl.load(lp_row + at + 1, mask=has_sib, other=0.0)).to(tl.float64)
        s_sib = tl.where(best == NEG_INF, NEG_INF, (best - lp_r) + lp_r1)
        pos = tl.maximum(dep - 1, 0)
        word_d = pos // DPW
        inc_d = tl.full([], 1, tl.int64) << (BITS * (DPW - 1 - pos % DPW)).to(tl.int64)
        score = tl.where(sel, s_sib, score)
        meta = tl.where(sel, mt + 1, meta)
        valid = tl.where(sel, has_sib, valid)
        dead = sel & ~has_sib
        score = tl.where(dead, NEG_INF, score)
        w0 = tl.where(sel & (word_d == 0), w0 + inc_d, w0)
        w0 = tl.where(dead, KEY_MAX, w0)
        if NWORDS > 1:
            w1 = tl.where(sel & (word_d == 1), w1 + inc_d, w1)
            w1 = tl.where(dead, KEY_MAX, w1)
        if NWORDS > 2:
            w2 = tl.where(sel & (word_d == 2), w2 + inc_d, w2)
            w2 = tl.where(dead, KEY_MAX, w2)
        if NWORDS > 3:
            w3 = tl.where(sel & (word_d == 3), w3 + inc_d, w3)
            w3 = tl.where(dead, KEY_MAX, w3)

        # a fresh slot takes the first child (depth dep + 1, rank 0)
        has_child = live & (dep < D)
        lp_c = _lp_or_neg_inf(tl.load(lp_row + dep * K, mask=has_child, other=0.0)).to(tl.float64)
        s_child = best + lp_c
        word_c = dep // DPW
        inc_c = tl.full([], 1, tl.int64) << (BITS * (DPW - 1 - dep % DPW)).to(tl.int64)
        cs = (f == n_used) & has_child
        score = tl.where(cs, s_child, score)
        meta = tl.where(cs, (node.to(tl.int64) << 32) | ((dep + 1).to(tl.int64) << 24), meta)
        valid = valid | cs
        w0 = tl.where(cs, k0 + tl.where(word_c == 0, inc_c, 0), w0)
        if NWORDS > 1:
            w1 = tl.where(cs, k1 + tl.where(word_c == 1, inc_c, 0), w1)
        if NWORDS > 2:
            w2 = tl.where(cs, k2 + tl.where(word_c == 2, inc_c, 0), w2)
        if NWORDS > 3:
            w3 = tl.where(cs, k3 + tl.where(word_c == 3, inc_c, 0), w3)

        n_used += has_child.to(tl.int32)
        n_valid += has_sib.to(tl.int32) + has_child.to(tl.int32) - live.to(tl.int32)
        n_nodes += live.to(tl.int32)

    keep = n_offs < N
    tl.store(out_tokens_ptr + b * N + n_offs, node_tok, mask=keep)
    tl.store(out_depth_ptr + b * N + n_offs, node_dep, mask=keep)
    tl.store(out_parent_ptr + b * N + n_offs, node_par, mask=keep)
    tl.store(out_num_ptr + b, n_nodes)


def build_tree_triton(log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int,
                      root_tokens: torch.Tensor | None = None, out=None):
    """See module docstring.  ``out``: optional preallocated (tokens, depth, parent, num_nodes)."""
    bs, D, K = log_probs.shape
    N = budget + 1
    dev = log_probs.device
    log_probs = log_probs.contiguous()
    token_ids = token_ids.contiguous()
    if out is None:
        out = (torch.empty((bs, N), dtype=torch.int64, device=dev),
               torch.empty((bs, N), dtype=torch.int32, device=dev),
               torch.empty((bs, N), dtype=torch.int32, device=dev),
               torch.empty((bs,), dtype=torch.int32, device=dev))
    tokens, depth, parent, num_nodes = out
    if bs == 0:
        return out
    bits, dpw, words = key_layout(D, K)
    if words > MAX_KEY_WORDS:
        raise ValueError(f"draft depth {D} with top-k {K} needs {words} key words (> {MAX_KEY_WORDS})")
    FP = max(16, triton.next_power_of_2(N))
    NP = FP
    num_warps = 1 if FP <= 512 else 2
    _build_tree_kernel[(bs,)](
        log_probs, token_ids, root_tokens if root_tokens is not None else tokens,
        tokens, depth, parent, num_nodes,
        budget, D, K,
        HAS_ROOT=root_tokens is not None, FP=FP, NP=NP,
        BITS=bits, DPW=dpw, NWORDS=words, num_warps=num_warps,
    )
    return out
