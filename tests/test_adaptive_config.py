"""sglang_ddtree.adaptive.parse_config: the adaptive budget is off unless its variables are set, and
every bad value is a one-line ValueError at start-up (issue 17 item 3)."""
import pytest

from sglang_ddtree import adaptive as A


def _parse(budget=31, **env):
    return A.parse_config({k: v for k, v in env.items()}, budget=budget, algo="DDTREE-GPU")


def test_unset_is_the_fixed_budget():
    assert _parse() is None
    assert _parse(SGLANG_DDTREE_BUDGETS="") is None
    assert _parse(SGLANG_DDTREE_BUDGETS="  ", SGLANG_DDTREE_NO_SPEC="") is None
    assert _parse(SGLANG_DDTREE_BUDGETS="31") is None            # one budget, no alternative
    assert _parse(SGLANG_DDTREE_NO_SPEC="0") is None
    assert _parse(SGLANG_DDTREE_PROBE_EVERY="4") is None          # probing alone turns nothing on


def test_budgets_widths_and_options():
    c = _parse(SGLANG_DDTREE_BUDGETS="15, 7,31")
    assert c.budgets == (7, 15, 31) and not c.no_spec and c.cycle is None
    assert c.widths == (8, 16, 32) and c.widest == 32 and c.extra_widths == (8, 16)
    assert c.probe_every == A.DEFAULT_PROBE_EVERY
    c = _parse(SGLANG_DDTREE_BUDGETS="7,31", SGLANG_DDTREE_NO_SPEC="1", SGLANG_DDTREE_PROBE_EVERY="3")
    assert c.widths == (1, 8, 32) and c.extra_widths == (1, 8) and c.probe_every == 3
    c = _parse(SGLANG_DDTREE_NO_SPEC="1")                         # the server's budget or no spec
    assert c.budgets == (31,) and c.widths == (1, 32) and c.extra_widths == (1,)
    c = _parse(SGLANG_DDTREE_BUDGETS="7,31", SGLANG_DDTREE_NO_SPEC="1",
               SGLANG_DDTREE_TEST_BUDGET_CYCLE="31,0,7")
    assert c.cycle == (31, 0, 7)
    c = _parse(SGLANG_DDTREE_TEST_BUDGET_CYCLE="31")             # the test switch alone turns it on
    assert c.budgets == (31,) and c.cycle == (31,)


@pytest.mark.parametrize("env, words", [
    (dict(SGLANG_DDTREE_BUDGETS="7,x,31"), "comma-separated list of integers"),
    (dict(SGLANG_DDTREE_BUDGETS="7,,31"), "comma-separated list of integers"),
    (dict(SGLANG_DDTREE_BUDGETS="7.5,31"), "comma-separated list of integers"),
    (dict(SGLANG_DDTREE_BUDGETS="0,31"), "must be in [1, 256], got 0"),
    (dict(SGLANG_DDTREE_BUDGETS="-3,31"), "must be in [1, 256], got -3"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31,300"), "got 300"),
    (dict(SGLANG_DDTREE_BUDGETS="7,7,31"), "lists a budget twice"),
    (dict(SGLANG_DDTREE_BUDGETS="7,15"), "--speculative-num-draft-tokens 16"),
    (dict(SGLANG_DDTREE_BUDGETS="7,63"), "widest budget 63 must be the server's tree budget 31"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31", SGLANG_DDTREE_NO_SPEC="yes"), "must be 0 or 1"),
    (dict(SGLANG_DDTREE_NO_SPEC="2"), "must be 0 or 1"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31", SGLANG_DDTREE_PROBE_EVERY="0"), "integer >= 1"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31", SGLANG_DDTREE_PROBE_EVERY="often"), "integer >= 1"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31", SGLANG_DDTREE_TEST_BUDGET_CYCLE="7,15"), "15 is not one of"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31", SGLANG_DDTREE_TEST_BUDGET_CYCLE="0,7"), "0 needs"),
    (dict(SGLANG_DDTREE_BUDGETS="7,31", SGLANG_DDTREE_TEST_BUDGET_CYCLE="7;31"), "integers"),
])
def test_bad_values_are_one_line_errors(env, words):
    with pytest.raises(ValueError) as e:
        _parse(**env)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.startswith("DDTREE-GPU: ")

