"""sglang_ddtree.policy.round_stats: device accumulators of acceptance, the accepted-length histogram and
the counterfactual acceptance of every smaller budget, read back without a host sync, published to
Prometheus counters and a JSON-lines file (issue 17 items 1 and 4).  CPU: the same code with CPU
tensors; the counterfactual counts are checked against a brute-force replay (a tree of each smaller
budget built by the reference, walked with the same target tokens)."""
import json
import types

import pytest
import torch

from helpers import drafter_logits, logprobs_from_logits
from sglang_ddtree import ddtree
from sglang_ddtree.policy.round_stats import AcceptanceStats, CounterfactualWindow, RoundCounterfactual, default_budgets


def _round(bs, D, V, budget, rng):
    lp, ids = logprobs_from_logits(drafter_logits(bs, D, V, rng), k=budget)
    tree = ddtree.build_tree(lp, ids, budget, backend="reference")
    N = budget + 1
    follow = tree.tokens.clamp(min=0).gather(1, torch.randint(0, N, (bs, N), generator=rng))
    target = torch.where(torch.rand(bs, N, generator=rng) < 0.85, follow,
                         torch.randint(0, V, (bs, N), generator=rng))
    acc = ddtree.accept_greedy(tree, target, backend="reference")
    return lp, ids, target, tree, acc


def test_budgets_and_argument_checks():
    assert default_budgets(64) == [7, 15, 31, 63, 64] and default_budgets(16) == [7, 15, 16]
    assert default_budgets(5) == [5]
    with pytest.raises(ValueError):
        AcceptanceStats(budget=16, draft_depth=7, device="cpu", algo="X", budgets=[32])
    with pytest.raises(ValueError):
        AcceptanceStats(budget=16, draft_depth=7, device="cpu", algo="X", every=0)
    off = types.SimpleNamespace(enable_metrics=False)
    assert AcceptanceStats.from_env(off, budget=16, draft_depth=7, device="cpu", algo="X") is None


def test_accumulators_match_a_brute_force_replay(tmp_path, rng):
    bs, D, V, budget = 5, 7, 400, 24
    budgets = [3, 8, 15, 24]
    out = tmp_path / "stats.jsonl"
    st = AcceptanceStats(budget=budget, draft_depth=D, device="cpu", algo="DDTREE-GPU", path=str(out),
                         every=3, budgets=budgets)
    want = dict(request_rounds=0, accepted=0, hist=[0] * (D + 1), cf=[0] * len(budgets))
    for _ in range(7):
        lp, ids, target, tree, acc = _round(bs, D, V, budget, rng)
        st.record(acc.path, acc.accept_len)
        lens = acc.accept_len.tolist()
        want["request_rounds"] += bs
        want["accepted"] += sum(lens)
        for n in lens:
            want["hist"][n] += 1
        for j, b in enumerate(budgets):      # the smaller tree itself, walked with the same targets
            small = ddtree.build_tree(lp[..., :b].contiguous(), ids[..., :b].contiguous(), b,
                                      backend="reference")
            # the budget-b tree's slots are the first b + 1 of the big tree (same order)
            assert torch.equal(small.tokens, tree.tokens[:, :b + 1])
            want["cf"][j] += int(ddtree.accept_greedy(small, target[:, :b + 1],
                                                      backend="reference").accept_len.sum())
    assert len(out.read_text().splitlines()) == 2          # windows of 3 rounds: 2 complete so far
    st.flush()
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["rounds"] for r in recs] == [3, 3, 3]         # the flushed rest counts as a window
    tot = lambda k: [sum(r[k][i] for r in recs) for i in range(len(recs[0][k]))]  # noqa: E731
    assert sum(r["request_rounds"] for r in recs) == want["request_rounds"]
    assert sum(r["accepted"] for r in recs) == want["accepted"]
    assert tot("length_hist") == want["hist"]
    assert tot("counterfactual") == want["cf"]
    assert want["cf"][-1] == want["accepted"]                 # the tree's own budget


def _replayed(lp, ids, target, b):
    """Per request: what a budget-b tree built by the reference accepts with the same targets."""
    small = ddtree.build_tree(lp[..., :b].contiguous(), ids[..., :b].contiguous(), b, backend="reference")
    return ddtree.accept_greedy(small, target[:, :b + 1], backend="reference").accept_len.to(torch.int64)


@pytest.mark.parametrize("width", [25, 13, 4])
def test_one_round_count_serves_both_consumers(rng, width):
    """The stats' and the controller's budget lists overlap without one being a prefix of the other;
    one RoundCounterfactual call hands each its columns, each equal per request to a smaller tree
    rebuilt and walked (a round narrower than some budgets leaves those out, an absent consumer gets
    None), and both consumers count the same with the handed counts as with their own."""
    bs, D, V = 4, 7, 300
    stats_b, window_b = [3, 8, 15, 24], [5, 8, 12, 24]
    rc = RoundCounterfactual([stats_b, window_b, None], "cpu")
    assert rc.budgets == [3, 5, 8, 12, 15, 24]
    lp, ids, target, tree, acc = _round(bs, D, V, width - 1, rng)
    got_s, got_w, got_none = rc(acc.path, width)
    assert got_none is None
    for got, bl in ((got_s, stats_b), (got_w, window_b)):
        held = [b for b in bl if b <= width - 1]
        if not held:
            assert got is None
            continue
        want = torch.stack([_replayed(lp, ids, target, b) for b in held], 1)
        assert torch.equal(got.to(torch.int64), want), (bl, got, want)
    st_a, st_b = (AcceptanceStats(budget=24, draft_depth=D, device="cpu", algo="X", every=1000,
                                  budgets=stats_b) for _ in range(2))
    st_a.record(acc.path, acc.accept_len, width=width)
    st_b.record(acc.path, acc.accept_len, width=width, cf=got_s)
    assert torch.equal(st_a._acc, st_b._acc)
    n_w = sum(1 for b in window_b if b <= width - 1)
    w_a, w_b = (CounterfactualWindow(window_b, device="cpu", every=1000) for _ in range(2))
    w_a.record(acc.path, n_w)
    w_b.record(acc.path, n_w, cf=got_w)
    assert torch.equal(w_a._acc, w_b._acc)
    if got_w is not None:                         # the handed counts are the ones counted
        w_c = CounterfactualWindow(window_b, device="cpu", every=1000)
        w_c.record(acc.path, n_w, cf=got_w + 1)
        assert not torch.equal(w_c._acc, w_a._acc)
        with pytest.raises(ValueError, match="cf must be"):
            w_b.record(acc.path, n_w, cf=got_w[:, :0])


def test_prometheus_counters(rng):
    prometheus_client = pytest.importorskip("prometheus_client")
    st = AcceptanceStats(budget=16, draft_depth=7, device="cpu", algo="DDTREE-GPU", tp_rank=0,
                         prometheus=True, every=2)
    lab = dict(algo="DDTREE-GPU", budget="16", tp_rank="0")
    reg = prometheus_client.REGISTRY
    before = reg.get_sample_value("sglang:ddtree_request_rounds_total", lab) or 0.0
    acc_before = reg.get_sample_value("sglang:ddtree_accepted_tokens_total", lab) or 0.0
    total = 0
    for _ in range(4):
        *_, acc = _round(3, 7, 300, 16, rng)
        st.record(acc.path, acc.accept_len)
        total += int(acc.accept_len.sum())
    assert reg.get_sample_value("sglang:ddtree_request_rounds_total", lab) == before + 12
    assert reg.get_sample_value("sglang:ddtree_accepted_tokens_total", lab) == acc_before + total
    own = reg.get_sample_value("sglang:ddtree_counterfactual_accepted_tokens_total", dict(lab, at_budget="16"))
    small = reg.get_sample_value("sglang:ddtree_counterfactual_accepted_tokens_total", dict(lab, at_budget="7"))
    assert own is not None and small is not None and small <= own
