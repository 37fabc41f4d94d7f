"""sglang_ddtree.policy.adaptive_config.parse_config: the adaptive budget is the default (a budget set derived from
the server's budget, and no speculation), SGLANG_DDTREE_ADAPTIVE=0 is the fixed budget, and every bad
value is a one-line ValueError at start-up (issues 17 item 3, 39 item 1)."""
import types

import pytest

from sglang_ddtree.policy import adaptive as A
from sglang_ddtree.policy import adaptive_config as AC
from sglang_ddtree import switches as S


def _parse(budget=31, cycle=None, probe=16, **env):
    """parse_config of these variables; ``cycle`` / ``probe``: the test-bed switches budget_cycle /
    probe_every (switches.py)."""
    return AC.parse_config({k: v for k, v in env.items()}, budget=budget, algo="DDTREE-GPU",
                          sw=S.Switches(budget_cycle=cycle, probe_every=probe))


def test_unset_is_the_default_set_with_no_speculation():
    for env in ({}, dict(SGLANG_DDTREE_BUDGETS=""), dict(SGLANG_DDTREE_BUDGETS="  "),
                dict(SGLANG_DDTREE_ADAPTIVE="1")):
        c = _parse(**env)
        assert c.budgets == (7, 15, 31) and c.no_spec and c.implicit and c.cycle is None, env
        assert c.widths == (1, 8, 16, 32) and c.extra_widths == (1, 8, 16)
    # the set follows the server's budget: block-16 drafters default to 60, block 8 to 28
    assert _parse(budget=60).budgets == (7, 15, 31, 60) and _parse(budget=28).budgets == (7, 15, 28)
    assert _parse(budget=7).budgets == (7,) and _parse(budget=3).widths == (1, 4)
    assert _parse(budget=32).budgets == (7, 15, 32) and _parse(budget=47).budgets == (7, 15, 31, 47)
    assert _parse(budget=100).widths[-1] == 101                   # the widest is the server's


def test_the_fixed_budget_switch():
    assert _parse(SGLANG_DDTREE_ADAPTIVE="0") is None
    assert _parse(SGLANG_DDTREE_ADAPTIVE=" 0 ", probe=4) is None
    assert _parse(SGLANG_DDTREE_BUDGETS="31") is None              # one budget, nothing else: fixed
    c = _parse(SGLANG_DDTREE_BUDGETS="0,31")                     # the server's budget or no speculation
    assert c.widths == (1, 32) and not c.implicit


def test_budgets_widths_and_options():
    """0 in SGLANG_DDTREE_BUDGETS is no speculation (in any position); without it no round skips
    speculation."""
    c = _parse(SGLANG_DDTREE_BUDGETS="15, 7,0,31")
    assert c.budgets == (7, 15, 31) and c.no_spec and not c.implicit and c.cycle is None
    c = _parse(SGLANG_DDTREE_BUDGETS="15, 7,31")
    assert c.budgets == (7, 15, 31) and not c.no_spec and c.cycle is None
    assert c.widths == (8, 16, 32) and c.widest == 32 and c.extra_widths == (8, 16)
    assert c.probe_every == AC.DEFAULT_PROBE_EVERY == 16
    c = _parse(SGLANG_DDTREE_BUDGETS="0,7,31", probe=3)
    assert c.widths == (1, 8, 32) and c.extra_widths == (1, 8) and c.probe_every == 3
    c = _parse(SGLANG_DDTREE_BUDGETS="0,7,15,31")                 # the default set, said explicitly
    assert c.budgets == (7, 15, 31) and c.widths == (1, 8, 16, 32) and not c.implicit
    c = _parse(SGLANG_DDTREE_BUDGETS="0,7,31", cycle=(31, 0, 7))
    assert c.cycle == (31, 0, 7)
    c = _parse(cycle=(31,))                                       # over the default set
    assert c.budgets == (7, 15, 31) and c.cycle == (31,) and not c.implicit


@pytest.mark.parametrize("env, words", [
    (dict(SGLANG_DDTREE_BUDGETS="7,x,31"), "comma-separated list of integers"),
    (dict(SGLANG_DDTREE_BUDGETS="7,,31"), "comma-separated list of integers"),
    (dict(SGLANG_DDTREE_BUDGETS="7.5,31"), "comma-separated list of integers"),
    (dict(SGLANG_DDTREE_BUDGETS="0"), "names no tree budget"),
    (dict(SGLANG_DDTREE_BUDGETS="-3,31"), "must be 0 (no speculation) or in [1, 256], got -3"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31,300"), "got 300"),
    (dict(SGLANG_DDTREE_BUDGETS="7,7,31"), "lists a budget twice"),
    (dict(SGLANG_DDTREE_BUDGETS="0,0,31"), "lists a budget twice"),
    (dict(SGLANG_DDTREE_BUDGETS="7,15"), "--speculative-num-draft-tokens 16"),
    (dict(SGLANG_DDTREE_BUDGETS="7,63"), "widest budget 63 must be the server's tree budget 31"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31", cycle=(7, 15)), "15 is not one of"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31", cycle=(0, 7)), "0 needs 0 in SGLANG_DDTREE_BUDGETS"),
    (dict(SGLANG_DDTREE_ADAPTIVE="0", cycle=(0,)), "contradicts switch budget_cycle"),
    (dict(SGLANG_DDTREE_ADAPTIVE="no"), "SGLANG_DDTREE_ADAPTIVE must be 0 or 1"),
    (dict(SGLANG_DDTREE_ADAPTIVE="0", SGLANG_DDTREE_BUDGETS="0,7,31"), "contradicts SGLANG_DDTREE_BUDGETS"),
])
def test_bad_values_are_one_line_errors(env, words):
    with pytest.raises(ValueError) as e:
        _parse(**env)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.startswith("DDTREE-GPU: ")



def _cp(v):
    return {AC.REQUEST_BUDGET_KEY: v, "__req__": object()}


def test_a_request_may_pin_a_budget_the_server_runs(monkeypatch):
    cfg = AC.parse_config({"SGLANG_DDTREE_BUDGETS": "0,7,15,31"}, budget=31, algo="DDTREE-GPU")
    served = ("DDTREE-GPU", 31, cfg)
    assert AC.allowed_request_budgets(31, cfg) == [0, 7, 15, 31]
    for v in (0, 7, 15, 31):
        assert AC.request_budget_error(_cp(v), served) is None
    assert AC.request_budget_error(None, served) is None
    assert AC.request_budget_error({"other": 3}, served) is None
    for bad, words in ((8, "allowed [0, 7, 15, 31]"), (-1, "not a budget"), (True, "integer"),
                       (15.0, "integer"), ("15", "integer"), (None, "integer")):
        msg = AC.request_budget_error(_cp(bad), served)
        assert msg and words in msg and "\n" not in msg, (bad, msg)
    # no speculation only where the server allows it; a fixed budget only equals itself
    no_ns = AC.parse_config({"SGLANG_DDTREE_BUDGETS": "7,15"}, budget=15, algo="DDTREE-GPU")
    assert "allowed [7, 15]" in AC.request_budget_error(_cp(0), ("DDTREE-GPU", 15, no_ns))
    assert AC.request_budget_error(_cp(15), ("DDTREE-GPU", 15, None)) is None
    assert "fixed budget" in AC.request_budget_error(_cp(7), ("DDTREE-GPU", 15, None))
    # nothing registered in this process (not a DDTREE worker): no check; registered: the worker's
    monkeypatch.setattr(AC, "_SERVED", None)
    assert AC.request_budget_error(_cp(8)) is None
    AC.register_served("DDTREE-GPU", 31, cfg)
    assert "allowed" in AC.request_budget_error(_cp(8)) and AC.request_budget_error(_cp(7)) is None


def test_requested_width_is_the_narrowest_pin():
    def reqs(*cps):
        return [types.SimpleNamespace(sampling_params=types.SimpleNamespace(custom_params=c)) for c in cps]
    assert AC.requested_width(reqs(None, {}, {"x": 1})) is None
    assert AC.requested_width(reqs(None, _cp(15), _cp(31))) == 16
    assert AC.requested_width(reqs(_cp(7), _cp(0))) == 1
    ctl = A.WidthController(AC.parse_config({"SGLANG_DDTREE_BUDGETS": "7,15"}, budget=15, algo="g"),
                            policy=None, device="cpu")
    assert [ctl.next_width(4, r) for r in (8, 16, None, 1, 12)] == [8, 16, 16, 8, 8]
