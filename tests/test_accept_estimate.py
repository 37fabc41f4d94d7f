"""sglang_ddtree.policy.accept_estimate: the expected acceptance of every budget read off the tree, against
a Monte-Carlo walk of target paths drawn from the drafter's own per-depth distributions (the
assumption the estimate states), on fresh random inputs with ties and on captured drafter top-k."""
import os

import numpy as np
import pytest
import torch

from sglang_ddtree.policy import accept_estimate as E
from sglang_ddtree import ddtree

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sglang_ddtree", "data",
                   "fixtures")


def _walk_mean(tree, probs, ids, budget, draws, gen):
    """Mean accepted non-root nodes of the tree's first ``budget`` nodes when each depth's token is
    drawn from ``probs [bs, D, K]`` (mass left over: a token no node has).  Walk: from the root,
    step to the child whose token is the draw, else stop."""
    bs, D, K = probs.shape
    tok = tree.tokens.tolist()
    par = tree.parent.tolist()
    out = []
    for b in range(bs):
        n = min(int(tree.num_nodes[b]), budget + 1)
        children = {}
        for i in range(1, n):
            children[(par[b][i], tok[b][i])] = i
        rest = (1.0 - probs[b].sum(-1)).clamp(min=0.0)                          # [D]
        full = torch.cat([probs[b], rest.unsqueeze(-1)], dim=-1)                 # [D, K + 1]
        picks = torch.multinomial(full, draws, replacement=True, generator=gen)  # [D, draws]
        picks = picks.T.tolist()
        idsb = ids[b].tolist()
        total = 0
        for pk in picks:
            node, depth = 0, 0
            while depth < D:
                k = pk[depth]
                if k == K:
                    break
                nxt = children.get((node, idsb[depth][k]))
                if nxt is None:
                    break
                node, depth = nxt, depth + 1
            total += depth
        out.append(total / draws)
    return torch.tensor(out)


def _random_rows(gen, bs, D, K, V, ties):
    logits = torch.randn(bs, D, V, generator=gen) * 2.0
    if ties:
        logits = (logits * 2).round() / 2                                        # exact ties
    lp_full = logits.log_softmax(-1)
    lp, order = torch.sort(lp_full, dim=-1, descending=True, stable=True)
    return lp[..., :K].contiguous(), order[..., :K].to(torch.int64).contiguous()


@pytest.mark.parametrize("K,V,ties", [(6, 6, False), (5, 12, True), (4, 40, False)])
def test_estimate_equals_the_drafter_calibrated_walk(rng, K, V, ties):
    bs, D, budget = 3, 4, 12
    lp, ids = _random_rows(rng, bs, D, K, V, ties)
    tree = ddtree.build_tree(lp, ids, budget, root_tokens=torch.zeros(bs, dtype=torch.int64),
                             backend="reference")
    widths = [1, 2, 5, 9, budget + 1]
    est = E.expected_accept(tree, lp, ids, widths)
    assert est.shape == (bs, len(widths)) and bool((est[:, 0] == 0).all())
    assert bool((est[:, 1:] >= est[:, :-1] - 1e-6).all())                     # wider: never less
    draws = 6000
    for j, w in enumerate(widths[1:], start=1):
        mc = _walk_mean(tree, lp.exp(), ids, w - 1, draws, rng)
        # accepted length <= D: the Monte-Carlo mean's standard error is at most D / 2 / sqrt(draws)
        assert torch.allclose(est[:, j], mc, atol=4 * (D / 2) / draws ** 0.5), (w, est[:, j], mc)


def test_a_narrower_tree_is_the_wide_trees_prefix(rng):
    """Prefix-closed trees: the estimate of width w from the widest tree equals the estimate of the
    tree built with budget w - 1 (what a narrower round would have verified)."""
    lp, ids = _random_rows(rng, 4, 5, 6, 30, ties=True)
    wide = ddtree.build_tree(lp, ids, 20, root_tokens=torch.zeros(4, dtype=torch.int64), backend="reference")
    for w in (2, 4, 8, 16):
        narrow = ddtree.build_tree(lp, ids, w - 1, root_tokens=torch.zeros(4, dtype=torch.int64),
                                   backend="reference")
        a = E.expected_accept(wide, lp, ids, [w])[:, 0]
        b = E.expected_accept(narrow, lp, ids, [w])[:, 0]
        assert torch.allclose(a, b, atol=1e-5), (w, a, b)


def test_node_log_probs_and_scores_by_hand():
    """Depth 1: 7 (.5), 8 (.3), 9 (.2); depth 2: 4 (.25), ...  Best-first over 4 nodes: 7, 8, 9, then
    7 -> 4 (.125); expected accepted = .5 + .3 + .2 + .125 (width 5), the first three (width 4)."""
    lp = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.25, 0.2, 0.1]]]))
    ids = torch.tensor([[[7, 8, 9], [4, 5, 6]]])
    tree = ddtree.build_tree(lp, ids, 4, root_tokens=torch.tensor([1]), backend="reference")
    score = E.path_scores(tree, lp, ids)[0]
    assert [round(float(x), 6) for x in score.exp()] == [1.0, 0.5, 0.3, 0.2, 0.125]
    assert [round(float(x), 6) for x in E.node_log_probs(tree, lp, ids)[0].exp()] == [1.0, 0.5, 0.3, 0.2, 0.25]
    got = E.expected_accept(tree, lp, ids, [1, 4, 5])[0].tolist()
    assert got == pytest.approx([0.0, 1.0, 1.125], abs=1e-6)
    with pytest.raises(ValueError):
        E.expected_accept(tree, lp, ids, [6])


def test_triton_tree_gives_the_same_estimate(rng, device):
    lp, ids = _random_rows(rng, 2, 4, 5, 20, ties=True)
    lp, ids = lp.to(device), ids.to(device)
    roots = torch.zeros(2, dtype=torch.int64, device=device)
    a = E.expected_accept(ddtree.build_tree(lp, ids, 10, root_tokens=roots, backend="triton"), lp, ids, [3, 11])
    b = E.expected_accept(ddtree.build_tree(lp.cpu(), ids.cpu(), 10, root_tokens=roots.cpu(),
                                            backend="reference"), lp.cpu(), ids.cpu(), [3, 11])
    assert torch.allclose(a.cpu(), b, atol=1e-5)


@pytest.mark.parametrize("name", ["topk_text_dflash_r01.npz", "topk_text_dflash_r10.npz"])
def test_captured_top_k(rng, name):
    """The real drafter's top-64 (the rest of the vocabulary holds the leftover mass): the estimate
    equals the walk under the drafter's distribution, and what the target really accepted on those
    rounds (its greedy continuation, in the fixture) is what the online calibration would compare
    it with."""
    z = np.load(os.path.join(FIX, name))
    lp = torch.from_numpy(z["log_probs"]).float()
    ids = torch.from_numpy(z["token_ids"]).long()
    bs, D, K = lp.shape
    budget = 24
    tree = ddtree.build_tree(lp, ids, budget, root_tokens=torch.zeros(bs, dtype=torch.int64), backend="reference")
    est = E.expected_accept(tree, lp, ids, [budget + 1])[:, 0]
    mc = _walk_mean(tree, lp.exp(), ids, budget, 3000, rng)
    assert torch.allclose(est, mc, atol=4 * (D / 2) / 3000 ** 0.5), (est, mc)
