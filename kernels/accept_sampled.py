"""Lossless sampled tree acceptance on the GPU: from the root, sample the target at each node.

``accept_sampled_triton(tokens [bs, N] int64, parent [bs, N] int32, probs [bs * N, V] fp32,
uniforms [bs, max_depth + 1] fp32, max_depth)`` -> ``(accept_len [bs] int32,
path [bs, max_depth + 1] int32, bonus [bs] int64)``.

Semantics (the contract; ``accept_sampled_ref`` below is the oracle):
at the current node (start: the root, slot 0) with coin ``u = uniforms[b, step]``, the kernel
draws a token ``t`` from the node's row ``probs[b * N + node]`` by inverse CDF in vocabulary id
order: ``t`` = the smallest id whose cumulative mass exceeds ``u * total``.  If ``t`` is the token
of a child of the node (the smallest such slot if a tree repeats a token), the walk moves to that
child (accepted) and takes the next coin; otherwise ``t`` is the bonus and the walk ends.  After
``max_depth`` accepted steps (or at a leaf, which has no children) the draw at the last node is
the bonus.  Every emitted token is therefore exactly one draw from the target's row at the node
that precedes it, which is what the target would have sampled on its own: lossless for any tree.
Padding slots (parent -1, token -1) are never children.

Arithmetic is exact and order-independent, so the kernel and the reference agree bit for bit:
each probability is clamped to [0, 1] (NaN and negatives count as 0) and converted to an
integer weight ``floor(p * 2**S)`` with ``S = 62 - ceil(log2 V)`` (so a row's total never
overflows int64; the weights lose < 2**-S each, far below the coin's resolution); the coin is
``U = floor(u * 2**24)`` clamped to [0, 2**24 - 1] (truncation: a coin uniform on [0, 1) gives U
uniform on the 2**24 integers) and the target is ``x = floor(U * total / 2**24)``, computed
without overflow, so ``0 <= x < total``: the chosen id always has nonzero weight and lies in
[0, V), whatever rounding made the row's fp32 sum.  Each token's probability is thus its
weight's share of the row's total up to the 2**-24 resolution of a 24-bit coin (as for any
fp32 sampler).  A row of zero total mass draws token 0.

Why id order and not "children first": scaling the coin by the row's total mass needs one full
pass over the row at every visited node anyway, so putting the children first would save no
memory traffic; id order needs no membership test against the children inside the vocabulary
scan.  The pass keeps one int64 partial sum per vocabulary block in registers, so the search
re-reads only the one block that holds the target: per visited node one read of the row plus
one block.  Prefix sums are triangular masked sums, never ``tl.cumsum`` (whose lowering failed
to compile for V = 2048 on the H200 with Triton 3.6).  One program per request on CUDA (R requests per program, vectorised, under the
interpreter), a data-dependent loop that stops at the bonus, no RNG state (CUDA-graph safe),
no temporaries.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from .accept_greedy import alloc_accept_outputs
from ..reference import children_by_parent

COIN_BITS = 24


def weight_shift(V: int) -> int:
    """S such that a row of V weights floor(p * 2**S), p <= 1, sums below 2**62."""
    return 62 - max(1, math.ceil(math.log2(max(V, 2))))


@triton.jit
def _weights(rows, idx, live, V, scale):
    p = tl.load(rows + idx, mask=live & (idx < V), other=0.0)
    return (tl.minimum(tl.where(p > 0, p, 0.0), 1.0) * scale).to(tl.int64)


@triton.jit
def _sample_rows(rows, live, V, U, scale, NB, R: tl.constexpr, BLOCK: tl.constexpr,
                 NBP: tl.constexpr, SUB: tl.constexpr):
    """Inverse-CDF draws from R probability rows (row pointers ``rows`` [R, 1, 1]) with the
    integer coins U [R] (see module doc); rows with ``live`` [R, 1, 1] false are not read.
    Prefix sums are triangular masked sums (no ``tl.cumsum``: Triton 3.6's scan lowering fails
    on some small shapes): over the NB block sums, then over the NS = BLOCK / SUB sub-block
    sums of the chosen block, then inside the chosen sub-block."""
    NS: tl.constexpr = BLOCK // SUB
    sub = tl.arange(0, NS)[None, :, None]
    lane = tl.arange(0, SUB)[None, None, :]
    boffs = tl.arange(0, NBP)[None, :]
    sums = tl.zeros([R, NBP], dtype=tl.int64)
    for i in range(0, NB):
        q = _weights(rows, i * BLOCK + sub * SUB + lane, live, V, scale)
        sums = tl.where(boffs == i, tl.sum(tl.sum(q, 2), 1)[:, None], sums)
    total = tl.sum(sums, 1)
    x = U * (total >> 24) + ((U * (total & 0xFFFFFF)) >> 24)        # floor(U * total / 2**24)
    # block: the number of blocks whose inclusive prefix is <= x
    ii = tl.arange(0, NBP)[None, :, None]
    jj = tl.arange(0, NBP)[None, None, :]
    incl = tl.sum(tl.where(ii <= jj, sums[:, :, None], 0), 1)                     # [R, NBP]
    blk = tl.minimum(tl.sum((incl <= x[:, None]).to(tl.int32), 1), NB - 1)
    base = tl.sum(tl.where(boffs < blk[:, None], sums, 0), 1)
    # sub-block inside the chosen block
    q = _weights(rows, blk[:, None, None] * BLOCK + sub * SUB + lane, live, V, scale)  # [R, NS, SUB]
    ssum = tl.sum(q, 2)                                                             # [R, NS]
    si = tl.arange(0, NS)[None, :, None]
    sj = tl.arange(0, NS)[None, None, :]
    sincl = tl.sum(tl.where(si <= sj, ssum[:, :, None], 0), 1) + base[:, None]      # [R, NS]
    sb = tl.minimum(tl.sum((sincl <= x[:, None]).to(tl.int32), 1), NS - 1)
    sbase = base + tl.sum(tl.where(tl.arange(0, NS)[None, :] < sb[:, None], ssum, 0), 1)
    # element inside the chosen sub-block
    qs = tl.sum(tl.where(sub == sb[:, None, None], q, 0), 1)                        # [R, SUB]
    li = tl.arange(0, SUB)[None, :, None]
    lj = tl.arange(0, SUB)[None, None, :]
    eincl = tl.sum(tl.where(li <= lj, qs[:, :, None], 0), 1) + sbase[:, None]       # [R, SUB]
    e = tl.sum((eincl <= x[:, None]).to(tl.int32), 1)
    t = (blk * BLOCK + sb * SUB + e).to(tl.int64)
    return tl.where(total > 0, t, 0)


@triton.jit
def _accept_sampled_kernel(
    tokens_ptr, parent_ptr, probs_ptr, u_ptr, accept_ptr, path_ptr, bonus_ptr,
    bs, N, V, max_depth, scale, NB,
    R: tl.constexpr, NP: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
    NBP: tl.constexpr, SUB: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)     # R requests
    rok = b < bs
    offs = tl.arange(0, NP)[None, :]
    in_tree = (offs < N) & (offs > 0) & rok[:, None]
    tok = tl.load(tokens_ptr + b[:, None] * N + offs, mask=in_tree, other=-1)
    par = tl.load(parent_ptr + b[:, None] * N + offs, mask=in_tree, other=-1)
    doffs = tl.arange(0, DP)[None, :]
    path = tl.where(doffs == 0, 0, -1) + tl.zeros([R, DP], dtype=tl.int32)
    cur = tl.zeros([R], dtype=tl.int32)
    step = tl.zeros([R], dtype=tl.int32)
    bonus = tl.zeros([R], dtype=tl.int64)
    live = rok
    go = tl.max(live.to(tl.int32), 0)
    while go > 0:
        u = tl.load(u_ptr + b * (max_depth + 1) + step, mask=live, other=0.0)
        u = tl.minimum(tl.where(u > 0, u, 0.0), 1.0)         # NaN, negatives -> 0; >= 1 -> 1
        U = tl.minimum((u * 16777216.0).to(tl.int64), 16777215)
        rows = probs_ptr + ((b * N + cur) * V)[:, None, None]
        t = _sample_rows(rows, live[:, None, None], V, U, scale, NB, R=R, BLOCK=BLOCK, NBP=NBP,
                         SUB=SUB)
        match = in_tree & (par == cur[:, None]) & (tok == t[:, None])
        j = tl.min(tl.where(match, offs, NP), 1)
        found = live & (j < NP) & (step < max_depth)
        path = tl.where((doffs == step[:, None] + 1) & found[:, None], j[:, None], path)
        bonus = tl.where(live & ~found, t, bonus)
        cur = tl.where(found, j, cur)
        step += found.to(tl.int32)
        live = found
        go = tl.max(live.to(tl.int32), 0)
    tl.store(accept_ptr + b, step, mask=rok)
    tl.store(path_ptr + b[:, None] * (max_depth + 1) + doffs, path,
             mask=rok[:, None] & (doffs < max_depth + 1))
    tl.store(bonus_ptr + b, bonus, mask=rok)


def accept_sampled_triton(tokens: torch.Tensor, parent: torch.Tensor, probs: torch.Tensor,
                          uniforms: torch.Tensor, max_depth: int, out=None,
                          requests_per_program: int = 0):
    """See module docstring.  ``probs`` [bs * N, V] (or [bs, N, V]) fp32; ``out``: optional
    preallocated (accept_len, path, bonus).  ``requests_per_program`` (a power of 2; 0 = auto:
    1 on CUDA, where one program streams one request's rows, and up to 256 under the
    interpreter, whose cost is per program)."""
    bs, N = tokens.shape
    V = probs.shape[-1]
    dev = tokens.device
    if out is None:
        out = alloc_accept_outputs(bs, max_depth, dev)
    accept_len, path, bonus = out
    if bs == 0:
        return out
    NP = max(16, triton.next_power_of_2(N))
    DP = max(16, triton.next_power_of_2(max_depth + 1))
    BLOCK = min(4096, max(128, triton.next_power_of_2(V)))
    R = requests_per_program
    if R <= 0:
        R = 1 if dev.type == "cuda" else min(triton.next_power_of_2(bs), 256)
    if R & (R - 1):
        raise ValueError(f"requests_per_program must be a power of 2, got {R}")
    NB = triton.cdiv(V, BLOCK)
    NBP = max(16, triton.next_power_of_2(NB))
    SUB = min(64, BLOCK)
    _accept_sampled_kernel[(triton.cdiv(bs, R),)](
        tokens.contiguous(), parent.contiguous(), probs.reshape(bs * N, V).contiguous(),
        uniforms.contiguous(), accept_len, path, bonus, bs, N, V, max_depth,
        float(2.0 ** weight_shift(V)), NB, R=R, NP=NP, DP=DP, BLOCK=BLOCK, NBP=NBP, SUB=SUB,
        num_warps=4 if R * BLOCK <= 1024 else 8,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Reference (numpy, one request at a time): the same integer arithmetic, so results are identical.

def row_weights(p: np.ndarray, V: int) -> np.ndarray:
    """fp32 probabilities -> the kernel's int64 weights floor(clamp(p, 0, 1) * 2**S)."""
    p = np.asarray(p, dtype=np.float32)
    p = np.where(p > 0, p, np.float32(0)).astype(np.float32)
    p = np.minimum(p, np.float32(1))
    return (p * np.float32(2.0 ** weight_shift(V))).astype(np.int64)


def coin(u) -> int:
    """fp32 coin -> the kernel's integer coin floor(u * 2**24) in [0, 2**24 - 1]."""
    u = np.float32(u)
    if not u > 0:
        return 0
    u = min(u, np.float32(1))
    return min(int(np.float32(u * np.float32(1 << COIN_BITS))), (1 << COIN_BITS) - 1)


def sample_row_ref(p: np.ndarray, u) -> int:
    """The kernel's inverse-CDF draw from one row (id order; zero-mass row -> token 0)."""
    w = row_weights(p, p.shape[-1])
    total = int(w.sum())
    if total == 0:
        return 0
    x = (coin(u) * total) >> COIN_BITS          # Python ints: no overflow, same as the kernel
    return int(np.searchsorted(np.cumsum(w), x, side="right"))


def accept_sampled_ref(tokens, parent, probs, uniforms, max_depth: int):
    """tokens/parent [bs, N], probs [bs * N, V] or [bs, N, V], uniforms [bs, max_depth + 1]
    -> (accept_len [bs] int32, path [bs, max_depth + 1] int32, bonus [bs] int64)."""
    tokens = np.asarray(tokens)
    parent = np.asarray(parent)
    bs, N = tokens.shape
    probs = np.asarray(probs, dtype=np.float32).reshape(bs, N, -1)
    uniforms = np.asarray(uniforms, dtype=np.float32)
    accept_len = np.zeros(bs, np.int32)
    path = np.full((bs, max_depth + 1), -1, np.int32)
    bonus = np.empty(bs, np.int64)
    for b in range(bs):
        children = children_by_parent(parent[b])
        cur, steps = 0, 0
        path[b, 0] = 0
        while True:
            t = sample_row_ref(probs[b, cur], uniforms[b, steps])
            nxt = next((c for c in children.get(cur, []) if tokens[b, c] == t), None)
            if nxt is None or steps >= max_depth:
                bonus[b] = t
                break
            steps += 1
            path[b, steps] = nxt
            cur = nxt
        accept_len[b] = steps
    return accept_len, path, bonus
