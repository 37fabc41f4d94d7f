"""Expected acceptance of every smaller budget, read off the tree itself (issue 39 item 3).

A best-first DDTree orders its nodes by path score, the drafter's log-probability of the node's
path (the sum of the per-depth log-probs of the tokens from the root down to it), and it is
prefix-closed: the tree of budget ``b`` is the first ``b`` non-root slots of any wider one.  If the
target's next tokens followed the drafter's per-depth distributions, a node would lie on the
accepted path with the probability of its path, so the expected number of accepted nodes of the
budget-``b`` tree is ``sum_{i=1..b} exp(score_i)``, for every ``b`` at once, per request, before the
verify, at no extra forward.  The drafter is not calibrated against the target, so the policy must
scale this by the ratio of the exact counterfactual acceptance (``round_stats``) to this estimate,
measured over the same request-rounds; the estimate itself follows a change of workload in the
round it happens, where the counted acceptance needs windows of rounds.

Shapes: ``log_probs [bs, D, K]`` fp32 (sorted descending per row, top-K of the drafter at depths
1..D), ``token_ids [bs, D, K]`` int64, a :class:`ddtree.Tree` of ``N = budget + 1`` slots built
from them (the root is slot 0).
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from ..tree_ops import host_to_device


def node_log_probs(tree, log_probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[bs, N] fp32: the drafter log-prob of each slot's token at its depth (0 for the root and for
    padding slots)."""
    bs, N = tree.tokens.shape
    depth = tree.depth.to(torch.int64)
    row = (depth - 1).clamp(min=0)                                        # [bs, N]
    b = torch.arange(bs, device=depth.device).view(bs, 1).expand(bs, N)
    ids_at = token_ids[b, row]                                            # [bs, N, K]
    lp_at = log_probs[b, row].to(torch.float32)
    hit = ids_at == tree.tokens.unsqueeze(-1)
    lp = torch.where(hit, lp_at, torch.full_like(lp_at, float("-inf"))).amax(-1)
    real = (torch.arange(N, device=depth.device).view(1, N) < tree.num_nodes.view(bs, 1)) & (depth > 0)
    return torch.where(real, lp, torch.zeros_like(lp))


def path_scores(tree, log_probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[bs, N] fp32: each slot's path score (the sum of :func:`node_log_probs` over its ancestors
    and itself; the tree's visibility rows are exactly those slots)."""
    lp = node_log_probs(tree, log_probs, token_ids).to(torch.float64)
    return torch.bmm(tree.visibility.to(torch.float64), lp.unsqueeze(-1)).squeeze(-1).to(torch.float32)


def expected_accept(tree, log_probs: torch.Tensor, token_ids: torch.Tensor,
                    widths: Sequence[int]) -> torch.Tensor:
    """[bs, len(widths)] fp32: for each verify width ``w`` (budget ``w - 1``, at most the tree's),
    the expected accepted non-root nodes of the tree's first ``w - 1`` nodes if the target followed
    the drafter's distributions (module docstring).  Width 1 (no speculation) reads 0."""
    bs, N = tree.tokens.shape
    for w in widths:
        if not 1 <= int(w) <= N:
            raise ValueError(f"width {w} outside [1, {N}] (the tree has {N - 1} nodes)")
    score = path_scores(tree, log_probs, token_ids)
    slot = torch.arange(N, device=score.device).view(1, N)
    live = (slot >= 1) & (slot < tree.num_nodes.view(bs, 1))
    p = torch.where(live, score.exp(), torch.zeros_like(score))
    cum = torch.cumsum(p.to(torch.float64), dim=1)                          # cum[:, j]: slots 0..j
    return cum.index_select(1, _width_columns(widths, score.device)).to(torch.float32)


_COLUMNS: Dict[Tuple[Tuple[int, ...], torch.device], torch.Tensor] = {}


def _width_columns(widths: Sequence[int], device) -> torch.Tensor:
    """[len(widths)] int64 on ``device``: the columns ``w - 1``, made once per (widths, device) through
    ``tree_ops.host_to_device``.  Made from a host list in every predicting round it was a copy from
    pageable memory, which waits for the stream: the host stalled behind the GPU (the GPU sync
    check, run 24)."""
    key = (tuple(int(w) for w in widths), torch.device(device))
    idx = _COLUMNS.get(key)
    if idx is None:
        idx = _COLUMNS[key] = host_to_device([w - 1 for w in key[0]], key[1], torch.int64)
    return idx
