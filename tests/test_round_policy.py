"""The round's policy through its two calls (issue 52 item 3): ``RoundPolicy.plan`` before a round,
``RoundPolicy.observe`` after it, on fake rounds (a chain tree whose accepted depth the test sets, a
fake clock).  Each test has a control run in which its assertion must not hold."""
import types

import torch

from sglang_ddtree import ddtree
from sglang_ddtree.policy import (NO_SPEC, BatchView, RoundEstimate, RoundOutcome, RoundPlan, RoundPolicy,
                                  accept_estimate)
from sglang_ddtree.policy import adaptive as A
from sglang_ddtree.policy import adaptive_config as AC
from sglang_ddtree.policy.budget_policy import BudgetPolicy, CostTable

from helpers import Clock, drafter_logits, logprobs_from_logits

D = 6      # drafter depth: a path holds the root + up to D nodes
BS = 4


def _policy(clock, *, draft_ms=None):
    """Widths 1 (plain), 4, 16 at bs 4: plain 4 ms, width 4 5 ms, width 16 6 ms a round."""
    cfg = AC.parse_config({AC.ENV_BUDGETS: "0,3,15"}, budget=15, algo="DDTREE-GPU")
    table = CostTable(verify_ms={4: {BS: 5.0}, 16: {BS: 6.0}}, base_ms={BS: 4.0},
                      draft_ms=None if draft_ms is None else {BS: draft_ms})
    pol = RoundPolicy(16)
    pol.start(A.WidthController(cfg, policy=BudgetPolicy(table, allow_no_spec=True), device="cpu",
                                window_every=2, window_lag=1, clock=clock))
    return pol


def _chain_outcome(plan, accepted):
    """A round at ``plan.width`` over a chain tree (slot i at depth i) whose first ``accepted`` nodes
    the target accepted (capped by the tree)."""
    w = plan.width
    a = min(accepted, w - 1, D)
    path = torch.full((BS, D + 1), -1, dtype=torch.int64)
    path[:, :a + 1] = torch.arange(a + 1)
    depth = torch.arange(w, dtype=torch.int32).clamp(max=D).expand(BS, w)
    return RoundOutcome(width=w, path=path, accept_len=torch.full((BS,), a), tree_depth=depth,
                        prefix=torch.full((BS,), 100), reqs=None, estimate=None)


def _run(accepted, rounds=80):
    """``rounds`` rounds through plan / observe, each taking its table cost on the clock; the widths
    chosen in the last quarter."""
    clock = Clock()
    pol = _policy(clock)
    cost = {1: 4.0, 4: 5.0, 16: 6.0}
    widths = []
    for _ in range(rounds):
        plan = pol.plan(BatchView(bs=BS, reqs=[]))
        assert plan.drafts == (plan.width > NO_SPEC or plan.predict)
        widths.append(plan.width)
        clock.ms += cost[plan.width]
        pol.observe(_chain_outcome(plan, accepted))
    return widths[-rounds // 4:]


def test_observed_acceptance_moves_the_plan_to_another_width():
    """Full chains accepted: the widest tree serves 7 tokens in 6 ms against plain decoding's 1 in
    4, so the plan settles on width 16.  Control: nothing ever accepted, the same policy and costs:
    it must leave the trees for plain decoding (a width-16 plan there would fail the first
    assertion's converse)."""
    good = _run(accepted=D)
    bad = _run(accepted=0)
    assert set(good) == {16}
    assert set(bad) == {NO_SPEC}                  # the control: same start (width 16), other outcome


def test_without_observe_the_plan_does_not_move():
    """The plan moves because of what ``observe`` reports: with the outcomes withheld (the window
    never fills) the controller keeps its first width, the widest whose cost is <= 2x the narrowest
    tree's.  Control: the same rounds observed with zero acceptance end on plain decoding."""
    clock = Clock()
    pol = _policy(clock)
    widths = []
    for _ in range(40):
        plan = pol.plan(BatchView(bs=BS, reqs=[]))
        widths.append(plan.width)
        clock.ms += 6.0
    assert set(widths) == {16}
    assert set(_run(accepted=0, rounds=40)) == {NO_SPEC}


def test_a_fixed_budget_plans_its_width_and_observes_nothing():
    """No controller (``SGLANG_DDTREE_ADAPTIVE=0``): every plan is the server's width, never a probe,
    and without statistics ``observe`` reads no tensor of the outcome (here: tensors on the meta
    device, which any count would fail on).  Control: with statistics on, the same outcome is
    counted (the fake statistics' record sees it)."""
    pol = RoundPolicy(8)
    plans = [pol.plan(BatchView(bs=BS, reqs=[])) for _ in range(5)]
    assert all(p == RoundPlan(width=8) for p in plans) and all(p.drafts and not p.estimates for p in plans)
    meta = torch.empty((BS, D + 1), dtype=torch.int64, device="meta")
    out = RoundOutcome(width=8, path=meta, accept_len=meta[:, 0], tree_depth=meta, prefix=meta[:, 0])
    pol.observe(out)                                                         # nothing to count

    seen = []
    stats = types.SimpleNamespace(budgets=[3, 7], predicted_widths=lambda w: [b + 1 for b in (3, 7) if b < w],
                                  record=lambda path, accept_len, **kw: seen.append(kw))
    pol.report_to(stats=stats)
    plan = pol.plan(BatchView(bs=BS, reqs=[]))
    assert plan.stats_widths == (4, 8) and plan.estimates
    path = torch.tensor([[0, 1, 2, 3, -1, -1, -1]] * BS)
    pol.observe(RoundOutcome(width=8, path=path, accept_len=torch.full((BS,), 3),
                             tree_depth=torch.zeros(BS, 8, dtype=torch.int32), prefix=torch.zeros(BS)))
    assert len(seen) == 1 and seen[0]["cf"].shape == (BS, 2) and seen[0]["cf"].tolist() == [[3, 3]] * BS


def _draft(rng, bs=2, k=8):
    return logprobs_from_logits(drafter_logits(bs, D, 300, rng), k=k)


def test_a_prediction_reads_every_width_off_the_widest_tree(rng):
    """A prediction plan on a narrow round: ``plan.estimate`` hands the controller every width's
    expected acceptance from the widest tree of the same draft, which for each width equals what a
    round of that width would read off its own tree (prefix-closed trees).  Control: read off the
    round's own (narrow) tree, the wider widths cannot be estimated at all (ValueError), so the
    estimate did use the wider tree."""
    lp, ids = _draft(rng)
    roots = torch.tensor([5, 9])

    def build(width):
        return ddtree.build_tree(lp, ids, width - 1, root_tokens=roots, backend="reference")

    plan = RoundPlan(width=4, predict=True, predict_from=16, controller_widths=(4, 8, 16), stats_widths=(4,))
    built = []
    est = plan.estimate(build(4), lp, ids, lambda w: built.append(w) or build(w))
    assert built == [16] and est.for_controller.shape == (2, 3) and est.for_stats.shape == (2, 1)
    for j, w in enumerate((4, 8, 16)):
        own = accept_estimate.expected_accept(build(w), lp, ids, [w])[:, 0]
        assert torch.allclose(est.for_controller[:, j], own, rtol=1e-5, atol=1e-6)
    assert torch.equal(est.for_stats[:, 0], est.for_controller[:, 0])
    try:                                          # the control
        accept_estimate.expected_accept(build(4), lp, ids, [4, 8, 16])
        raise AssertionError("a width-4 tree estimated width 16")
    except ValueError:
        pass
    # a round at the widest width builds nothing more
    plan16 = RoundPlan(width=16, predict=True, predict_from=16, controller_widths=(4, 8, 16))
    assert plan16.estimate(build(16), lp, ids, lambda w: built.append(w)).for_stats is None and built == [16]


def test_draft_only_probes_come_from_the_plan_in_a_plain_stretch():
    """With a drafter row in the cost table and nothing accepted, the plan settles on plain decoding
    and some of its plain rounds are draft-only probes (``width == NO_SPEC``, ``predict``, so
    ``drafts``); their estimate, reported through ``observe``, is what the controller's window
    receives.  Control: without a drafter row no plain plan ever drafts."""
    def plain_plans(draft_ms):
        clock = Clock()
        pol = _policy(clock, draft_ms=draft_ms)
        got = []
        for _ in range(600):
            plan = pol.plan(BatchView(bs=BS, reqs=[]))
            clock.ms += {1: 4.0, 4: 5.0, 16: 6.0}[plan.width]
            out = _chain_outcome(plan, 0)
            if plan.predict:
                out = RoundOutcome(**{**out.__dict__, "estimate": RoundEstimate(
                    for_controller=torch.zeros(BS, len(plan.controller_widths)))})
            pol.observe(out)
            if plan.width == NO_SPEC:
                got.append(plan)
        return got

    with_draft = plain_plans(draft_ms=1.0)
    assert with_draft and any(p.predict and p.drafts for p in with_draft)
    assert all(p.predict_from == 16 and p.controller_widths == (4, 16) for p in with_draft if p.predict)
    without = plain_plans(draft_ms=None)
    assert without and not any(p.drafts for p in without)       # the control
