"""The adaptive choice's feedback on the CPU: ``round_stats.CounterfactualWindow`` (device sums of
counterfactual acceptance per width, only widths <= the round's own, handed out at a fixed round),
``BudgetPolicy.update_means`` and ``adaptive.WidthController``'s order of choice (forced cycle, probe,
policy) against brute force on random accepted paths (issue 17 item 3)."""
import random

import pytest
import torch

from sglang_ddtree import adaptive as A
from sglang_ddtree import ddtree, tree_ops
from sglang_ddtree.budget_policy import NO_SPEC, BudgetPolicy, CostTable
from sglang_ddtree.round_stats import CounterfactualWindow

from helpers import drafter_logits, logprobs_from_logits


def _round_path(rng, bs, budget, D=6, V=200):
    lp, ids = logprobs_from_logits(drafter_logits(bs, D, V, rng), k=budget)
    tree = ddtree.build_tree(lp, ids, budget, backend="reference")
    N = budget + 1
    follow = tree.tokens.clamp(min=0).gather(1, torch.randint(0, N, (bs, N), generator=rng))
    target = torch.where(torch.rand(bs, N, generator=rng) < 0.85, follow, torch.randint(0, V, (bs, N), generator=rng))
    return ddtree.accept_greedy(tree, target, backend="reference").path


def test_window_counts_only_widths_the_round_covers(rng):
    budgets = [3, 7, 15]
    win = CounterfactualWindow(budgets, device="cpu", every=3, lag=2)
    want_s, want_c, got = [0] * 3, [0] * 3, []
    py = random.Random(int(torch.randint(0, 2 ** 31, (), generator=rng)))
    windows = []
    for r in range(12):
        got += win.due()
        b = py.choice([0] + budgets)                      # 0: a no-spec round (root only)
        bs = py.randint(1, 5)
        if b == 0:
            path = torch.full((bs, 7), -1, dtype=torch.int32)
            path[:, 0] = 0
            n_valid = 0
        else:
            path = _round_path(rng, bs, b)
            n_valid = budgets.index(b) + 1
        cf = tree_ops.counterfactual_accept_len(path, budgets[:n_valid]) if n_valid else None
        for j in range(n_valid):
            want_s[j] += int(cf[:, j].sum())
            want_c[j] += bs
        win.record(path, n_valid)
        if (r + 1) % 3 == 0:
            windows.append((want_s, want_c))
            want_s, want_c = [0] * 3, [0] * 3
    # window k (closed after round 3k+3) is handed out once 2 more rounds were recorded
    assert got == windows[:3]
    idle = torch.zeros((1, 7), dtype=torch.int32)
    win.record(idle, 0)
    assert win.due() == []                       # window 3 closed at round 12: due at 14
    win.record(idle, 0)
    assert win.due() == [windows[3]] and win.due() == [] and win.waits == 0


def test_window_argument_checks():
    for bad in ([], [7, 3], [3, 3], [0, 3]):
        with pytest.raises(ValueError):
            CounterfactualWindow(bad, device="cpu")
    with pytest.raises(ValueError):
        CounterfactualWindow([3], device="cpu", every=0)


def test_update_means_per_width():
    t = CostTable(verify_ms={4: {1: 5.0}, 16: {1: 8.0}}, base_ms={1: 4.0})
    p = BudgetPolicy(t, ema=0.5)
    p.update_means({4: 1.0})                    # width 16 unseen: keeps the prior
    assert p.accept == {4: 1.0, 16: 0.0} and p.seen == {4} and p.rounds_seen == 1
    p.update_means({4: 3.0, 16: 2.0})           # first sight of 16 takes the mean, 4 averages
    assert p.accept == {4: 2.0, 16: 2.0}
    p.update_means({9: 5.0})                    # outside the table: nothing happens
    assert p.accept == {4: 2.0, 16: 2.0} and p.rounds_seen == 2
    with pytest.raises(ValueError):
        p.update_means({4: -1.0})


def _cfg(**env):
    return A.parse_config(env, budget=15, algo="DDTREE-GPU")


def test_controller_cycle_probe_and_policy():
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="3,15", SGLANG_DDTREE_NO_SPEC="1",
                               SGLANG_DDTREE_TEST_BUDGET_CYCLE="0,3,15"), policy=None, device="cpu")
    assert [c.next_width(4) for _ in range(7)] == [1, 4, 16, 1, 4, 16, 1]
    assert c.chosen == {1: 3, 4: 2, 16: 2}
    # policy: no-spec is far cheaper, so the policy answers 1 except on probe rounds (k = 5)
    t = CostTable(verify_ms={4: {1: 40.0}, 16: {1: 50.0}}, base_ms={1: 1.0})
    pol = BudgetPolicy(t, allow_no_spec=True)
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="3,15", SGLANG_DDTREE_NO_SPEC="1",
                               SGLANG_DDTREE_PROBE_EVERY="5"), policy=pol, device="cpu",
                          window_every=2, window_lag=0)
    path = torch.tensor([[0, 1, 2, -1, -1, -1, -1]], dtype=torch.int32)
    ws = []
    for _ in range(16):
        ws.append(c.next_width(1))
        c.record(path, ws[-1])
    assert ws[:2] == [16, 16]                    # no counts yet: the server's width
    assert all(w == (16 if r % 5 == 0 else 1) for r, w in enumerate(ws) if r >= 2), ws
    assert pol.accept[16] == pytest.approx(2.0) and pol.accept[4] == pytest.approx(2.0)


def test_controller_record_drops_wider_widths():
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="3,7,15"), policy=None, device="cpu",
                          window_every=1, window_lag=0)
    path = torch.tensor([[0, 2, 5, 9, -1, -1, -1]], dtype=torch.int32)     # slots 2, 5 <= 7; 9 > 7
    c.record(path, 8)                               # a width-8 round: widths 4 and 8 known, 16 not
    assert c.window.due() == [([1, 2, 0], [1, 1, 0])]
    c.record(path, 1)                               # no-spec: nothing known
    assert c.window.due() == [([0, 0, 0], [0, 0, 0])]
    c.record(path, 16)
    assert c.window.due() == [([1, 2, 3], [1, 1, 1])]
    assert NO_SPEC == 0
