"""The adaptive choice's feedback on the CPU: ``round_stats.CounterfactualWindow`` (device sums of
counterfactual acceptance per width, only widths <= the round's own, handed out at a fixed round),
``BudgetPolicy.update_sums`` and ``adaptive.WidthController``'s order of choice (forced cycle, probe,
policy) against brute force on random accepted paths (issue 17 item 3)."""
import collections
import math
import random
import types

import pytest
import torch

from sglang_ddtree.policy import adaptive as A
from sglang_ddtree.policy import adaptive_config as AC
from sglang_ddtree import ddtree, tree_ops
from sglang_ddtree import switches as S
from sglang_ddtree.policy.budget_policy import NO_SPEC, BudgetPolicy, CostTable
from sglang_ddtree.policy.round_stats import CounterfactualWindow

from helpers import Clock as _Clock, drafter_logits, logprobs_from_logits


def _round_path(rng, bs, budget, D=6, V=200):
    lp, ids = logprobs_from_logits(drafter_logits(bs, D, V, rng), k=budget)
    tree = ddtree.build_tree(lp, ids, budget, backend="reference")
    N = budget + 1
    follow = tree.tokens.clamp(min=0).gather(1, torch.randint(0, N, (bs, N), generator=rng))
    target = torch.where(torch.rand(bs, N, generator=rng) < 0.85, follow, torch.randint(0, V, (bs, N), generator=rng))
    return ddtree.accept_greedy(tree, target, backend="reference").path


def _round_or_root(rng, py, budgets, bs):
    """A random round's (path, n_valid): a tree of one of ``budgets`` or a no-spec round (root only)."""
    b = py.choice([0] + budgets)
    if b == 0:
        path = torch.full((bs, 7), -1, dtype=torch.int32)
        path[:, 0] = 0
        return path, 0
    return _round_path(rng, bs, b), budgets.index(b) + 1


def test_window_counts_only_widths_the_round_covers(rng):
    budgets = [3, 7, 15]
    win = CounterfactualWindow(budgets, device="cpu", every=3, lag=2)
    want_s, want_c, want_b, got = [0] * 3, [0] * 3, [0] * 3, []
    py = random.Random(int(torch.randint(0, 2 ** 31, (), generator=rng)))
    windows = []
    for r in range(12):
        got += win.due()
        bs = py.randint(1, 5)
        path, n_valid = _round_or_root(rng, py, budgets, bs)
        cf = tree_ops.counterfactual_accept_len(path, budgets[:n_valid]) if n_valid else None
        for j in range(n_valid):
            want_s[j] += int(cf[:, j].sum())
            want_c[j] += bs
            if j:
                want_b[j] += int(cf[:, j - 1].sum())     # the narrower budget on the same rounds
        win.record(path, n_valid)
        if (r + 1) % 3 == 0:
            windows.append(([want_s], [want_c], [want_b], None))   # one age bucket, no prediction
            want_s, want_c, want_b = [0] * 3, [0] * 3, [0] * 3
    # window k (closed after round 3k+3) is handed out once 2 more rounds were recorded
    assert got == windows[:3]
    idle = torch.zeros((1, 7), dtype=torch.int32)
    win.record(idle, 0)
    assert win.due() == []                       # window 3 closed at round 12: due at 14
    win.record(idle, 0)
    assert win.due() == [windows[3]] and win.due() == [] and win.waits == 0


def test_window_skips_finished_requests_clips_last_rounds_and_counts_per_age_bucket(rng):
    """``remaining`` (tokens each request may still emit): a request-round with none left is not
    counted, the others count min(accepted, remaining - 1) at each budget; ``age`` (output tokens so
    far): each request-round counts in the bucket of the edges (3, 8) it falls in (< 3, 3-7, >= 8);
    brute force on random paths, limits and ages (some rounds without ``remaining``: everything
    counts; without ``age``: bucket 0)."""
    budgets = [3, 7, 15]
    edges = (3, 8)
    win = CounterfactualWindow(budgets, device="cpu", every=2, lag=0, age_edges=edges)
    assert win.buckets == 3
    py = random.Random(int(torch.randint(0, 2 ** 31, (), generator=rng)))
    got, want = [], []
    new = lambda: ([[0] * 3 for _ in range(3)], [[0] * 3 for _ in range(3)], [[0] * 3 for _ in range(3)])
    s, c, bl = new()
    for r in range(24):
        b = py.choice(budgets)
        bs = py.randint(1, 6)
        path = _round_path(rng, bs, b)
        n_valid = budgets.index(b) + 1
        rem = None if py.random() < 0.25 else torch.tensor([py.randint(-3, 9) for _ in range(bs)])
        age = None if py.random() < 0.2 else torch.tensor([py.randint(1, 12) for _ in range(bs)])
        cf = tree_ops.counterfactual_accept_len(path, budgets[:n_valid])
        for i in range(bs):
            left = None if rem is None else int(rem[i])
            if left is not None and left <= 0:
                continue
            k = 0 if age is None else sum(int(age[i]) >= e for e in edges)
            for j in range(n_valid):
                v = int(cf[i, j]) if left is None else min(int(cf[i, j]), left - 1)
                s[k][j] += v
                c[k][j] += 1
                if j:
                    bl[k][j] += int(cf[i, j - 1]) if left is None else min(int(cf[i, j - 1]), left - 1)
        win.record(path, n_valid, rem, age)
        got += win.due()
        if (r + 1) % 2 == 0:
            want.append((s, c, bl, None))
            s, c, bl = new()
    assert got == want


def test_window_predictions_pair_with_the_exact_counts_per_bucket(rng):
    """``predicted`` [bs, budgets] (the tree's own estimate): under the same mask, clip and age buckets
    as the counts, the window sums it over every request-round that carries it (``all`` / ``n``) and,
    at each budget the round's tree holds, pairs it with the exact count on the same request-rounds
    (``on`` / ``exact`` / ``on_n``); a draft-only probe (``n_valid = 0``) adds to ``all`` / ``n``
    alone, and a window without predictions hands out None.  Brute force over random rounds."""
    budgets = [3, 7, 15]
    edges = (3, 8)
    win = CounterfactualWindow(budgets, device="cpu", every=3, lag=0, age_edges=edges)
    py = random.Random(int(torch.randint(0, 2 ** 31, (), generator=rng)))
    zero = lambda: {k: [[0.0] * 3 for _ in range(3)] for k in ("all", "n", "on", "exact", "on_n")}
    got, want, acc = [], [], zero()
    for r in range(30):
        bs = py.randint(1, 5)
        path, n_valid = _round_or_root(rng, py, budgets, bs)
        pred = None
        if py.random() < 0.6:
            pred = torch.rand(bs, 3, generator=rng, dtype=torch.float64).cumsum(1) * 2
        rem = None if py.random() < 0.3 else torch.tensor([py.randint(-2, 6) for _ in range(bs)])
        age = None if py.random() < 0.2 else torch.tensor([py.randint(1, 12) for _ in range(bs)])
        if pred is not None:
            cf = tree_ops.counterfactual_accept_len(path, budgets[:n_valid]) if n_valid else None
            for i in range(bs):
                left = None if rem is None else int(rem[i])
                if left is not None and left <= 0:
                    continue
                k = 0 if age is None else sum(int(age[i]) >= e for e in edges)
                clip = (lambda x: x) if left is None else (lambda x: min(x, left - 1))
                for j in range(3):
                    acc["all"][k][j] += clip(float(pred[i, j]))
                    acc["n"][k][j] += 1
                for j in range(n_valid):
                    acc["on"][k][j] += clip(float(pred[i, j]))
                    acc["exact"][k][j] += clip(int(cf[i, j]))
                    acc["on_n"][k][j] += 1
        win.record(path, n_valid, rem, age, predicted=pred)
        got += [x[3] for x in win.due()]
        if (r + 1) % 3 == 0:
            # no live request-round carried a prediction: the window hands out None
            want.append(acc if any(x for row in acc["n"] for x in row) else None)
            acc = zero()
    assert len(got) == len(want) == 10
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        for key in w:
            assert torch.allclose(torch.tensor(g[key], dtype=torch.float64), torch.tensor(w[key], dtype=torch.float64)), key
    with pytest.raises(ValueError, match="every budget"):
        win.record(path, n_valid, predicted=torch.zeros(path.shape[0], 2))


def test_remaining_tokens_from_prompt_length_and_max_new_tokens():
    """After prefill a request of prompt P has emitted 1 token and its KV holds P; each round of a
    accepted tokens adds a + 1 to both.  Requests without the fields: None (nothing is clipped)."""
    ns = lambda P, m: types.SimpleNamespace(origin_input_ids=[1] * P,
                                           sampling_params=types.SimpleNamespace(max_new_tokens=m))
    reqs = [ns(5, 1), ns(5, 4), ns(7, None)]
    assert A.token_limits(reqs) == [6, 9, 7 + A.NO_TOKEN_LIMIT]
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15"), policy=None, device="cpu")
    seq = torch.tensor([5, 5, 7])
    assert c.remaining_and_age(reqs, seq)[0].tolist() == [0, 3, A.NO_TOKEN_LIMIT - 1]
    seq = seq + torch.tensor([0, 3, 2])                  # request 1 accepted 2 (+ bonus): 1 left
    assert c.remaining_and_age(reqs, seq)[0].tolist()[:2] == [0, 0]
    assert c.remaining_and_age([types.SimpleNamespace()], torch.tensor([3])) == (None, None)
    assert c.remaining_and_age(reqs, torch.tensor([5, 5]))[0] is None     # a length mismatch
    c.remaining_and_age(reqs, seq)
    held = c._limits[1]
    assert c.remaining_and_age(reqs, seq + 1)[0].tolist()[1] == -1 and c._limits[1] is held
    assert c.remaining_and_age(reqs[:2], seq[:2])[0].tolist() == [0, 0]          # a new batch: new limits
    assert c._limits[1] is not held


def test_window_argument_checks():
    for bad in ([], [7, 3], [3, 3], [0, 3]):
        with pytest.raises(ValueError):
            CounterfactualWindow(bad, device="cpu")
    with pytest.raises(ValueError):
        CounterfactualWindow([3], device="cpu", every=0)
    for bad in ((8, 3), (3, 3), (0, 4)):
        with pytest.raises(ValueError):
            CounterfactualWindow([3], device="cpu", age_edges=bad)


def test_update_sums_per_width():
    t = CostTable(verify_ms={4: {1: 5.0}, 16: {1: 8.0}}, base_ms={1: 4.0})
    p = BudgetPolicy(t, ema=0.5)
    p.update_sums({4: 4.0}, {4: 4})             # width 16 unmeasured: keeps the prior
    assert p.accept == {4: 1.0, 16: 0.0} and p.seen == {4} and p.rounds_seen == 1
    p.update_sums({4: 6.0, 16: 4.0}, {4: 2, 16: 2})
    # 4: (0.5 * 4 + 6) / (0.5 * 4 + 2) = 2; 16: first measurement = its mean
    assert p.accept == {4: pytest.approx(2.0), 16: pytest.approx(2.0)}
    p.update_sums({9: 5.0, 16: 0.0}, {9: 1, 16: 0})   # outside the table / count 0: nothing happens
    assert p.accept == {4: pytest.approx(2.0), 16: pytest.approx(2.0)} and p.rounds_seen == 2
    with pytest.raises(ValueError):
        p.update_sums({4: -1.0}, {4: 1})


def test_decayed_acceptance_is_the_age_weighted_mean_of_measured_request_rounds():
    """Brute force over the list of windows: every window ages every earlier one by d (measured or
    not); when a width is measured with n request-rounds, its earlier windows' total weight is cut to
    at most n / (1 - d) (all by one factor); accept[w] = sum of weight x sum / sum of weight x count.
    Random windows where each width is measured or not, bursts of many request-rounds among few."""
    py = random.Random()
    widths = [4, 8, 16, 32]
    t = CostTable(verify_ms={w: {1: 5.0 + w} for w in widths}, base_ms={1: 4.0})
    d = py.uniform(0.5, 0.95)
    p = BudgetPolicy(t, ema=d)
    hist = {w: [] for w in widths}          # per width: [weight, sum, count] of each measured window
    for _ in range(py.randint(20, 60)):
        counts = {w: (py.choice([1, 2, py.randint(1, 64), py.randint(200, 600)]) if py.random() < 0.6 else 0)
                  for w in widths}
        sums = {w: counts[w] * py.uniform(0, 5) for w in widths}
        p.update_sums(sums, counts)
        for w in widths:
            for e in hist[w]:
                e[0] *= d
            if counts[w]:
                past = sum(e[0] * e[2] for e in hist[w])
                if past > counts[w] / (1 - d):
                    for e in hist[w]:
                        e[0] *= counts[w] / (1 - d) / past
                hist[w].append([1.0, sums[w], counts[w]])
    for w in widths:
        num = sum(e[0] * e[1] for e in hist[w])
        den = sum(e[0] * e[2] for e in hist[w])
        if den == 0:
            assert p.accept[w] == 0.0 and w not in p.seen
        else:
            assert p.accept[w] == pytest.approx(num / den, rel=1e-9)


def test_a_burst_of_request_rounds_does_not_outweigh_later_narrow_measurements():
    """The H200 failure (MoE chain pair, s20): a warm-up batch of 49 requests x 11 rounds accepting
    ~0.1, then c = 1 under plain decoding, measured only by a one-request probe every ~55 rounds
    (windows of 8 rounds).  The estimate must reach the probes' truth (2.1 accepted) within a
    handful of probes (here: 0.28, 0.57, 0.96, 1.35, ... 2.04 at the 8th); before the fix (no
    ageing of unmeasured windows, no cap) it read 0.10, 0.11, ... 0.35 at the 20th."""
    t = CostTable(verify_ms={8: {1: 4.94}}, base_ms={1: 2.06})
    p = BudgetPolicy(t, ema=0.9)
    p.update_sums({8: 0.1 * 49 * 8}, {8: 49 * 8})
    p.update_sums({8: 0.1 * 49 * 3}, {8: 49 * 3})
    reads = []
    for k in range(20 * 7):                       # a probe in every 7th window (56 rounds)
        probe = k % 7 == 6
        p.update_sums({8: 2.1 if probe else 0.0}, {8: 1 if probe else 0})
        if probe:
            reads.append(p.accept[8])
    assert reads[3] > 1.0 and reads[-1] == pytest.approx(2.1, rel=0.05), reads
    # the policy leaves plain decoding once the probes say it pays (2.06 ms vs 4.94 for 1 + a tokens)
    assert p.choose(1) == 8


def test_probe_only_width_tracks_a_step_change_in_a_few_probes():
    """Width 32 is measured by one request-round of bs 16 in every fourth window (a probe), width 8
    by every window: after the truth steps from 1 to 3 both read within 10 % of 3 after 5 probes,
    while the old EMA of window means (0.9 per window, moved only by windows with a probe) still
    read under 2.  Warm-up windows of few requests barely weigh."""
    t = CostTable(verify_ms={8: {16: 10.0}, 32: {16: 20.0}}, base_ms={16: 6.0})
    p = BudgetPolicy(t, ema=0.9)
    p.update_sums({8: 0.04, 32: 0.04}, {8: 1, 32: 1})          # warm-up: one request, accept ~0
    for k in range(40):
        p.update_sums({8: 16 * 8 * 1.0, 32: (16 * 1.0 if k % 4 == 0 else 0.0)},
                      {8: 16 * 8, 32: (16 if k % 4 == 0 else 0)})
    assert p.accept[8] == pytest.approx(1.0, abs=0.01) and p.accept[32] == pytest.approx(1.0, abs=0.01)
    old = p.accept[32]
    for k in range(20):                                       # 5 probes at the new truth
        p.update_sums({8: 16 * 8 * 3.0, 32: (16 * 3.0 if k % 4 == 0 else 0.0)},
                      {8: 16 * 8, 32: (16 if k % 4 == 0 else 0)})
        if k % 4 == 0:
            old = 0.9 * old + 0.1 * 3.0
    assert p.accept[32] == pytest.approx(3.0, rel=0.1) and p.accept[8] == pytest.approx(3.0, rel=0.1)
    assert old < 2.0


def test_overhead_is_the_median_of_recent_samples_and_ignores_rare_spikes():
    """Steady rounds 0.5-1.5 ms over the table with one request finishing (a 20-30 ms spike) in
    every tenth round: the median reads the steady overhead (a mean would read ~3.3 ms); the window
    keeps the last 64 samples, so a lasting change takes over within a window."""
    t = CostTable(verify_ms={8: {1: 5.0, 64: 15.0}}, base_ms={1: 4.0, 64: 6.0})
    p = BudgetPolicy(t)
    py = random.Random()
    extras = []
    for i in range(200):
        bs = py.choice([1, 40, 64])
        extra = py.uniform(20, 30) if i % 10 == 0 else py.uniform(0.5, 1.5)
        assert p.observe_interval(bs, 8, t.cost(bs, 8) + extra)
        extras.append(extra)
    assert 0.5 <= p.overhead(33) <= 1.5 and p.overhead(1) == p.overhead(64)
    assert sum(extras[-64:]) / 64 > 2.5
    for _ in range(40):                                       # the overhead steps to 5 ms
        p.observe_interval(64, 8, 15.0 + 5.0)
    assert p.overhead(64) == pytest.approx(5.0) and len(p.samples) == 64
    with pytest.raises(ValueError):
        BudgetPolicy(t, overhead_window=0)


def _cfg(probe=16, **env):
    """parse_config of these variables; ``probe``: the switch probe_every (switches.py)."""
    return AC.parse_config(env, budget=15, algo="DDTREE-GPU", sw=S.Switches(probe_every=probe))


def _drive(c, rounds, path, clock=None, round_ms=None, bs=1):
    ws = []
    for _ in range(rounds):
        ws.append(c.next_width(bs))
        c.record(path, ws[-1])
        if clock is not None:
            clock.ms += round_ms(ws[-1])
    return ws


def test_controller_cycle_probe_and_policy():
    cfg = AC.parse_config(dict(SGLANG_DDTREE_BUDGETS="0,3,15"), budget=15,
                         algo="DDTREE-GPU", sw=S.Switches(budget_cycle=(0, 3, 15)))
    c = A.WidthController(cfg, policy=None, device="cpu")
    assert [c.next_width(4) for _ in range(7)] == [1, 4, 16, 1, 4, 16, 1]
    assert c.chosen == {1: 3, 4: 2, 16: 2}
    # policy: no-spec is far cheaper, so the policy answers 1; a probe (the widest, 49 ms more than
    # a 1 ms plain step) is paid from 5 % of each round's cost: the first one after 980 rounds
    t = CostTable(verify_ms={4: {1: 40.0}, 16: {1: 50.0}}, base_ms={1: 1.0})
    pol = BudgetPolicy(t, allow_no_spec=True)
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15",
                               probe=5), policy=pol, device="cpu",
                          window_every=2, window_lag=0, clock=lambda: 0.0)
    path = torch.tensor([[0, 1, 2, -1, -1, -1, -1]], dtype=torch.int32)
    c.PROBE_OPTIMISM = 1e9                       # every wider width worth a probe: the credit alone
    ws = _drive(c, 1000, path)
    assert ws[:2] == [16, 16]                    # no counts yet: the widest within 2x the narrowest
    probes = [r for r, w in enumerate(ws) if r >= 2 and w != 1]
    assert probes == [2 + 979] and ws[probes[0]] == 16 and c.probes == 1, probes
    assert pol.accept[16] == pytest.approx(2.0) and pol.accept[4] == pytest.approx(2.0)
    # as shipped: width 16 cannot win (3 tokens in 50 ms against 1 in 1 ms) even at 1.3x its
    # acceptance, so no probe is ever paid
    pol = BudgetPolicy(t, allow_no_spec=True)
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15",
                               probe=5), policy=pol, device="cpu",
                          window_every=2, window_lag=0, clock=lambda: 0.0)
    ws = _drive(c, 1000, path)
    assert set(ws[2:]) == {1} and c.probes == 0


def test_probe_credit_is_a_share_of_the_round_wall_time_not_its_gpu_time():
    """The same table as above (plain step 1 ms on the GPU, probe 49 ms more), but every round takes
    1 ms more on the host clock than the table says: the measured overhead (1 ms) doubles the
    credit per round, so the first probe comes after ~490 plain rounds instead of ~980."""
    t = CostTable(verify_ms={4: {1: 40.0}, 16: {1: 50.0}}, base_ms={1: 1.0})
    firsts = []
    for extra_ms in (0.0, 1.0):
        pol = BudgetPolicy(t, allow_no_spec=True)
        clock = _Clock()
        c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15",
                                   probe=5), policy=pol, device="cpu",
                              window_every=2, window_lag=0, clock=clock)
        c.PROBE_OPTIMISM = 1e9                   # the credit alone decides (see the test above)
        path = torch.tensor([[0, 1, 2, -1, -1, -1, -1]], dtype=torch.int32)
        ws = _drive(c, 1100, path, clock=clock,
                    round_ms=lambda w: t.cost(1, w) + extra_ms)
        firsts.append(next(r for r, w in enumerate(ws) if r >= 2 and w != 1))
    assert 960 <= firsts[0] <= 1000 and 470 <= firsts[1] <= 510, firsts


def test_controller_recovers_from_a_warm_up_burst_at_c1():
    """The H200 MoE c=1 failure end to end through the controller (s20: the A/B's warm-up burst, 49
    requests accepting ~nothing, then c=1 requests accepting 2 / 3 / 4 at widths 8 / 16 / 32; the
    MoE cost table at bs 1, plain step 2.06 ms, rounds 2 ms over the table): the policy must leave
    plain decoding for good within 200 rounds.  Before the s20 fixes it had not after 1,500 (1,474
    plain rounds in this replay); now ~124 plain rounds, 4 probes."""
    t = CostTable(verify_ms={8: {1: 4.94, 48: 13.77}, 16: {1: 6.50, 48: 17.0}, 32: {1: 8.05, 48: 19.31}},
                  base_ms={1: 2.06, 48: 3.5})
    pol = BudgetPolicy(t, allow_no_spec=True)
    clock = _Clock()
    cfg = AC.parse_config({"SGLANG_DDTREE_BUDGETS": "0,7,15,31"}, budget=31,
                         algo="DDTREE-GPU")
    c = A.WidthController(cfg, policy=pol, device="cpu", clock=clock)

    def path_for(bs, slots):
        p = torch.full((bs, 16), -1, dtype=torch.int32)
        p[:, 0] = 0
        for i, slot in enumerate(slots):
            p[:, 1 + i] = slot
        return p

    _drive(c, 11, path_for(49, []), clock, lambda w: t.cost(49, w) + 2.0, bs=49)
    ws = _drive(c, 600, path_for(1, [1, 2, 9, 17]), clock, lambda w: t.cost(1, w) + 2.0)
    settled = next((i for i in range(len(ws)) if 1 not in ws[i:]), None)
    assert settled is not None and settled <= 200 and ws.count(1) <= 200, (settled, ws.count(1), c.probes)


def test_controller_first_rounds_skip_a_widest_tree_that_costs_over_twice_the_narrowest():
    t = CostTable(verify_ms={4: {1: 10.0}, 8: {1: 19.0}, 16: {1: 21.0}}, base_ms={1: 1.0})
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,7,15"), policy=BudgetPolicy(t), device="cpu",
                          window_every=4, window_lag=0, clock=lambda: 0.0)
    assert [c.next_width(1) for _ in range(3)] == [8, 8, 8]
    assert A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,7,15"), policy=None, device="cpu").next_width(1) == 16


def test_controller_probes_cost_at_most_their_share(rng):
    """Cheap probes: the policy keeps width 4; the widest runs every k-th round or less often, and the
    probes' extra cost stays within 5 % of the rounds' cost (+ one probe)."""
    t = CostTable(verify_ms={4: {1: 1.5}, 16: {1: 2.0}}, base_ms={1: 1.0})
    pol = BudgetPolicy(t, allow_no_spec=True, hysteresis=0.0)
    k = 5
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15",
                               probe=k), policy=pol, device="cpu",
                          window_every=2, window_lag=0, clock=lambda: 0.0)
    path = torch.tensor([[0, 1, 2, -1, -1, -1, -1]], dtype=torch.int32)
    pol.accept[16] = 2.0
    c.PROBE_OPTIMISM = 1e9                       # width 16 worth a probe whatever it accepts
    ws = _drive(c, 400, path)[2:]
    # accept 2 at both widths: width 4 gives 2 tokens/ms, width 16 1.5, plain decode 1
    assert set(ws) == {4, 16}
    probes = [r for r, w in enumerate(ws) if w == 16]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert min(gaps) >= k and c.probes == len(probes)
    extra = 0.5 * len(probes)
    assert extra <= 0.05 * 1.5 * len(ws) + 0.5, (extra, len(ws))
    # the credit is spent, not hoarded: a probe as soon as 0.5 ms of credit (0.075 a round) is there
    assert max(gaps) <= 7 and probes[0] <= 7, (probes[:3], gaps)


def test_probes_go_to_the_widest_width_that_could_still_win():
    """Width 4 is the choice (3 tokens in 1 ms).  Width 8 accepts 3.5 (4.5 tokens in 1.6 ms: 2.8 /ms,
    at 1.3x its acceptance 5.55 in 1.6 ms = 3.5 /ms: it could win); width 16 accepts 4 (5 in 4 ms,
    6.2 at 1.3x: cannot).  Probes run width 8, never 16; with width 8's acceptance at 2.5 (4.25
    tokens at 1.3x: 2.66 /ms) nothing could win and no probe runs."""
    t = CostTable(verify_ms={4: {1: 1.0}, 8: {1: 1.6}, 16: {1: 4.0}}, base_ms={1: 0.9})
    for a8, want in ((3.5, 8), (2.5, None)):
        pol = BudgetPolicy(t, allow_no_spec=True, hysteresis=0.0)
        pol.accept.update({4: 2.0, 8: a8, 16: 4.0})
        c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,7,15",
                                   probe=2), policy=pol, device="cpu")
        assert c._probe_target(1, 4) == want
        c.probe_credit, c._since_probe = 1e9, 10
        assert c._probe_or(1, 4) == (want or 4) and c.probes == (1 if want else 0)


def test_controller_round_overhead_moves_the_choice_and_is_shared_at_windows():
    """GPU cost alone favours plain decode (1 token / 10 ms > 3 tokens / 40 ms); a measured 20 ms per
    round outside the table makes width 4 the better (3 / 60 > 1 / 30).  The overhead each rank
    measured reaches the policy only through ``share`` when a window arrives."""
    t = CostTable(verify_ms={4: {1: 40.0}, 16: {1: 45.0}}, base_ms={1: 10.0})
    shared = []

    def share(d):
        shared.append(d)
        return d

    clock = _Clock()
    pol = BudgetPolicy(t, allow_no_spec=True, hysteresis=0.0)
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15",
                               probe=1000), policy=pol, device="cpu",
                          window_every=4, window_lag=0, clock=clock, share=share)
    path = torch.tensor([[0, 1, 2, -1, -1, -1, -1]], dtype=torch.int32)
    cost = {1: 10.0, 4: 40.0, 16: 45.0}
    ws = _drive(c, 40, path, clock, lambda w: cost[w] + 20.0)
    assert ws[:4] == [16] * 4
    assert len(shared) == 9 and shared[0]["overhead_ms"] == pytest.approx(20.0)
    assert shared[0]["prefill_ms"] is None and shared[0]["finish_rate"] is None   # no prefill yet
    assert pol.overhead(1) == pytest.approx(20.0)
    assert set(ws[4:]) == {4}, ws
    # the same table, no overhead (the clock stands still: every interval is ignored): plain decode
    pol2 = BudgetPolicy(t, allow_no_spec=True, hysteresis=0.0)
    c2 = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15",
                                probe=1000), policy=pol2, device="cpu",
                           window_every=4, window_lag=0, clock=lambda: 0.0)
    assert set(_drive(c2, 40, path)[4:]) == {1} and pol2.overhead_ms == 0.0


def test_controller_keeps_the_plain_rounds_overhead_apart():
    """Tree rounds cost 20 ms outside the table, plain rounds 0.5 ms (measured on the H200 the two
    differ: ``budget_policy`` docstring).  One shared value makes width 4 look better (3 / 60 >
    1 / 30); once plain rounds (pinned by requests here) have been measured on their own, plain
    decoding is the choice (1 / 10.5 > 3 / 60), and the rings reach the policy through ``share``."""
    t = CostTable(verify_ms={4: {1: 40.0}, 16: {1: 45.0}}, base_ms={1: 10.0})
    shared = []
    clock = _Clock()
    pol = BudgetPolicy(t, allow_no_spec=True, hysteresis=0.0)
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15", probe=1000),
                          policy=pol, device="cpu", window_every=4, window_lag=0, clock=clock,
                          share=lambda d: shared.append(d) or d)
    path = torch.tensor([[0, 1, 2, -1, -1, -1, -1]], dtype=torch.int32)
    extra = {1: 10.0 + 0.5, 4: 40.0 + 20.0, 16: 45.0 + 20.0}
    ws = _drive(c, 12, path, clock, lambda w: extra[w])
    assert set(ws[4:]) == {4} and pol.overhead_plain_ms is None           # plain never measured yet
    for _ in range(8):                                                     # requests pin no speculation
        w = c.next_width(1, requested=1)
        c.record(path, w)
        clock.ms += extra[w]
    ws = _drive(c, 12, path, clock, lambda w: extra[w])
    assert pol.overhead_ms == pytest.approx(20.0) and pol.overhead_plain_ms == pytest.approx(0.5)
    assert set(ws[4:]) == {1}, ws
    assert any(d["overhead_plain_ms"] == pytest.approx(0.5) for d in shared if d["overhead_plain_ms"])
    snap = c.snapshot()
    assert snap["overhead_plain_ms"] == pytest.approx(0.5) and snap["overhead_plain_samples"] >= 7


def _controller(lag, clock):
    t = CostTable(verify_ms={4: {1: 40.0}, 16: {1: 45.0}}, base_ms={1: 10.0})
    pol = BudgetPolicy(t, allow_no_spec=True, hysteresis=0.0)
    return A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15",
                                  probe=1000), policy=pol, device="cpu",
                             window_every=1000, window_lag=0, clock=clock, lag=lag)


def _replay(c, clock, launches):
    """launches: [(host ms, 'round' | 'prefill')] in order -> the widths the rounds got."""
    ws = []
    for t, kind in launches:
        clock.ms = float(t)
        if kind == "round":
            ws.append(c.next_width(1))
        else:
            c.interrupt()
    return ws


def test_controller_without_overlap_measures_each_batch_from_its_launch_to_the_next():
    """lag 0 (no overlap scheduling): the host launches a batch once the previous one is processed,
    so the interval from a launch to the next is that batch's time.  Width-16 rounds of 45 ms on the
    GPU, 2 ms of host work each, one 30 ms prefill: the prefill's interval is not observed."""
    clock = _Clock()
    c = _controller(0, clock)
    #          R1          R2             P (R2's interval: 47)  R3 (P: 30 ms)  R4
    ws = _replay(c, clock, [(0, "round"), (47, "round"), (94, "prefill"), (124, "round"), (171, "round")])
    assert ws == [16] * 4
    assert list(c._local_overhead) == [pytest.approx(2.0)] * 3
    assert c.intervals == {"observed": 3, "ignored": 0, "other_batch": 1}


def test_controller_under_overlap_attributes_each_interval_to_the_batch_before():
    """lag 1 (SGLang's overlap scheduler, ``event_loop_overlap``): batch i + 1 is launched after the
    host processed batch i - 1's result, so the interval from launch i to launch i + 1 is batch
    i - 1's GPU time.  GPU: R1 0-45, R2 45-90, P (a 30 ms prefill) 90-120, R3 120-165, R4 165-210;
    the host processes a result 2 ms after it is ready.  Every round then measures 45 ms (its cost:
    no overhead) and the prefill is not observed; attributed with lag 0 instead, the prefill's
    interval would count as R3's and the one after it as R4's."""
    clock = _Clock()
    launches = [(0, "round"), (1, "round"), (47, "prefill"), (92, "round"), (122, "round"), (167, "round")]
    c = _controller(1, clock)
    assert _replay(c, clock, launches) == [16] * 5
    assert c.intervals == {"observed": 3, "ignored": 0, "other_batch": 1}
    assert list(c._local_overhead) == [pytest.approx(1.0), pytest.approx(0.0), pytest.approx(0.0)]
    wrong = _controller(0, clock)
    _replay(wrong, clock, launches)
    assert wrong.intervals["observed"] == 4 and wrong.intervals["other_batch"] == 1
    # lag 0 under overlap: R1 measured 1 ms (-44), R2 46 (+1), R3 30 (-15), R4 45 (0): off by one
    assert list(wrong._local_overhead) == [pytest.approx(x) for x in (-44.0, 1.0, -15.0, 0.0)]
    wrong.policy.overhead_ms = wrong.policy.overhead_of(wrong._local_overhead)
    assert wrong.policy.overhead_ms == pytest.approx(-7.5)
    assert wrong.policy.overhead(1) == 0.0       # a negative median reads as no overhead
    with pytest.raises(ValueError, match="lag"):
        _controller(2, clock)


def test_controller_keeps_each_rounds_context_with_its_interval():
    """Told the batch's KV tokens, the controller keeps (residual, K thousand tokens) per choice, also
    for rounds the per-kind filter rejects (at a long context a round is far above its context-free
    table: here 245 ms for a 45 ms table cost), leaves out an idle gap once the ring has 4 samples
    and a draft-only probe, and hands its fits to the policy with the window."""
    clock = _Clock()
    c = _controller(0, clock)
    t = 0.0
    for i in range(6):          # six width-16 rounds at 32k tokens: 200 ms of context each
        clock.ms = t
        assert c.next_width(1, kv_tokens=32_000) == 16
        t += 245.0
    clock.ms = t + 5000.0       # the server idled
    c.next_width(1, kv_tokens=32_000)
    assert c.intervals["ignored"] == 6                       # the per-kind filter: 4 x 45 + 20 < 245
    assert list(c._local_width[16]) == [(pytest.approx(200.0), 32.0)] * 5   # the idle gap left out
    out = c._close_window()
    assert out["width_fit"][16] == (pytest.approx(200.0), 0.0, 5)
    c.policy.width_fit = out["width_fit"]
    c.policy.kv_k = 32.0
    assert c.policy.overhead(1, 16) == pytest.approx(200.0)
    c.predict = True            # a no-speculation round with the drafter block: not a plain sample
    c._launched = [(1, 1, None)]
    c._t_launch, clock.ms = 0.0, 12.0
    c._launch(None)
    assert 0 not in c._local_width
    assert "width_fit" not in _controller(0, clock)._close_window()   # no context ever told: as before


def test_controller_interrupts_back_to_back_and_idle_gaps():
    """Two prefills in a row: neither interval is observed; an idle gap (500 ms) is ignored by the
    policy's filter (longer than 4x the cost + 20 ms)."""
    clock = _Clock()
    c = _controller(0, clock)
    _replay(c, clock, [(0, "round"), (47, "prefill"), (60, "prefill"), (80, "round"), (580, "round"),
                       (625, "round")])
    assert c.intervals == {"observed": 2, "ignored": 1, "other_batch": 2}
    assert list(c._local_overhead) == [pytest.approx(2.0), pytest.approx(0.0)]
    snap = c.snapshot()
    assert snap["intervals"] == c.intervals and snap["lag"] == 0 and snap["chosen"] == {"16": 4}
    assert set(snap["accept"]) == {"4", "16"} and snap["probes"] == 0


def test_policy_observe_interval_filters_and_takes_the_median():
    t = CostTable(verify_ms={4: {1: 4.0, 8: 8.0}}, base_ms={1: 1.0, 8: 2.0})
    pol = BudgetPolicy(t)
    assert pol.overhead(5) == 0.0
    assert pol.observe_interval(1, 4, 6.0) and pol.overhead_ms == pytest.approx(2.0)
    assert pol.observe_interval(1, 4, 3.0)                       # faster than the table: -1 (signed)
    assert pol.overhead_ms == pytest.approx(0.5)
    assert not pol.observe_interval(1, 4, 4 * 4.0 + 20.5)        # idle gap / prefill: ignored
    assert not pol.observe_interval(1, 4, 0.0) and not pol.observe_interval(1, 4, float("nan"))
    # a no-speculation round: its own ring and value (+5); tree rounds keep theirs (0.5)
    assert pol.overhead(8, NO_SPEC) == pytest.approx(0.5)            # plain not measured yet: the tree's
    assert pol.observe_interval(8, NO_SPEC, 7.0) and pol.overhead_plain_ms == pytest.approx(5.0)
    assert pol.overhead_ms == pytest.approx(0.5) and list(pol.samples_plain) == [5.0]
    assert pol.overhead(4) == pol.overhead(8) == pol.overhead(8, 4) == pytest.approx(0.5)   # every bs
    assert pol.overhead(1, NO_SPEC) == pol.overhead(8, NO_SPEC) == pytest.approx(5.0)
    ring = collections.deque(maxlen=64)
    assert pol.observe_interval(1, 4, 9.0, into=ring) and list(ring) == [5.0]
    assert pol.overhead_ms == pytest.approx(0.5)                 # a ring of its own: not the policy's
    for _ in range(20):
        pol.observe_interval(1, 4, 1.0)                          # 3 ms under the table, every time
    assert pol.overhead_ms < 0 and pol.overhead(1) == 0.0        # floored where it is read
    pol.overhead_ms, pol.overhead_plain_ms = 5.0, 1.0
    assert pol.round_ms(8, 4) == pytest.approx(8.0 + 5.0)
    assert pol.tokens_per_ms(8, NO_SPEC) == pytest.approx(8 / 3.0)
    assert BudgetPolicy.overhead_of([]) is None


def test_controller_record_drops_wider_widths():
    c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,7,15"), policy=None, device="cpu",
                          window_every=1, window_lag=0)
    path = torch.tensor([[0, 2, 5, 9, -1, -1, -1]], dtype=torch.int32)     # slots 2, 5 <= 7; 9 > 7
    c.record(path, 8)                               # a width-8 round: widths 4 and 8 known, 16 not
    assert c.window.due() == [([[1, 2, 0]], [[1, 1, 0]], [[0, 1, 0]], None)]
    c.record(path, NO_SPEC)                         # no-spec (width 1): nothing known
    assert c.window.due() == [([[0, 0, 0]], [[0, 0, 0]], [[0, 0, 0]], None)]
    c.record(path, 16)
    assert c.window.due() == [([[1, 2, 3]], [[1, 1, 1]], [[0, 1, 2]], None)]


def test_profile_records_carry_the_policy_state(tmp_path, monkeypatch):
    """With a profile file, each record gets the controller's snapshot under "adaptive" (what the
    policy believed when it chose: acceptance per width, overhead per batch size, interval counts)."""
    import json

    from sglang_ddtree import profiling
    path = tmp_path / "p.jsonl"
    monkeypatch.setenv(profiling.ENV_FILE, str(path))
    clock = _Clock()
    c = _controller(1, clock)
    _replay(c, clock, [(0, "round"), (1, "round"), (47, "round")])
    prof = profiling.RoundProfiler({"algo": "DDTREE-GPU"})
    prof.extra = c.snapshot
    prof._done = [([1.0, 0.0, 0.0, 4.0, 0.0, 0.0], 6.0, 0.5, 1, 16)]
    prof._flush()
    rec = json.loads(path.read_text().splitlines()[-1])
    assert rec["adaptive"]["intervals"] == {"observed": 1, "ignored": 0, "other_batch": 0}
    assert rec["adaptive"]["overhead_ms"] == 0.0 and rec["adaptive"]["chosen"] == {"16": 3}
    assert rec["adaptive"]["overhead_samples"] == 1 and rec["adaptive"]["accept_weight"] == {"4": 0.0, "16": 0.0}
    assert rec["adaptive"]["lag"] == 1 and rec["adaptive"]["accept"] == {"4": 0.0, "16": 0.0}


def test_round_overhead_switch():
    """The A/B switch round_overhead = False (arm suffix _nooverhead): the controller observes no
    interval (GPU table and acceptance alone)."""
    assert _cfg(SGLANG_DDTREE_BUDGETS="0,3,15").overhead
    cfg = AC.parse_config(dict(SGLANG_DDTREE_BUDGETS="0,3,15"), budget=15, algo="DDTREE-GPU",
                         sw=S.Switches(round_overhead=False))
    assert not cfg.overhead
    t = CostTable(verify_ms={4: {1: 40.0}, 16: {1: 45.0}}, base_ms={1: 10.0})
    clock = _Clock()
    c = A.WidthController(cfg, policy=BudgetPolicy(t), device="cpu", window_every=1000, window_lag=0,
                          clock=clock, lag=0)
    _replay(c, clock, [(0, "round"), (60, "round"), (120, "round")])
    assert len(c._local_overhead) == 0 and c.intervals == {"observed": 0, "ignored": 0, "other_batch": 0}


def test_admission_cost_per_round_follows_the_poisson_finish_model():
    """admission_ms = prefill_ms * (1 - exp(-rate * bs * tokens per request-round)); with the H200
    dense run's figures (s16 run 1, c = 64: plain step 5.6 ms GPU / 19 ms wall, width 8 16.9 / 30.8)
    the GPU table alone prefers plain decoding at an acceptance of 1.5 (what the policy believed),
    the admissions make width 8 the choice, as measured (6516 vs 3366 tok/s)."""
    t = CostTable(verify_ms={8: {64: 16.85}, 16: {64: 27.5}}, base_ms={64: 5.61})
    p = BudgetPolicy(t, hysteresis=0.0)
    p.update_sums({8: 1.5, 16: 2.0}, {8: 1, 16: 1})
    assert p.admission_ms(64, 8) == 0.0 and p.choose(64) == NO_SPEC
    p.prefill_ms, p.finish_rate = 20.0, 1.0 / 64
    assert p.admission_ms(64, NO_SPEC) == pytest.approx(20.0 * (1 - math.exp(-1.0)))
    assert p.admission_ms(64, 8) == pytest.approx(20.0 * (1 - math.exp(-2.5)))
    assert p.round_ms(64, 8) == pytest.approx(16.85 + 20.0 * (1 - math.exp(-2.5)))
    assert p.choose(64) == 8


def test_controller_measures_prefill_batches_and_the_finish_rate():
    """lag 0 and lag 1 (the sums do not depend on which interval a prefill lands in): rounds at their
    table cost + 1 ms of host overhead, a 30 ms prefill batch after every second round, one 400 ms
    idle gap (> 250 ms: dropped).  prefill_ms = the wall clock left after the rounds' cost and
    overhead, per prefill = 30 (lag 1 here: within 5 %); half the rounds are followed by one, each emits bs x (1 + accept) =
    1 x 3 tokens, so the rate is ln 2 / 3 per token (decayed sums: the ratio stays exact)."""
    for lag in (0, 1):
        clock = _Clock()
        t = CostTable(verify_ms={4: {1: 40.0}, 16: {1: 45.0}}, base_ms={1: 10.0})
        pol = BudgetPolicy(t, allow_no_spec=False, hysteresis=0.0)
        pol.update_sums({4: 2.0, 16: 2.0}, {4: 1, 16: 1})
        c = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15", probe=1000),
                              policy=pol, device="cpu", window_every=1000, window_lag=0, clock=clock, lag=lag)
        tms = 0.0
        for i in range(40):
            clock.ms = tms
            w = c.next_width(1)
            tms += t.cost(1, w) + 1.0
            if i == 20:
                tms += 400.0                                   # idle: the interval is dropped
            if i % 2 == 1:
                clock.ms = tms
                c.interrupt()
                tms += 30.0
            if i % 10 == 9:
                figs = c._close_window()
        assert figs["overhead_ms"] == pytest.approx(1.0)
        # lag 1 on a clock that runs each batch from its own launch: the window edges and the idle gap
        # shift one batch's cost between windows (a few %); lag 0 is exact
        assert figs["prefill_ms"] == pytest.approx(30.0, rel=0.05 if lag else 1e-9), lag
        assert figs["finish_rate"] == pytest.approx(math.log(2.0) / 3.0, rel=1e-6)
        snap = c.snapshot()
        assert snap["prefills_weight"] > 0 and snap["prefill_ms"] == 0.0     # not shared yet
    # nothing measured yet: None (the policy keeps its values)
    fresh = A.WidthController(_cfg(SGLANG_DDTREE_BUDGETS="0,3,15"), policy=BudgetPolicy(t), device="cpu")
    assert fresh._close_window() == {"overhead_ms": None, "overhead_plain_ms": None, "prefill_ms": None,
                                     "finish_rate": None}


def test_paired_gains_remove_the_bias_of_which_rounds_ran_the_wide_tree():
    """Acceptance that depends on the round (early rounds of a request accept little, late ones a
    lot) and a wide width measured only on late rounds (H200, s18 run 2: tails of levels): the mean
    over its own rounds over-reads it; the narrowest width's mean over every round times the
    same-round gains reads the truth over all rounds."""
    t = CostTable(verify_ms={8: {16: 10.0}, 16: {16: 12.0}, 32: {16: 20.0}}, base_ms={16: 6.0})
    early, late = {8: 0.5, 16: 0.6, 32: 0.7}, {8: 2.5, 16: 4.0, 32: 5.2}
    truth = {w: (early[w] + late[w]) / 2 for w in early}          # half the rounds each
    marg, pair = BudgetPolicy(t, ema=0.9), BudgetPolicy(t, ema=0.9)
    for k in range(60):
        # 16 request-rounds early and 16 late at widths 8 / 16; width 32 only on 4 late ones
        sums = {8: 16 * early[8] + 16 * late[8], 16: 16 * early[16] + 16 * late[16], 32: 4 * late[32]}
        counts = {8: 32, 16: 32, 32: 4}
        below = {8: 0.0, 16: 16 * early[8] + 16 * late[8], 32: 4 * late[16]}
        marg.update_sums(sums, counts)
        pair.update_sums(sums, counts, below)
    assert marg.accept[32] == pytest.approx(late[32])                  # the biased mean: 5.2
    assert pair.accept[8] == pytest.approx(truth[8]) and pair.accept[16] == pytest.approx(truth[16])
    # 32: 2.3 * 5.2 / 4.0 = 2.99 against the truth 2.95 (the gain is proportional only roughly)
    assert pair.accept[32] == pytest.approx(truth[32], rel=0.02)
    assert marg.choose(16) == 32 and pair.choose(16) == 16             # 5.2+1 / 20 vs 3.3 / 12


def test_paired_estimates_equal_the_means_when_every_round_runs_every_width():
    t = CostTable(verify_ms={4: {1: 1.0}, 8: {1: 1.0}, 16: {1: 1.0}}, base_ms={1: 1.0})
    rng = random.Random(7)
    p, q = BudgetPolicy(t, ema=0.8), BudgetPolicy(t, ema=0.8)
    for _ in range(30):
        rows = []
        for _ in range(rng.randint(1, 6)):
            a = rng.randint(0, 3)
            b = a + rng.randint(0, 4)
            rows.append([a, b, b + rng.randint(0, 5)])
        p.update(rows, [4, 8, 16])
        q.update_sums({w: sum(r[j] for r in rows) for j, w in enumerate((4, 8, 16))}, {w: len(rows) for w in (4, 8, 16)})
    for w in (4, 8, 16):
        assert p.accept[w] == pytest.approx(q.accept[w], rel=1e-9)
    with pytest.raises(ValueError):
        p.update_sums({4: 1.0, 8: 1.0}, {4: 1, 8: 1}, {4: 0.0, 8: -1.0})
