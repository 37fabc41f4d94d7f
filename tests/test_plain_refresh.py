"""Plain decoding's cost stays measured while trees run (issue 52, the frozen plain estimate):
``WidthController`` (plain probes, cold and aged samples) with ``BudgetPolicy`` and the real window,
driven round by round as in ``tests/test_policy_simulation.py`` on the code pair's shape.

The H100 served A/B of the code pair (``bench/results/raw/codepair_default_h100_profile_ddtree.jsonl.gz``):
plain decoding's samples of the server's first ~30 rounds read 7.4 ms over its table cost, the tree
widths' later ones 3.5-4.2 ms, and with nothing re-measuring plain decoding the policy ran trees in
99 % of the rounds at 0.71x / 0.46x plain decoding's throughput.  The simulated server here: that
start-up cost table, rounds that cost the table + a fixed host time (cold: more in the server's first
rounds), and a drafter accepting ~1.5 tokens per round at widths 32 / 61 (~2.5 tokens a round)."""
import pytest

from test_policy_simulation import BUDGETS, Server
from sglang_ddtree.policy import adaptive as A
from sglang_ddtree.policy import adaptive_config as AC
from sglang_ddtree.policy.budget_policy import BudgetPolicy, CostTable

# the code pair's start-up table on the H100 (``raw/codepair_default_h100_server_ddtree.log.gz``), bs 1 and 16
CODE_COST = CostTable(
    verify_ms={8: {1: 0.728, 16: 0.866}, 16: {1: 0.744, 16: 0.970}, 32: {1: 0.750, 16: 1.067},
               61: {1: 0.765, 16: 1.312}},
    base_ms={1: 0.431, 16: 0.455})
CODE = {7: 1.3, 15: 1.8, 31: 2.15, 60: 2.4}   # predicted; x the hidden calibration: ~1.0-1.6 accepted
TREE_HOST = 3.2      # a tree round: its table cost + this (3.9-4.5 ms a round)
COLD_ROUNDS = 40     # the server's first rounds cost more (first requests, JIT, allocations) ...
COLD = (6.5, 3.0)    # ... this much for a plain round (7.4 ms over the table: the profile's), a tree round


def drive(rounds, bs, plain_host, seed=0, tweak=None, **ctl_kw):
    """``rounds`` rounds of ``bs`` requests at ~0.2k KV tokens each; a plain round costs the table +
    ``plain_host`` ms (+ ``COLD[0]`` in the first ``COLD_ROUNDS``).  ``tweak(ctl)`` before the first
    round.  -> (widths run, tok/ms over rounds 400.., {choice: tok/ms of that fixed choice on the same
    draws, warm}, controller)."""
    cfg = AC.parse_config({}, budget=60, algo="DDTREE-GPU")
    now = [0.0]
    pol = BudgetPolicy(CODE_COST, allow_no_spec=True, age_edges=cfg.age_edges)
    ctl = A.WidthController(cfg, policy=pol, device="cpu", clock=lambda: now[0] / 1e3, **ctl_kw)
    if tweak:
        tweak(ctl)
    srv = Server(seed)
    host = {1: plain_host}
    ws, toks, ms = [], 0.0, 0.0
    widths = [1] + [b + 1 for b in BUDGETS]
    fixed = {w: [0.0, 0.0] for w in widths}
    for r in range(rounds):
        w = ctl.next_width(bs, kv_tokens=200 * bs)
        path, pred, counts = srv.round(bs, CODE)
        ctl.record(path, w, predicted=pred if ctl.predict else None)
        per_budget = (counts + 1).sum(0).tolist()

        def cost(x, cold):
            return CODE_COST.cost(bs, x) + host.get(x, TREE_HOST) + (COLD[x > 1] if cold else 0.0)

        def got(x):
            return bs if x == 1 else per_budget[BUDGETS.index(x - 1)]

        now[0] += cost(w, r < COLD_ROUNDS)
        ws.append(w)
        if r >= 400:
            toks += got(w)
            ms += cost(w, False)
            for x in widths:
                fixed[x][0] += got(x)
                fixed[x][1] += cost(x, False)
    return ws, toks / ms, {x: t / m for x, (t, m) in fixed.items()}, ctl


def _no_ageing(ctl):
    ctl.WARM_ROUNDS, ctl.FRESH_ROUNDS = 0, 10 ** 9


@pytest.mark.parametrize("bs", [1, 16])
def test_a_cold_plain_estimate_is_re_measured_and_plain_decoding_taken(bs):
    """Plain decoding truly 1.3 ms a round (SGLang's step on the code pair: ~1.2-1.3 ms), ~1.2-1.3x
    the trees' tokens per ms, but its first samples read 7.8 ms (the profile's 7.4 over the table).
    The controller runs plain decoding within 300 rounds and in >= 90 % of the rounds after 400,
    serving >= 0.95x fixed plain decoding there; the profile record says what happened.  Controls:
    without plain probes (``plain_probe_share = 0``), or with cold samples counted as fresh (no
    warm-up, no ageing: the 8 cold samples are a valid estimate, never probed), it stays on trees."""
    ws, got, fixed, ctl = drive(2000, bs, plain_host=0.87)
    assert fixed[1] >= 1.15 * max(v for x, v in fixed.items() if x > 1), fixed     # plain truly wins
    first = next(i for i in range(len(ws)) if ws[i:i + 16] == [1] * 16)
    assert first <= 300, (first, ctl.plain_probes)
    late = ws[400:]
    assert late.count(1) >= 0.9 * len(late), (late.count(1), ctl.chosen)
    assert got >= 0.95 * fixed[1], (got / fixed[1], ctl.chosen)
    snap = ctl.snapshot()
    assert 4 <= snap["plain_probes"] == ctl.plain_probes <= 12, snap
    assert snap["plain_age"] <= 2 and snap["plain_fresh"] >= 4, snap
    for kw in (dict(plain_probe_share=0.0), dict(tweak=_no_ageing)):
        ws, got, fixed, ctl = drive(2000, bs, plain_host=0.87, **kw)
        late = ws[400:]
        assert late.count(1) < 0.1 * len(late) and got < 0.9 * fixed[1], (kw, late.count(1), got / fixed[1])
        snap = ctl.snapshot()
        assert snap["plain_probes"] == 0 and snap["plain_age"] >= 1900, snap


@pytest.mark.parametrize("bs", [1, 16])
def test_b_where_trees_win_plain_probes_stay_under_half_a_percent(bs):
    """Plain decoding truly 2.5 ms a round (the spec path's plain round in the profile's first
    rounds: 2.48 ms of GPU time), so trees win (~1.6x at bs 1), with the same cold start.  Over 4000
    rounds the plain probes (re-measuring it every FRESH_ROUNDS) are at most 0.5 % of the rounds,
    the controller runs no other plain round after the warm-up, and it serves >= 0.99x the
    controller without plain probes on the same draws.  Control: an estimate that goes stale after 8
    rounds (``FRESH_ROUNDS = 8``) is probed at the credit's 4 % and breaks the 0.5 % bound."""
    rounds = 4000
    ws, got, fixed, ctl = drive(rounds, bs, plain_host=2.07)
    best = max(fixed, key=fixed.get)
    assert best > 1 and fixed[best] >= 1.1 * fixed[1], fixed
    assert 4 <= ctl.plain_probes <= 0.005 * rounds, (ctl.plain_probes, ctl.chosen)
    assert ws[ctl.WARM_ROUNDS:].count(1) == ctl.plain_probes, ctl.chosen   # no other plain round after warm-up
    _, base, _, off = drive(rounds, bs, plain_host=2.07, plain_probe_share=0.0)
    assert off.plain_probes == 0 and got >= 0.99 * base, (got / base)

    def often(c):
        c.FRESH_ROUNDS = 8

    _, _, _, ctl = drive(rounds, bs, plain_host=2.07, tweak=often)
    assert ctl.plain_probes > 0.005 * rounds, ctl.plain_probes


def test_staleness_is_rank_0s_count_shared_at_windows():
    """TP ranks must choose alike: a rank probes on rank 0's count of fresh plain samples (handed by
    ``share`` with the window's figures), not on its own.  Here rank 0 reports a fresh estimate while
    this rank's own samples are cold: no plain probe; the same rank with its own count probes."""
    _, _, _, ctl = drive(600, 1, plain_host=0.87, share=lambda d: dict(d, plain_fresh=8.0))
    assert ctl.plain_probes == 0 and ctl.snapshot()["plain_fresh"] == 0
    _, _, _, ctl = drive(600, 1, plain_host=0.87, share=lambda d: dict(d))
    assert ctl.plain_probes >= 4
