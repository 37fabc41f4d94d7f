"""Exact CPU reference of DDTree (numpy + heapq, one request at a time).

This is the oracle every kernel is tested against and the CPU-heap baseline of every
benchmark (it is what published ports run per decode step).  Semantics follow
``shared/design/ddtree.md`` and the paper's reference code:

* top-K per depth: selection and order by (logit descending, token id ascending); values
  are ``logit(fp32) - logsumexp_fp32(all logits)``;
* best-first tree: heap entries keyed by ``(-score, rank_path)``; scores are Python floats
  (fp64) built by exactly the reference updates: sibling ``(s - lp[d, r]) + lp[d, r + 1]``,
  first child ``s + lp[d + 1, 0]``.  A ``-inf`` score stays ``-inf`` (the sibling update of
  a ``-inf`` score would be ``-inf - -inf = nan``; the reference defines it as ``-inf``).
  A non-finite log-prob (NaN, +inf) counts as ``-inf``, as in the kernel, so garbage drafter
  output still gives a tree of input token ids (its nodes placed after all finite ones);
* node ``i`` is the ``i``-th pop, slot 0 the root; padding slots (only when the vocabulary
  is too small to fill the budget) have parent -1, depth 0, token -1 and see only themselves;
* greedy accept: from the root, move to the child whose token equals the target's choice
  at the current node (the child with the smallest slot if several match); the bonus is the
  target's choice at the last node reached.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

__all__ = [
    "topk_logprobs_ref",
    "build_tree_ref",
    "tree_visibility_ref",
    "pack_visibility",
    "accept_greedy_ref",
]


def topk_logprobs_ref(logits: np.ndarray, k: int):
    """Top-k log-probs of ``logits`` [rows..., V] (any float dtype; bf16 passed as float32).

    Returns ``(log_probs [..., k] float32, token_ids [..., k] int64)``.
    ``logsumexp`` is computed in fp32 as ``m + log(sum(exp(x - m)))``.
    Non-finite logits (NaN, +-inf) rank as -inf, in the order and in the logsumexp; a -inf
    value gives log-prob -inf, so a row with no finite logit yields all -inf and ids 0..k-1.
    """
    x = np.asarray(logits, dtype=np.float32)
    x = np.where(np.isfinite(x), x, np.float32(-np.inf)).astype(np.float32)
    lead, V = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, V)
    out_lp = np.empty((x2.shape[0], k), np.float32)
    out_id = np.empty((x2.shape[0], k), np.int64)
    ids = np.arange(V)
    for row in range(x2.shape[0]):
        xr = x2[row]
        m = np.float32(xr.max())
        m_safe = np.float32(0.0) if m == -np.inf else m
        s = np.sum(np.exp((xr - m_safe).astype(np.float32), dtype=np.float32), dtype=np.float32)
        order = np.lexsort((ids, -xr.astype(np.float64)))[:k]  # logit desc, id asc
        out_id[row] = order
        top = xr[order]
        # a row with no finite logit: log(0) = -inf, and -inf - -inf is replaced by -inf
        with np.errstate(divide="ignore", invalid="ignore"):
            logz = np.float32(m + np.float32(np.log(s)))
            out_lp[row] = np.where(top == -np.inf, top, top - logz).astype(np.float32)
    return out_lp.reshape(*lead, k), out_id.reshape(*lead, k)


def _build_one(lp: np.ndarray, tok: np.ndarray, budget: int, root_token: int):
    """One request.  lp/tok: [D, K].  Returns tokens, depth, parent (length budget + 1), n."""
    D, K = lp.shape
    N = budget + 1
    tokens = np.full(N, -1, np.int64)
    depth = np.zeros(N, np.int32)
    parent = np.full(N, -1, np.int32)
    tokens[0] = root_token
    # fp32 -> Python float (exact); NaN and +inf rank as -inf, as in the kernel
    lpf = [[float(v) if v < math.inf else -math.inf for v in row] for row in lp]
    heap = []
    if budget > 0 and D > 0 and K > 0:
        s0 = lpf[0][0]
        # entry: (-score, rank_path, parent_slot, depth (1-based), rank, score)
        heap.append((-s0, (0,), 0, 1, 0, s0))
    n = 1
    while heap and n <= budget:
        _, path, par, d, r, s = heapq.heappop(heap)
        node = n
        n += 1
        tokens[node] = int(tok[d - 1, r])
        depth[node] = d
        parent[node] = par
        if r + 1 < K:
            s_sib = -math.inf if s == -math.inf else (s - lpf[d - 1][r]) + lpf[d - 1][r + 1]
            heapq.heappush(heap, (-s_sib, path[:-1] + (r + 1,), par, d, r + 1, s_sib))
        if d < D:
            s_child = s + lpf[d][0]
            heapq.heappush(heap, (-s_child, path + (0,), node, d + 1, 0, s_child))
    return tokens, depth, parent, n


def tree_visibility_ref(parent: np.ndarray) -> np.ndarray:
    """Ancestor-only mask from parent [..., N] (parent < child, root/padding -1) -> bool [..., N, N]."""
    parent = np.asarray(parent)
    lead, N = parent.shape[:-1], parent.shape[-1]
    p2 = parent.reshape(-1, N)
    vis = np.zeros((p2.shape[0], N, N), bool)
    for b in range(p2.shape[0]):
        for i in range(N):
            if p2[b, i] >= 0:
                vis[b, i] = vis[b, p2[b, i]]
            vis[b, i, i] = True
    return vis.reshape(*lead, N, N)


def pack_visibility(vis: np.ndarray) -> np.ndarray:
    """bool [..., N, N] -> int32 [..., N, ceil(N/32)]; bit j of word w is column 32*w + j."""
    vis = np.asarray(vis, bool)
    N = vis.shape[-1]
    W = (N + 31) // 32
    padded = np.zeros(vis.shape[:-1] + (W * 32,), np.uint64)
    padded[..., :N] = vis
    bits = padded.reshape(vis.shape[:-1] + (W, 32)) << np.arange(32, dtype=np.uint64)
    return bits.sum(-1).astype(np.uint32).view(np.int32)


def build_tree_ref(log_probs, token_ids, budget: int, root_tokens=None):
    """Exact best-first DDTree for a batch, one heap per request.

    log_probs [bs, D, K] float32 (rows sorted descending), token_ids [bs, D, K] int64.
    Returns a dict of numpy arrays: tokens [bs, N] int64, depth/parent [bs, N] int32,
    num_nodes [bs] int32, visibility [bs, N, N] bool, mask_words [bs, N, ceil(N/32)] int32.
    """
    lp = np.asarray(log_probs, np.float32)
    tok = np.asarray(token_ids, np.int64)
    bs = lp.shape[0]
    N = budget + 1
    roots = np.full(bs, -1, np.int64) if root_tokens is None else np.asarray(root_tokens, np.int64)
    tokens = np.empty((bs, N), np.int64)
    depth = np.empty((bs, N), np.int32)
    parent = np.empty((bs, N), np.int32)
    num_nodes = np.empty(bs, np.int32)
    for b in range(bs):
        tokens[b], depth[b], parent[b], num_nodes[b] = _build_one(lp[b], tok[b], budget, int(roots[b]))
    vis = tree_visibility_ref(parent)
    return dict(tokens=tokens, depth=depth, parent=parent, num_nodes=num_nodes,
                visibility=vis, mask_words=pack_visibility(vis))


def children_by_parent(parent_row) -> dict:
    """parent [N] (root / padding -1) -> {slot: [child slots in slot order]}."""
    children = {}
    for i in range(1, len(parent_row)):
        if parent_row[i] >= 0:
            children.setdefault(int(parent_row[i]), []).append(i)
    return children


def accept_greedy_ref(tokens, parent, target_tokens, max_depth: int):
    """Greedy walk.  tokens/parent/target_tokens [bs, N].  Returns (accept_len [bs] int32,
    path [bs, max_depth + 1] int32 (-1 padded, root first), bonus [bs] int64)."""
    tokens = np.asarray(tokens)
    parent = np.asarray(parent)
    target = np.asarray(target_tokens)
    bs, N = tokens.shape
    accept_len = np.zeros(bs, np.int32)
    path = np.full((bs, max_depth + 1), -1, np.int32)
    bonus = np.empty(bs, np.int64)
    for b in range(bs):
        children = children_by_parent(parent[b])
        cur, steps = 0, 0
        path[b, 0] = 0
        while steps < max_depth:
            want = target[b, cur]
            nxt = next((c for c in children.get(cur, []) if tokens[b, c] == want), None)
            if nxt is None:
                break
            steps += 1
            path[b, steps] = nxt
            cur = nxt
        accept_len[b] = steps
        bonus[b] = target[b, cur]
    return accept_len, path, bonus
