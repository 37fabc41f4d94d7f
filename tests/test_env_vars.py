"""Every SGLANG_DDTREE_* variable checked at argument resolution (issue 40 item 3): the list in
``sglang_ddtree/env_vars.py`` against the names the code actually reads (found by scanning the
sources, not by asking the module), each documented, every bad value refused with a line that names
the variable, and an unknown name refused with the closest known one."""
import os
import re

import pytest

from sglang_ddtree import env_vars as E

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"SGLANG_DDTREE_[A-Z0-9_]*[A-Z0-9]")


def _names_in(*dirs, exts=(".py", ".sh"), skip=()):
    found = set()
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith(exts) and os.path.relpath(os.path.join(base, f), ROOT) not in skip:
                    with open(os.path.join(base, f), errors="replace") as fh:
                        found.update(NAME.findall(fh.read()))
    return found


def test_the_list_is_every_name_the_code_reads_and_each_is_documented():
    # env_vars.py names the removed variables (to refuse them): every other file only reads
    shipped = _names_in("sglang_ddtree", "patches", "kernels", skip=("sglang_ddtree/env_vars.py",)) - {"SGLANG_DDTREE_"}
    anywhere = shipped | _names_in("bench", "scripts", ".ci")
    assert shipped <= set(E.VARIABLES), sorted(shipped - set(E.VARIABLES))
    assert set(E.VARIABLES) <= anywhere, sorted(set(E.VARIABLES) - anywhere)   # no stale entry
    # the A/B and test-bed switches (issue 40 item 3): no server code, bench script or test bed reads them
    assert not (set(E.REMOVED) & anywhere), sorted(set(E.REMOVED) & anywhere)
    assert not (set(E.REMOVED) & set(E.VARIABLES))
    with open(os.path.join(ROOT, "docs", "configuration.md")) as fh:
        doc = fh.read()
    assert all(f"`{n}`" in doc for n in E.VARIABLES), [n for n in E.VARIABLES if f"`{n}`" not in doc]
    assert set(E.VARIABLES.values()) == {"user", "tuning", "diagnostic", "tool"}


@pytest.mark.parametrize("var,bad,says", [
    ("SGLANG_DDTREE_ADAPTIVE", "yes", "must be 0 or 1"),
    ("SGLANG_DDTREE_BUDGETS", "0", "names no tree budget"),
    ("SGLANG_DDTREE_BUDGETS", "7,61", "must be the server's tree budget 60"),
    ("SGLANG_DDTREE_VERIFY_ATTN", "fast", "SGLANG_DDTREE_VERIFY_ATTN"),
    ("SGLANG_DDTREE_LOGPROBS", "maybe", "SGLANG_DDTREE_LOGPROBS must be one of"),
    ("SGLANG_DDTREE_STATS_EVERY", "-3", "SGLANG_DDTREE_STATS_EVERY must be an integer >= 1"),
    ("SGLANG_DDTREE_PROFILE_EVERY", "x", "SGLANG_DDTREE_PROFILE_EVERY must be an integer >= 1"),
    ("SGLANG_DDTREE_ALLOW_UNCHECKED_SGLANG", "please", "SGLANG_DDTREE_ALLOW_UNCHECKED_SGLANG must be one of"),
    ("SGLANG_DDTREE_STATS_FILE", "/no/such/folder/s.jsonl", "does not exist"),
    ("SGLANG_DDTREE_PROFILE_FILE", "/", "is a folder"),
])
def test_each_bad_value_is_refused_naming_its_variable(var, bad, says):
    with pytest.raises(ValueError) as ei:
        E.check({var: bad}, algo="DDTREE-GPU", budget=60)
    msg = str(ei.value)
    assert says in msg and "\n" not in msg and msg.startswith("DDTREE-GPU")


def test_good_values_pass_and_the_adaptive_configuration_comes_back(tmp_path):
    env = {"SGLANG_DDTREE_VERIFY_ATTN": "ddtree", "SGLANG_DDTREE_BUDGETS": "15,0,60",
           "SGLANG_DDTREE_LOGPROBS": "off", "SGLANG_DDTREE_STATS_FILE": str(tmp_path / "s.jsonl"),
           "SGLANG_DDTREE_STATS_EVERY": "16", "SGLANG_DDTREE_VENV": "/anything", "OTHER": "x"}
    cfg = E.check(env, algo="DDTREE-GPU", budget=60)
    assert cfg.budgets == (15, 60) and cfg.no_spec and cfg.probe_every == 16
    assert E.check({}, algo="DDTREE-GPU", budget=60).budgets == (7, 15, 31, 60)    # the default set
    assert E.check({"SGLANG_DDTREE_ADAPTIVE": "0"}, algo="DDTREE-GPU", budget=60) is None
    assert E.check({"SGLANG_DDTREE_BUDGETS": "60"}, algo="DDTREE-GPU", budget=60) is None   # one budget: fixed


def test_at_most_six_user_facing_settings():
    """Issue 40 item 3: a handful of settings a user may touch (user + tuning kinds), the rest
    diagnostics (which change nothing served) or the tools' own."""
    facing = sorted(n for n, k in E.VARIABLES.items() if k in ("user", "tuning"))
    assert len(facing) <= 6, facing


def test_an_unknown_name_is_refused_with_the_closest_known_one():
    with pytest.raises(ValueError, match=r"unknown variable SGLANG_DDTREE_BUGDETS \(did you mean "
                                         r"SGLANG_DDTREE_BUDGETS\?\)"):
        E.check({"SGLANG_DDTREE_BUGDETS": "8"}, algo="DDTREE-GPU", budget=60)
    assert E.unknown({"SGLANG_DDTREE_ZZZZZZZZ": "1"}).startswith("unknown variable SGLANG_DDTREE_ZZZZZZZZ:")
    assert E.unknown({"DDTREE_STAGE_TP": "2", "SGLANG_OTHER": "1"}) is None


def test_the_shared_parsers():
    assert E.flag({}, "V", True) and not E.flag({"V": " OFF "}, "V", True) and E.flag({"V": "Yes"}, "V", False)
    assert E.positive_int({"V": " 12 "}, "V", None) == 12 and E.positive_int({"V": ""}, "V", 5) == 5
    with pytest.raises(ValueError, match=r"V must be an integer in \[1, 8\], got '9'"):
        E.positive_int({"V": "9"}, "V", None, hi=8)
    assert E.choice({"V": " Move"}, "V", ("remap", "move")) == "move" and E.choice({}, "V", ("a", "b")) == "a"


@pytest.mark.parametrize("var", sorted(E.REMOVED))
def test_a_removed_variable_is_refused_with_where_its_setting_went(var):
    """The A/B and test-bed switches are not server settings any more (sglang_ddtree/switches.py),
    and SGLANG_DDTREE_BUDGET / _NO_SPEC have one way each now (the flag; budget 0 in
    SGLANG_DDTREE_BUDGETS): an old launch line that still sets one is refused, whatever its value,
    saying where it went."""
    with pytest.raises(ValueError) as ei:
        E.check({var: "1"}, algo="DDTREE-GPU", budget=60)
    msg = str(ei.value)
    if var in ("SGLANG_DDTREE_BUDGET", "SGLANG_DDTREE_NO_SPEC"):
        assert msg.startswith(f"DDTREE-GPU: {var} is no longer read: ")
        assert ("--speculative-num-draft-tokens" if var.endswith("BUDGET") else "budget 0 in SGLANG_DDTREE_BUDGETS") in msg
    else:
        assert msg.startswith(f"DDTREE-GPU: {var} is now an A/B / test-bed switch") and "switches.py" in msg
