"""The adaptive policy with the tree's own acceptance estimate (issue 39 item 3), on the CPU with
synthetic windows: ``BudgetPolicy.update_window(..., pred=)`` calibrates the predictions against the
exact counts on the same request-rounds and reads every width as ratio x recent prediction.

The windows are built from a hidden truth: per width a true calibration ratio ``R[w]`` and a
workload whose predicted acceptance per request-round is ``P[w]``; the exact count on a measured
request-round is then ``R[w] * P[w]``.  A policy that does what the design says recovers ``R`` and
follows a change of ``P`` within a window or two, where the counts alone take many windows."""
import pytest

from sglang_ddtree.policy.budget_policy import NO_SPEC, BudgetPolicy, CostTable

WIDTHS = (8, 16, 32)
R = {8: 0.55, 16: 0.7, 32: 0.8}                  # exact / predicted, per width (the truth)
P_TEXT = {8: 3.0, 16: 4.0, 32: 4.6}              # predicted accepted tokens per request-round
P_RANDOM = {8: 0.4, 16: 0.5, 32: 0.55}           # a workload the drafter is unsure about


def table(base=5.0):
    return CostTable(verify_ms={8: {16: 8.0}, 16: {16: 10.0}, 32: {16: 16.0}}, base_ms={16: base},
                     draft_ms={16: 1.5})


def window(P, measured=WIDTHS, n=64, with_pred=True, ratio=R):
    """One window of ``n`` request-rounds whose trees held the widths ``measured`` (one age bucket)."""
    sums = [{w: ratio[w] * P[w] * n for w in measured}]
    counts = [{w: float(n) for w in measured}]
    below = [{w: (ratio[v] * P[v] * n if v in measured else 0.0) for w, v in zip(WIDTHS[1:], WIDTHS)
              if w in measured}]
    pred = None
    if with_pred:
        pred = dict(all=[{w: P[w] * n for w in WIDTHS}], n=[{w: float(n) for w in WIDTHS}],
                    on=[{w: P[w] * n for w in measured}], exact=[dict(sums[0])],
                    on_n=[{w: float(n) for w in measured}])
    return sums, counts, below, pred


def feed(pol, P, k, **kw):
    for _ in range(k):
        s, c, b, p = window(P, **kw)
        pol.update_window(s, c, b, pred=p)


def test_calibrated_prediction_recovers_the_true_acceptance_of_every_width():
    pol = BudgetPolicy(table())
    feed(pol, P_TEXT, 40)
    for w in WIDTHS:
        assert pol.ratio[w] == pytest.approx(R[w], rel=0.02)
        assert pol.accept[w] == pytest.approx(R[w] * P_TEXT[w], rel=0.02)


def test_a_change_of_workload_shows_within_two_windows_where_the_counts_alone_lag():
    with_pred, counts_only = BudgetPolicy(table()), BudgetPolicy(table())
    for _ in range(40):
        s, c, b, p = window(P_TEXT)
        with_pred.update_window(s, c, b, pred=p)
        counts_only.update_window(s, c, b)
    for _ in range(2):                                    # the workload switches
        s, c, b, p = window(P_RANDOM)
        with_pred.update_window(s, c, b, pred=p)
        counts_only.update_window(s, c, b)
    for w in WIDTHS:
        old, new = R[w] * P_TEXT[w], R[w] * P_RANDOM[w]
        moved = lambda x: (old - x) / (old - new)
        assert moved(with_pred.accept[w]) > 0.7, (w, with_pred.accept[w])
        assert moved(counts_only.accept[w]) < 0.35, (w, counts_only.accept[w])


def test_the_choice_drops_to_plain_decoding_two_windows_after_the_workload_turns():
    """Text: width 16 wins (16 x 3.8 tokens in 10 ms against 16 in 5 ms plain).  Random ids: every tree
    width accepts < 0.5, so plain decoding wins; the policy answers NO_SPEC after two windows."""
    pol = BudgetPolicy(table(), hysteresis=0.0)
    feed(pol, P_TEXT, 20)
    assert pol.choose(16) == 16
    feed(pol, P_RANDOM, 2)
    assert pol.choose(16) == NO_SPEC


def test_an_unmeasured_width_reads_its_narrower_neighbours_ratio_and_stays_monotone():
    """Only widths 8 and 16 ever measured (no probe of 32): width 32's ratio is width 16's, its
    estimate that ratio times its own prediction, never below width 16's and never above 31."""
    pol = BudgetPolicy(table())
    feed(pol, P_TEXT, 30, measured=(8, 16))
    assert pol.ratio[32] == pytest.approx(pol.ratio[16])
    assert pol.accept[32] == pytest.approx(pol.ratio[16] * P_TEXT[32], rel=0.02)
    skewed = {8: 1.0, 16: 1.0, 32: 1.0}
    ratio = {8: 0.9, 16: 0.5, 32: 0.5}                   # width 16 calibrates far below width 8
    pol = BudgetPolicy(table())
    feed(pol, skewed, 30, ratio=ratio)
    assert pol.accept[16] >= pol.accept[8] and pol.accept[32] >= pol.accept[16]
    huge = {8: 50.0, 16: 60.0, 32: 70.0}
    pol = BudgetPolicy(table())
    feed(pol, huge, 5, ratio={w: 1.0 for w in WIDTHS})
    assert pol.accept[8] <= 7.0 and pol.accept[16] <= 15.0 and pol.accept[32] <= 31.0


def test_draft_only_windows_move_the_estimate_without_counting_as_measured_rounds():
    """A no-speculation stretch: windows with predictions (draft-only probes) and no counts.  The
    estimate follows the predictions at the calibration learnt before; ``rounds_seen`` (windows with
    counts) does not move."""
    pol = BudgetPolicy(table())
    feed(pol, P_RANDOM, 20)
    seen = pol.rounds_seen
    empty = [{}]
    for _ in range(3):
        _, _, _, p = window(P_TEXT, measured=())
        pol.update_window(empty, empty, empty, pred=p)
    assert pol.rounds_seen == seen
    for w in WIDTHS:
        assert pol.accept[w] == pytest.approx(R[w] * P_TEXT[w], rel=0.15)


def test_prediction_per_age_bucket_weighs_the_batch_it_chooses_for():
    """Two age buckets: young requests predicted low, old ones high (same ratio).  A batch of young
    requests reads the low estimate, a batch of old ones the high one."""
    pol = BudgetPolicy(table(), age_edges=(16,))
    lo, hi = {w: 0.5 for w in WIDTHS}, {8: 3.0, 16: 4.0, 32: 5.0}
    for _ in range(20):
        n = 32.0
        sums = [{w: R[w] * lo[w] * n for w in WIDTHS}, {w: R[w] * hi[w] * n for w in WIDTHS}]
        counts = [{w: n for w in WIDTHS}] * 2
        pred = dict(all=[{w: lo[w] * n for w in WIDTHS}, {w: hi[w] * n for w in WIDTHS}],
                    n=[{w: n for w in WIDTHS}] * 2, on=[{w: lo[w] * n for w in WIDTHS}, {w: hi[w] * n for w in WIDTHS}],
                    exact=[dict(x) for x in sums], on_n=[{w: n for w in WIDTHS}] * 2)
        pol.update_window(sums, counts, None, pred=pred)
    young, old = pol.mix_accept([3] * 8), pol.mix_accept([100] * 8)
    for w in WIDTHS:   # each within 10 % of the gap from its own bucket's truth (the shrink pulls a little)
        gap = R[w] * (hi[w] - lo[w])
        assert abs(young[w] - R[w] * lo[w]) < 0.1 * gap and abs(old[w] - R[w] * hi[w]) < 0.1 * gap


def test_bad_predictions_are_refused():
    pol = BudgetPolicy(table())
    s, c, b, p = window(P_TEXT)
    p["all"][0][8] = -1.0
    with pytest.raises(ValueError, match="must be >= 0"):
        pol.update_window(s, c, b, pred=p)
    s, c, b, p = window(P_TEXT)
    p["n"] = p["n"] * 2
    with pytest.raises(ValueError, match="one entry per age bucket"):
        pol.update_window(s, c, b, pred=p)
    with pytest.raises(ValueError, match="pred_ema"):
        BudgetPolicy(table(), pred_ema=1.0)
    with pytest.raises(ValueError, match="draft_ms"):
        CostTable(verify_ms={8: {1: 1.0}}, base_ms={1: 1.0}, draft_ms={1: 0.0})


def test_past_the_tree_widths_graphs_only_plain_decoding_is_a_choice():
    """Tree widths are timed (captured) up to bs 64, plain decoding up to 256: at bs 100 a tree round
    would run eagerly and the table, clamped at 64, would price it as a bs-64 graph; the policy then
    runs plain decoding however well the trees accept, and the controller neither starts wide nor
    probes there.  Within the graphs the choice is unchanged."""
    from sglang_ddtree.policy import adaptive as A
    from sglang_ddtree.policy import adaptive_config as AC

    t = CostTable(verify_ms={8: {1: 5.0, 64: 9.0}, 16: {1: 6.0, 64: 12.0}}, base_ms={1: 4.0, 64: 7.0, 256: 12.0},
                  draft_ms={1: 1.0, 64: 2.0})
    pol = BudgetPolicy(t, hysteresis=0.0)
    pol.accept.update({8: 4.0, 16: 6.0})
    assert pol.candidates(64) == [NO_SPEC, 8, 16] and pol.choose(64) == 16
    assert pol.candidates(100) == [NO_SPEC] and pol.choose(100) == NO_SPEC
    assert t.draft_cost(100) is None and t.draft_cost(64) == pytest.approx(2.0)
    strict = BudgetPolicy(t, allow_no_spec=False)       # no plain option: the widths stay (eager)
    assert strict.candidates(100) == [8, 16]
    cfg = AC.parse_config({"SGLANG_DDTREE_BUDGETS": "0,7,15"}, budget=15, algo="DDTREE-GPU")
    ctl = A.WidthController(cfg, policy=BudgetPolicy(t), device="cpu")
    assert ctl._first_width(100) == 1 and ctl._first_width(8) == 16
    ctl.probe_credit = ctl.draft_credit = 1e9
    ctl._since_probe = 10 ** 6
    assert ctl._probe_or(100, 1) == 1 and ctl.probes == 0 and ctl.draft_probes == 0 and not ctl.predict
    ctl.draft_credit, ctl._since_probe = 1e9, 10 ** 6
    assert ctl._probe_or(64, 1) == 1 and ctl.draft_probes == 1 and ctl.predict


def test_the_calibration_is_kept_per_age_bucket():
    """Young requests' predictions overshoot (ratio 0.5), old ones' undershoot (ratio 1.3), at the same
    predicted level (as measured on the chain pair: bench/results/accept_calibration_cpu.md): each
    bucket's estimate is its own ratio times its prediction, not the pooled ratio's."""
    pol = BudgetPolicy(table(), age_edges=(16,))
    P = {8: 2.0, 16: 3.0, 32: 3.5}
    young_r, old_r = 0.5, 1.3
    for _ in range(30):
        n = 32.0
        sums = [{w: young_r * P[w] * n for w in WIDTHS}, {w: old_r * P[w] * n for w in WIDTHS}]
        counts = [{w: n for w in WIDTHS}] * 2
        pred = dict(all=[{w: P[w] * n for w in WIDTHS}] * 2, n=[{w: n for w in WIDTHS}] * 2,
                    on=[{w: P[w] * n for w in WIDTHS}] * 2, exact=[dict(x) for x in sums],
                    on_n=[{w: n for w in WIDTHS}] * 2)
        pol.update_window(sums, counts, None, pred=pred)
    young, old = pol.mix_accept([3] * 4), pol.mix_accept([100] * 4)
    for w in WIDTHS:
        assert young[w] == pytest.approx(young_r * P[w], rel=0.05)
        assert old[w] == pytest.approx(old_r * P[w], rel=0.05)
        assert pol.ratio[w] == pytest.approx((young_r + old_r) / 2, rel=0.05)   # pooled: the mix
