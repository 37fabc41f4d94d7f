"""bench/default_report.py, issue 52's proof table, on hand-made serving reports: each cell's verdict
follows the issue's bars worked out by hand (>= 0.98x max(base, dflash); >= 1.05x dflash only where
dflash beats base; identical outputs or classified near ties; 2 repeats of >= 20 s, 3 where a ratio
is within 3 % of its bar; exploration <= 1 % where the default has a regime), a cell never mixes
arms of two reports, and the report with more repeats wins a cell."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import default_report as R  # noqa: E402


def report(levels, *, workload="random", pair="text", repeats=3, min_s=20.0, short=(), mismatched=None,
           classified=None, date="2026-12-05", itl=None, regime=None, auto_default=True):
    """levels: {c: {arm: tok/s}} (an arm missing at c is absent from that level); itl: {(arm, c): median
    ITL ms} (default 10); regime: {(arm, c): the A/B's regime record}; auto_default: the ``ddtree``
    arm's server ran the regime controller (a report from after the s40 flip: its ``regime_final``)."""
    arms = {}
    for c, by in levels.items():
        for name, t in by.items():
            arms.setdefault(name, []).append(dict(concurrency=c, output_throughput=t, repeats=repeats,
                                                  partial=False, short=(name, c) in short,
                                                  median_ttft_ms=10.0, accept_length=1.0,
                                                  median_itl_ms=(itl or {}).get((name, c), 10.0),
                                                  **({"regime": regime[(name, c)]} if (name, c) in (regime or {}) else {})))
    idn = dict(reference="base", arms={a: dict(compared=8, mismatched=(mismatched or {}).get(a, 0))
                                       for a in arms if a != "base"})
    if classified:
        idn["classification"] = dict(arms=classified)
    return dict(kind="ab_serving", meta=dict(date=date),
                settings=dict(pair=pair, workload=dict(name=workload), concurrency=sorted(levels),
                              min_level_seconds=min_s),
                arms=[dict(name=n, levels=lv, **({"regime_final": dict(regime="spec", switches=0)}
                                                 if n == "ddtree" and auto_default else {}))
                      for n, lv in arms.items()], identity=idn)


def cells_of(*docs):
    return R.assemble([(f"r{i}.json", d) for i, d in enumerate(docs)])


def test_the_bars_as_the_issue_states_them():
    doc = report({1: dict(base=100.0, dflash=120.0, ddtree=130.0),     # 1.08x dflash: pass
                  4: dict(base=100.0, dflash=120.0, ddtree=122.0),     # beats both, but 1.02x dflash
                  16: dict(base=100.0, dflash=80.0, ddtree=98.0),      # dflash loses: 0.98x base passes
                  64: dict(base=100.0, dflash=80.0, ddtree=97.0)})     # 0.97x base fails
    cells = cells_of(doc)
    st = {c: cells[("text", "random", c)]["status"] for c in (1, 4, 16, 64)}
    assert st == {1: "PASS", 4: "FAIL", 16: "PASS", 64: "FAIL"}
    assert "dflash" in cells[("text", "random", 4)]["fails"][0]
    assert cells[("text", "random", 16)]["x_best"] == pytest.approx(0.98)


def test_two_repeats_call_a_cell_unless_a_ratio_is_within_3_percent_of_its_bar():
    """1.20x base with 2 repeats is called; 0.99x base (within 3 % of 0.98) needs 3, and so does 1.07x
    dflash where dflash beats base (within 3 % of 1.05); 0.90x base (9 % below) is called a FAIL."""
    lv = {1: dict(base=100.0, dflash=90.0, ddtree=120.0), 4: dict(base=100.0, dflash=90.0, ddtree=99.0),
          16: dict(base=100.0, dflash=110.0, ddtree=117.7), 64: dict(base=100.0, dflash=90.0, ddtree=90.0)}
    two = cells_of(report(lv, repeats=2))
    st = {c: two[("text", "random", c)]["status"] for c in (1, 4, 16, 64)}
    assert st == {1: "PASS", 4: "INCOMPLETE", 16: "INCOMPLETE", 64: "FAIL"}, st
    assert "3 needed" in two[("text", "random", 4)]["why"][0]
    three = cells_of(report(lv, repeats=3))
    assert {c: three[("text", "random", c)]["status"] for c in (1, 4, 16, 64)} == \
        {1: "PASS", 4: "PASS", 16: "PASS", 64: "FAIL"}


def test_the_default_arm_and_its_exploration():
    """``--default-arm ddtree_regimeauto`` judges that arm; a level whose regime record says it explored
    more than 1 % of busy time fails however fast it was; the regime is shown in the markdown."""
    lv = {16: dict(base=100.0, dflash=90.0, ddtree=95.0, ddtree_regimeauto=100.0),
          64: dict(base=100.0, dflash=90.0, ddtree=95.0, ddtree_regimeauto=110.0)}
    reg = {("ddtree_regimeauto", 16): dict(spec_share=0.1, switches=2, explore_share=0.004, trip_share=0.025),
           ("ddtree_regimeauto", 64): dict(spec_share=0.5, switches=4, explore_share=0.02)}
    doc = report(lv, regime=reg)
    auto = R.assemble([("r.json", doc)], make=lambda d, c, src: R.cell_from(d, c, src, default="ddtree_regimeauto"))
    assert auto[("text", "random", 16)]["status"] == "PASS"
    assert auto[("text", "random", 64)]["fails"] == ["exploration 2.0% of busy time > 1%"]
    assert {c: cells_of(doc)[("text", "random", c)]["status"] for c in (16, 64)} == {16: "FAIL", 64: "FAIL"}
    md = R.render(auto, [], {}, default="ddtree_regimeauto")
    assert "| text | random | 16 | 100 | 90 | 100 | `ddtree_regimeauto` | 1.00 | 1.11 | spec 10%, 2 sw, explore 0.4%, " \
        "trips 2.5% |" in md


def test_todays_default_is_the_arm_that_ran_the_regime_controller():
    """Since the s40 flip the default is ``regime=auto``: a report's ``ddtree`` arm is judged where its
    server ran the regime controller, else its ``ddtree_regimeauto`` arm; a ``ddtree`` arm without
    the controller (an older spec-only default) is not judged as today's, and the cell says today's
    default was not measured.  Control: ``--default-arm ddtree`` judges that older arm."""
    lv = {16: dict(base=100.0, dflash=90.0, ddtree=91.0, ddtree_regimeauto=99.0)}
    new = cells_of(report(lv))[("text", "random", 16)]
    assert new["default_arm"] == "ddtree" and new["status"] == "FAIL"          # 0.91x: the flipped default
    old = cells_of(report(lv, auto_default=False))[("text", "random", 16)]
    assert old["default_arm"] == "ddtree_regimeauto" and old["status"] == "PASS"
    spec_only = report({16: dict(base=100.0, dflash=90.0, ddtree=99.0)}, auto_default=False)
    cell = cells_of(spec_only)[("text", "random", 16)]
    assert cell["status"] == "INCOMPLETE" and cell["why"] == ["ddtree (regime auto) not measured"], cell
    forced = R.assemble([("r.json", spec_only)], make=lambda d, c, src: R.cell_from(d, c, src, default="ddtree"))
    assert forced[("text", "random", 16)]["status"] == "PASS"
    md = R.render({("text", "random", 16): new}, [])
    assert "| text | random | 16 | 100 | 90 | 91 | `ddtree` | 0.91 |" in md, md


def test_outputs_must_be_identical_or_classified_near_ties():
    lv = {1: dict(base=100.0, dflash=90.0, ddtree=150.0)}
    assert cells_of(report(lv, mismatched={"ddtree": 2}))[("text", "random", 1)]["status"] == "FAIL"
    ties = report(lv, mismatched={"ddtree": 2}, classified={"ddtree": dict(near_tie=2, error=0)})
    assert cells_of(ties)[("text", "random", 1)]["status"] == "PASS"
    err = report(lv, mismatched={"ddtree": 2}, classified={"ddtree": dict(near_tie=1, error=1)})
    assert cells_of(err)[("text", "random", 1)]["status"] == "FAIL"


def test_outputs_never_compared_leave_the_cell_incomplete_not_failed():
    """An arm whose identity requests did not run (s40: the deadline took their time) has no verdict on
    its outputs: the cell is INCOMPLETE, saying so, in the default's table and the floor's.  Control:
    the same report with the outputs compared passes."""
    doc = report({1: dict(base=100.0, dflash=90.0, ddtree=150.0, ddtree_regimeplain=100.0)}, repeats=3)
    assert cells_of(doc)[("text", "random", 1)]["status"] == "PASS"
    assert floors_of(doc)[("text", "random", 1)]["status"] == "PASS"
    for arm in ("ddtree", "ddtree_regimeplain"):
        del doc["identity"]["arms"][arm]
    cell, floor = cells_of(doc)[("text", "random", 1)], floors_of(doc)[("text", "random", 1)]
    assert cell["status"] == "INCOMPLETE" and cell["why"] == ["outputs not compared"] and not cell["fails"]
    assert floor["status"] == "INCOMPLETE" and floor["why"] == ["outputs not compared"] and not floor["fails"]


def test_short_or_few_repeats_is_incomplete_whatever_the_ratio():
    lv = {1: dict(base=100.0, dflash=90.0, ddtree=150.0)}
    assert cells_of(report(lv, repeats=1))[("text", "random", 1)]["status"] == "INCOMPLETE"
    assert cells_of(report(lv, min_s=15.0))[("text", "random", 1)]["status"] == "INCOMPLETE"
    assert cells_of(report(lv, short={("dflash", 1)}))[("text", "random", 1)]["status"] == "INCOMPLETE"


def test_a_cell_never_mixes_reports_and_more_repeats_win():
    a = report({4: dict(base=100.0, dflash=90.0)})
    b = report({4: dict(ddtree=150.0)})
    cell = cells_of(a, b)[("text", "random", 4)]          # two halves never make a cell
    assert cell["status"] == "INCOMPLETE" and cell.get("x_best") is None and cell["source"] == "r0.json"
    assert cell["why"] == [f"{R.UNMEASURED_DEFAULT} not measured"]      # the half without the default
    assert cell["tok_s"] == {"base": 100.0, "dflash": 90.0, R.UNMEASURED_DEFAULT: None}
    full = report({4: dict(base=100.0, dflash=90.0, ddtree=99.0)}, repeats=2, date="2026-12-01")
    assert cells_of(full, a)[("text", "random", 4)]["tok_s"]["ddtree"] == 99.0   # more arms win
    two = report({4: dict(base=100.0, dflash=90.0, ddtree=90.0)}, repeats=2)
    three = report({4: dict(base=100.0, dflash=90.0, ddtree=99.0)}, repeats=3, date="2026-12-01")
    for order in ((two, three), (three, two)):
        cell = cells_of(*order)[("text", "random", 4)]
        assert cell["tok_s"]["ddtree"] == 99.0 and cell["status"] == "PASS"


def test_missing_lists_the_matrix_gaps_and_refuses_other_reports():
    cells = cells_of(report({c: dict(base=1.0, dflash=1.0, ddtree=1.0) for c in (1, 4, 16, 64)}),
                     report({16: dict(base=1.0, dflash=1.0, ddtree=1.0)}, workload="long"))
    gaps = R.missing(cells)
    assert not any(g.startswith("text / random") for g in gaps)
    assert "text / long: c = 1, 4 not measured" in gaps       # item 5: 8k prompts at c = 1, 4, 16
    assert any(g.startswith("text / natural: c = 1, 16, 64") for g in gaps)
    assert gaps[0].startswith("pairs: 1 measured")
    chain = R.missing(cells_of(report({16: dict(base=1.0, dflash=1.0, ddtree=1.0)}, pair="qwen3-8bchain_target")))
    assert chain[1:] == ["qwen3-8bchain_target / varied: c = 1, 16, 64 not measured",    # item 5's chain pair rows
                         "qwen3-8bchain_target / ids: c = 1, 16, 64 not measured"], chain
    with pytest.raises(ValueError, match="not a bench_serving"):
        R.assemble([("x.json", dict(kind="ab"))])


def test_the_command_writes_json_and_markdown(tmp_path):
    src = tmp_path / "serving.json"
    src.write_text(json.dumps(report({1: dict(base=100.0, dflash=120.0, ddtree=130.0)})))
    out = tmp_path / "default_h200"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "default_report.py"), str(out), str(src)],
                   check=True, capture_output=True)
    doc = json.loads((tmp_path / "default_h200.json").read_text())
    assert doc["passed"] == doc["total"] == 1
    md = (tmp_path / "default_h200.md").read_text()
    assert "**1 of 1 cells pass.**" in md and "| text | random | 1 | 100 | 120 | 130 | `ddtree` | 1.08 | 1.08 | - |" in md
    assert "| PASS | ? | `serving.json` |" in md


# ------------------------------------------------------------------------------------- the floor

def floors_of(*docs):
    return R.assemble([(f"r{i}.json", d) for i, d in enumerate(docs)], make=R.floor_cell_from)


def test_the_floor_bars_as_the_issue_states_them():
    """>= 0.99x base tok/s, worked out by hand per cell (3 repeats: every ratio here is near the bar);
    ITL is shown, not a bar."""
    doc = report({1: dict(base=100.0, ddtree_regimeplain=99.5),       # 0.995x: pass
                  4: dict(base=100.0, ddtree_regimeplain=98.5),       # 0.985x: fail
                  16: dict(base=100.0, ddtree_regimeplain=100.0),     # ITL 1.04x: still a pass
                  64: dict(base=100.0, ddtree_regimeplain=99.0)},     # 0.99x: pass (at the bar)
                 itl={("ddtree_regimeplain", 16): 10.4})
    floor = floors_of(doc)
    st = {c: floor[("text", "random", c)]["status"] for c in (1, 4, 16, 64)}
    assert st == {1: "PASS", 4: "FAIL", 16: "PASS", 64: "PASS"}, st
    assert floor[("text", "random", 4)]["fails"] == ["0.985x base tok/s < 0.99"]
    assert floor[("text", "random", 16)]["itl_x_base"] == pytest.approx(1.04)
    # a floor-only report makes no cell of the default's table, and a report without the plain-regime
    # arm (e.g. the spec path's forced no-speculation arm) no floor cell
    assert cells_of(doc) == {}
    assert floors_of(report({1: dict(base=1.0, dflash=1.0, ddtree=1.0, ddtree_nospec=1.0)})) == {}


def test_the_floor_wants_identical_outputs_and_a_full_measurement():
    lv = {16: dict(base=100.0, ddtree_regimeplain=100.0)}
    assert floors_of(report(lv))[("text", "random", 16)]["outputs"] == "identical (8)"
    ties = report(lv, mismatched={"ddtree_regimeplain": 1},
                  classified={"ddtree_regimeplain": dict(near_tie=1, error=0)})
    cell = floors_of(ties)[("text", "random", 16)]
    assert cell["status"] == "FAIL" and cell["fails"] == ["outputs: 1 of 8 differ"]    # no near-tie allowance
    near = floors_of(report(lv, repeats=2))[("text", "random", 16)]     # 1.00x: within 3 % of 0.99
    assert near["status"] == "INCOMPLETE" and "3 needed" in near["why"][0]
    far = floors_of(report({16: dict(base=100.0, ddtree_regimeplain=110.0)}, repeats=2))
    assert far[("text", "random", 16)]["status"] == "PASS"
    half = floors_of(report({16: dict(ddtree_regimeplain=100.0)}))[("text", "random", 16)]
    assert half["status"] == "INCOMPLETE" and half["why"] == ["base not measured"]


def test_the_command_renders_the_floor_and_its_gaps(tmp_path):
    src = tmp_path / "floor.json"
    src.write_text(json.dumps(report({16: dict(base=2000.0, ddtree_regimeplain=1990.0)},
                                     itl={("base", 16): 7.5, ("ddtree_regimeplain", 16): 7.6})))
    out = tmp_path / "default_h200"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "default_report.py"), str(out), str(src)],
                   check=True, capture_output=True)
    doc = json.loads((tmp_path / "default_h200.json").read_text())
    assert (doc["total"], doc["floor_passed"], doc["floor_total"]) == (0, 1, 1)
    assert "floor, text / random: c = 64 not measured" in doc["missing"]      # item 4: c = 16 and 64
    assert "floor, text: 1 workload measured; the issue asks 2" in doc["missing"]
    md = (tmp_path / "default_h200.md").read_text()
    assert "| text | random | 16 | 2000 | 1990 | 0.995 | 7.50 | 7.60 | identical (8) | PASS |" in md
