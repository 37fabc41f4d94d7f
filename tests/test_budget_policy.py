"""sglang_ddtree.policy.budget_policy: the per-round verify width from a cost table and counterfactual
acceptance (issue 17 item 3, host-side decision; not wired into the worker yet).

The cost table below is the H200 measurement at the Qwen3-8B shape
(../shared/design/scale-cost-2026-12-01.md: base 5.23 / 5.62 / 7.15 ms, width 17 8.25 / 11.30 /
31.02 ms, width 33 8.42 / 13.48 / 44.91 ms at c = 1 / 8 / 32).  Every choice is checked against a
brute force over the candidates on fresh random acceptance curves; counterfactual counts come from
real trees (``ddtree.build_tree`` + the reference accept walk) through ``tree_ops``."""
import random

import pytest
import torch

from helpers import drafter_logits, logprobs_from_logits
from sglang_ddtree import ddtree, tree_ops
from sglang_ddtree.policy.budget_policy import NO_SPEC, BudgetPolicy, CostTable, _interp

H200_8B = CostTable(verify_ms={17: {1: 8.25, 8: 11.30, 32: 31.02}, 33: {1: 8.42, 8: 13.48, 32: 44.91}},
                    base_ms={1: 5.23, 8: 5.62, 32: 7.15})


def test_interpolation_and_table_checks():
    assert _interp({1: 2.0, 9: 10.0}, 5) == pytest.approx(6.0)
    assert _interp({1: 2.0, 9: 10.0}, 0) == 2.0 and _interp({1: 2.0, 9: 10.0}, 64) == 10.0
    assert H200_8B.cost(8, 17) == pytest.approx(11.30) and H200_8B.cost(8, NO_SPEC) == pytest.approx(5.62)
    for bad in ({17: {1: 0.0}}, {17: {1: float("nan")}}, {1: {1: 3.0}}, {}):
        with pytest.raises(ValueError):
            CostTable(verify_ms=bad, base_ms={1: 5.0})
    with pytest.raises(ValueError):
        BudgetPolicy(H200_8B, ema=1.0)
    with pytest.raises(ValueError):
        BudgetPolicy(H200_8B).choose(0)


def test_choice_follows_load_on_the_measured_8b_costs():
    """With the text pair's acceptance (~0.75 accepted at b16, hardly more at b32) speculation pays at
    c=1, and at c=32 the compute-bound verify makes plain decoding the better choice."""
    p = BudgetPolicy(H200_8B, hysteresis=0.0)
    p.update([[0.75, 0.78]] * 4, widths=[17, 33])
    assert p.choose(1) == 17                     # 1.75 / 8.25 > 1.78 / 8.42 > 1 / 5.23
    assert p.choose(32) == NO_SPEC               # 32 * 1.75 / 31.02 < 32 / 7.15
    p2 = BudgetPolicy(H200_8B, hysteresis=0.0)
    p2.update([[3.0, 5.0]] * 4, widths=[17, 33])  # a drafter that accepts a lot: the wide tree wins at c=1
    assert p2.choose(1) == 33
    no_base = BudgetPolicy(H200_8B, hysteresis=0.0, allow_no_spec=False)
    no_base.update([[0.75, 0.78]], widths=[17, 33])
    assert no_base.choose(32) == 17


def test_choice_serves_at_least_every_other_candidate_on_random_curves():
    """A property, not the scoring restated: at a timed batch size, the chosen width's tokens per ms
    (from the table's own entry and the acceptance fed in) is at least every other tree width's; a
    tree is chosen only if it serves at least ``1 + spec_margin (1 - 1 / bs)`` x plain decoding, and
    plain decoding only if no tree does (with a margin of 0: the best of all); past every timed batch
    size plain decoding is the only choice."""
    rng = random.Random()
    for i in range(400):
        margin = 0.0 if i % 2 else rng.uniform(0.0, 0.3)
        widths = sorted(rng.sample(range(2, 66), rng.randint(1, 4)))
        bss = sorted(rng.sample(range(1, 129), rng.randint(1, 4)))
        verify = {w: {b: rng.uniform(2, 60) for b in bss} for w in widths}
        base = {b: rng.uniform(2, 20) for b in bss}
        p = BudgetPolicy(CostTable(verify, base), hysteresis=0.0, ema=0.0, spec_margin=margin)
        acc = sorted(rng.uniform(0, 6) for _ in widths)   # more nodes never accept less
        p.update([acc], widths=widths)
        bs = rng.choice(bss)
        plain = bs / base[bs]
        trees = {w: bs * (1 + acc[i]) / verify[w][bs] for i, w in enumerate(widths)}
        bar = plain * (1 + margin * (1 - 1 / bs))
        got = p.choose(bs)
        if got == NO_SPEC:
            assert all(v <= bar * (1 + 1e-12) for v in trees.values()), (bar, trees)
        else:
            assert trees[got] >= bar * (1 - 1e-12), (got, bar, trees)
            assert all(trees[got] >= v * (1 - 1e-12) for v in trees.values()), (got, trees)
        assert p.choose(max(bss) + rng.randint(1, 50)) == NO_SPEC


def test_a_tree_must_beat_plain_decoding_by_the_margin_at_load():
    """Hand-worked on a one-width table (base 5 ms, width 9 8 ms at bs 1 and 16): a tree accepting
    0.7 serves 16 x 1.7 / 8 = 3.4 tokens/ms at bs 16 against plain decoding's 3.2 (+6.25 %), under
    the default margin of 10 % x (1 - 1/16) = 9.375 %: plain decoding; at 0.9 accepted (4.0, +25 %):
    the tree.  At bs 1 (no batch whose admissions speculation could spread) 1.7 / 8 = 0.2125 beats
    1 / 5 = 0.2 by the same 6.25 % and the tree is chosen; without a no-speculation choice there is
    no margin."""
    table = CostTable({9: {1: 8.0, 16: 8.0}}, {1: 5.0, 16: 5.0})
    p = BudgetPolicy(table, hysteresis=0.0, ema=0.0)
    assert p.spec_margin == pytest.approx(0.10)
    p.update([[0.7]], widths=[9])
    assert p.tokens_per_ms(16, 9) == pytest.approx(3.4) and p.tokens_per_ms(16, NO_SPEC) == pytest.approx(3.2)
    assert p.choose(16) == NO_SPEC
    assert p.choose(1) == 9
    p.update([[0.9]], widths=[9])
    assert p.choose(16) == 9
    p0 = BudgetPolicy(table, hysteresis=0.0, ema=0.0, spec_margin=0.0)
    p0.update([[0.7]], widths=[9])
    assert p0.choose(16) == 9
    no_plain = BudgetPolicy(table, hysteresis=0.0, ema=0.0, allow_no_spec=False)
    no_plain.update([[0.7]], widths=[9])
    assert no_plain.score(16, 9) == pytest.approx(3.4)
    with pytest.raises(ValueError):
        BudgetPolicy(table, spec_margin=-0.1)


def test_an_exact_tie_goes_to_the_narrower_width():
    """Worked by hand: at bs 2, width 9 (4 ms, 1 accepted) and width 17 (8 ms, 3 accepted) both serve
    2 x 2 / 4 = 2 x 4 / 8 = 1.0 token per ms; plain decoding 2 / 4 = 0.5.  The cheaper width wins."""
    p = BudgetPolicy(CostTable({9: {2: 4.0}, 17: {2: 8.0}}, {2: 4.0}), hysteresis=0.0, ema=0.0)
    p.update([[1.0, 3.0]], widths=[9, 17])
    assert p.tokens_per_ms(2, 9) == pytest.approx(1.0) and p.tokens_per_ms(2, 17) == pytest.approx(1.0)
    assert p.choose(2) == 9


def test_overhead_and_admission_enter_the_choice():
    """Worked by hand: bs 4, width 9 costs 6 ms and accepts 1 (8 tokens), plain decoding 4 ms (4
    tokens).  GPU cost alone: 1.33 vs 1.0 tokens per ms, width 9.  With 6 ms of overhead per round
    (both kinds) it is 8 / 12 = 0.67 vs 4 / 10 = 0.4: still width 9; with a 30 ms prefill after every
    round (a finish rate that makes a finish in every round certain) 8 / 42 = 0.19 vs 4 / 40 = 0.1."""
    p = BudgetPolicy(CostTable({9: {4: 6.0}}, {4: 4.0}), hysteresis=0.0, ema=0.0)
    p.update([[1.0]], widths=[9])
    assert p.choose(4) == 9
    p.overhead_ms = p.overhead_plain_ms = 6.0
    assert p.tokens_per_ms(4, 9) == pytest.approx(8 / 12) and p.tokens_per_ms(4, NO_SPEC) == pytest.approx(0.4)
    p.prefill_ms, p.finish_rate = 30.0, 50.0
    assert p.tokens_per_ms(4, 9) == pytest.approx(8 / 42, rel=1e-6)
    assert p.tokens_per_ms(4, NO_SPEC) == pytest.approx(4 / 40, rel=1e-6)
    p.overhead_plain_ms = 0.0             # plain rounds' own overhead: 4 / 34 = 0.118 < 0.19
    assert p.choose(4) == 9
    p.overhead_ms = 60.0                  # tree rounds far dearer: 8 / 96 = 0.083 < 0.118
    assert p.choose(4) == NO_SPEC


def test_hysteresis_keeps_the_current_width_until_a_clear_gain():
    p = BudgetPolicy(H200_8B, hysteresis=0.05, ema=0.0)
    p.update([[0.75, 0.78]], widths=[17, 33])
    assert p.choose(1) == 17
    p.update([[0.75, 0.83]], widths=[17, 33])    # b32 now 2.5 % better at c=1 (1.83 / 8.42): stay
    assert p.tokens_per_ms(1, 33) > p.tokens_per_ms(1, 17)
    assert p.choose(1) == 17
    p.update([[0.75, 2.5]], widths=[17, 33])     # clearly better: switch
    assert p.choose(1) == 33


def test_ema_and_update_checks():
    p = BudgetPolicy(H200_8B, ema=0.5)
    p.update([[1.0, 2.0], [3.0, 4.0]], widths=[17, 33])     # the first round sets the average
    assert p.accept == {17: 2.0, 33: 3.0}
    p.update([[0.0, 1.0]], widths=[17, 33])
    assert p.accept == {17: 1.0, 33: 2.0}
    p.update([[5.0]], widths=[9])                            # a width outside the table is ignored
    assert p.accept == {17: 1.0, 33: 2.0}
    with pytest.raises(ValueError):
        p.update([[1.0]], widths=[17, 33])
    with pytest.raises(ValueError):
        p.update([[-1.0, 0.0]], widths=[17, 33])


def test_counterfactual_counts_from_real_trees_feed_the_policy(rng):
    """One round of a budget-32 tree gives the counts for widths 9 / 17 / 33 (tree_ops), monotone in
    the width, and the policy's average is their batch mean."""
    bs, D, V = 6, 7, 300
    lp, ids = logprobs_from_logits(drafter_logits(bs, D, V, rng), k=32)
    tree = ddtree.build_tree(lp, ids, 32, backend="reference")
    target = torch.randint(0, V, (bs, 33), generator=rng)
    # make the target follow the drafter's top choices often so paths are long
    target = torch.where(torch.rand(bs, 33, generator=rng) < 0.8,
                         tree.tokens.clamp(min=0).gather(1, torch.randint(0, 33, (bs, 33), generator=rng)), target)
    acc = ddtree.accept_greedy(tree, target, backend="reference")
    counts = tree_ops.counterfactual_accept_len(acc.path, [8, 16, 32])
    assert (counts[:, 0] <= counts[:, 1]).all() and (counts[:, 1] <= counts[:, 2]).all()
    assert torch.equal(counts[:, 2].to(torch.int64), acc.accept_len.to(torch.int64))
    table = CostTable(verify_ms={w: {1: 5.0 + w / 10} for w in (9, 17, 33)}, base_ms={1: 5.0})
    p = BudgetPolicy(table)
    p.update(counts.tolist(), widths=[9, 17, 33])
    for j, w in enumerate((9, 17, 33)):
        assert p.accept[w] == pytest.approx(counts[:, j].float().mean().item())


# ------------------------------------------------------------------ the context axis (issue 41 item 3)
def test_fit_width_overhead_reads_the_context_slope_from_medians(rng):
    """a + b K from (residual, K) samples: the median pairwise slope (Theil-Sen), so a spike (an
    admission, a GC pause) moves neither; one context length (or < 4 samples) gives b = 0 and the
    median."""
    fit = BudgetPolicy.fit_width_overhead
    assert fit([]) is None
    a, b, n = fit([(1.0, 32.0), (1.4, 32.2), (1.1, 32.1), (50.0, 32.0), (1.2, 31.9)])
    assert (b, n) == (0.0, 5) and a == pytest.approx(1.2)
    assert fit([(1.0, 2.0), (9.0, 40.0), (2.0, 3.0)])[1] == 0.0          # < 4 samples: no slope
    a0, b0 = 0.8, 0.37                                                     # ms, ms per thousand tokens
    ks = [float(torch.randint(1, 128, (1,), generator=rng)) for _ in range(31)]
    pts = [(a0 + b0 * k + 0.05 * float(torch.randn(1, generator=rng)), k) for k in ks]
    pts[3] = (pts[3][0] + 80.0, pts[3][1])                                  # one spike
    a, b, _ = fit(pts)
    assert b == pytest.approx(b0, rel=0.05) and a == pytest.approx(a0, abs=0.3)
    # falling residuals with the context are noise, not a negative cost
    a, b, _ = fit([(5.0 - 0.01 * k, k) for k in range(1, 120, 10)])
    assert b == 0.0 and a == pytest.approx(5.0 - 0.01 * 56, abs=0.06)


def test_width_overhead_prices_each_choice_at_the_batch_context():
    """A choice with its own fit reads it; the rest extrapolate from the fitted tree widths (one: by
    (B + w) / (B + m) and 1 / (B + m) for plain decoding; two or more: their line over the width, its
    slope for plain decoding); nothing fitted, or no context known: the per-kind overhead."""
    p = BudgetPolicy(H200_8B, draft_queries=16)
    p.overhead_ms, p.overhead_plain_ms = 1.5, 0.7
    assert p.width_overhead(17, 32.0) is None and p.overhead(1, 17) == 1.5   # nothing fitted
    p.width_fit = {33: (0.0, 0.5, 12), 17: (9.0, 9.0, 3)}   # width 17: too few rounds for its own fit
    p.kv_k = 32.0
    assert p.overhead(1, 33) == pytest.approx(16.0)
    assert p.overhead(1, 17) == pytest.approx(16.0 * (16 + 17) / (16 + 33))
    assert p.overhead(1, NO_SPEC) == pytest.approx(16.0 / (16 + 33))          # errs cheap: gets measured
    p.width_fit[17] = (2.0, 0.2, 8)                                              # now two tree widths
    e17, e33 = 2.0 + 0.2 * 32, 16.0
    slope = (e33 - e17) / (33 - 17)
    assert p.overhead(1, NO_SPEC) == pytest.approx(slope)
    p.width_fit[NO_SPEC] = (0.6, 0.03, 20)
    assert p.overhead(1, NO_SPEC) == pytest.approx(0.6 + 0.03 * 32)
    assert p.draft_overhead() == pytest.approx(max(0.0, e17 - slope * 17))      # the line at width 0
    # the choice follows: at 32k plain decoding beats both trees it would not beat without context
    p.update([[1.0, 1.0]] * 8, widths=[17, 33])
    assert p.choose(1) == NO_SPEC
    p.kv_k = None
    assert p.overhead(1, 33) == 1.5 and p.draft_overhead() == 0.0 and p.choose(1) == 17


def test_a_synced_batch_needs_the_admissions_it_would_spread_paid_back():
    """``synced_left`` (the batch would finish in a few waves under plain decoding, that many tokens
    from now): a tree must serve ``1 + (bs - 1) x sync_admission_ms / (synced_left x plain round)``
    x plain decoding (at most ``1 + sync_margin``, at least the unsynced margin).  Hand-worked on a
    one-width table: plain 5 ms a round at bs 16 (3.2 tokens/ms), width 9 8 ms (2 (1 + a)).
    Unsynced: 1 + 0.1 x 15/16 -> a tree needs a > 0.75.  256 tokens left: 1 + 15 x 30 / 1280 =
    1.352 -> a > 1.16; 1024 left: 15 x 30 / 5120 = 8.8 % is below the unsynced margin, which holds;
    10 left: capped at 1 + 1.0 -> a > 2.2.  At bs 1 a batch is never synced."""
    table = CostTable({9: {1: 8.0, 16: 8.0}}, {1: 5.0, 16: 5.0})
    p = BudgetPolicy(table, hysteresis=0.0, ema=0.0)
    p.update([[0.9]], widths=[9])                       # 3.8 tokens/ms against 3.2
    assert p.margin(16) == pytest.approx(0.09375) and p.choose(16) == 9
    p.synced_left = 256.0
    assert p.margin(16) == pytest.approx(450 / 1280) and p.choose(16) == NO_SPEC
    assert p.margin(1) == 0.0 and p.choose(1) == 9
    p.synced_left = 1024.0
    assert p.margin(16) == pytest.approx(0.09375) and p.choose(16) == 9
    p.update([[1.2]], widths=[9])                       # 4.4 tokens/ms
    p.synced_left = 256.0
    assert p.choose(16) == 9
    p.synced_left = 10.0
    assert p.margin(16) == pytest.approx(1.0) and p.choose(16) == NO_SPEC
    p.synced_left = None
    assert p.choose(16) == 9
    with pytest.raises(ValueError):
        BudgetPolicy(table, sync_admission_ms=-1.0)


def test_synced_tokens_left_counts_the_waves_plain_decoding_would_finish_in():
    """Synced: at most max(1, bs // 4) distinct numbers of tokens left, every request with a limit;
    then the mean tokens left, else None."""
    from types import SimpleNamespace as NS
    from sglang_ddtree.policy.adaptive import synced_tokens_left as left_of

    def reqs(lefts, limit=256):
        return [NS(sampling_params=NS(max_new_tokens=limit), output_ids=[0] * (limit - x)) for x in lefts]

    assert left_of(None) is None and left_of(reqs([10])) is None
    assert left_of(reqs([10, 10])) == 10
    assert left_of(reqs([200] * 15 + [198])) == pytest.approx(199.875)   # a burst admitted 15 + 1
    assert left_of(reqs([200] * 12 + [196] * 4)) == 199
    assert left_of(reqs([200] * 4 + [190] * 4 + [180] * 4 + [170] * 4)) == 185   # 4 waves of 16: bs // 4
    assert left_of(reqs(list(range(100, 116)))) is None        # every request on its own
    assert left_of(reqs([200] * 10 + [1, 2, 3, 4, 5, 6])) is None
    assert left_of(reqs([5, 5]) + [NS(sampling_params=NS(max_new_tokens=None), output_ids=[])]) is None
