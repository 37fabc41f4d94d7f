"""Report checks, not code tests: two more committed GPU results re-render from their JSON, byte for byte:
the out-of-vocabulary probe (bench/results/badids_h200.md, ``bench/soak.py``'s ``render_probe_md``) and
the tree-verify attention kernel grid (bench/results/verify_attention_h200.md, ``bench/verify_attention.py
--render``).  They read committed files, so they pass whatever the code does today.

Each check must be able to fail: ``test_check_fails_on_a_corrupted_copy`` runs it on a copy of just
the files it reads with one fact changed, and requires an AssertionError; the ``_rerendered``
control also renders the report again from the changed JSON, so the claims on the records, not only
the byte comparison, are shown to catch it."""
import json
import os
import shutil

import pytest

from helpers import env_without_checkout, load_bench
from reportlib import RES, REPO, RendererFailed, assert_fails_on_a_corrupted_copy, edit_json, reads, resolve

pytestmark = pytest.mark.report
SOAK = load_bench("soak")


@reads(f"{RES}/badids_h200.json", f"{RES}/badids_h200.md")
def check_badids_probe(root, tmp):
    """badids_h200.md is render_probe_md of the committed JSON; the probe's finding: SGLang without the
    plugin dies on a token id outside the vocabulary, with the plugin it answers 400 and serves on."""
    doc = json.load(open(resolve(root, f"{RES}/badids_h200.json")))
    assert SOAK.render_probe_md(doc) == open(resolve(root, f"{RES}/badids_h200.md")).read(), "badids_h200.md differs"
    runs = {r["label"]: r for r in doc["runs"]}
    assert not runs["plain_sglang"]["alive"]
    ours = runs["with_plugin"]
    assert ours["alive"] and ours["bad_status"] == 400 and ours["good_after_status"] == 200, ours


def test_report_badids_probe():
    check_badids_probe(REPO, None)


def _render_va(root, tmp):
    """verify_attention.py --render of the committed JSON (in a scratch folder) -> (markdown, doc)."""
    import subprocess
    import sys
    work = os.path.join(str(tmp), "va")
    os.makedirs(work, exist_ok=True)
    shutil.copy(resolve(root, f"{RES}/verify_attention_h200.json"), os.path.join(work, "va.json"))
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "verify_attention.py"), "--render",
                        os.path.join(work, "va.json")], cwd=work, env=env_without_checkout(CUDA_VISIBLE_DEVICES=""),
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RendererFailed(r.stderr[-2000:])
    return open(os.path.join(work, "va.md")).read(), json.load(open(os.path.join(work, "va.json")))


@reads(f"{RES}/verify_attention_h200.json", f"{RES}/verify_attention_h200.md")
def check_verify_attention(root, tmp):
    """verify_attention_h200.md is what --render makes of its JSON (the achieved bandwidth / FLOP
    columns included), so the table and the numbers cannot drift apart; the largest MLA cell's row
    carries our time and the achieved shares worked out here from the JSON's own numbers."""
    got, doc = _render_va(root, tmp)
    assert got == open(resolve(root, f"{RES}/verify_attention_h200.md")).read(), "verify_attention_h200.md differs"
    row = max((r for r in doc["rows"] if r["arch"] == "mla"), key=lambda r: (r["bs"], r["prefix"], r["N"]))
    bw = 100 * row["floor_bytes"] / (row["ours_us"] * 1e-6) / (doc["copy_gbs"] * 1e9)
    fl = 100 * row["flops"] / (row["ours_us"] * 1e-6) / (doc["matmul_tflops"] * 1e12)
    line = next(ln for ln in got.splitlines()
                if ln.startswith(f"| mla | {row['bs']} | {row['prefix']} | {row['N']} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert float(cells[4]) == pytest.approx(row["ours_us"], abs=0.05)
    got_bw, got_fl = (int(x.strip().rstrip("%")) for x in cells[8].split("/"))
    assert abs(got_bw - bw) <= 1 and abs(got_fl - fl) <= 1, (cells[8], bw, fl)


def test_report_verify_attention_grid(tmp_path):
    check_verify_attention(REPO, tmp_path)


DEFAULT_SOURCES = (f"{RES}/raw/serving_h100_qwen3-8bchain_random_s29_a.json.gz",
                   f"{RES}/raw/serving_h100_qwen3-8bchain_random_s29_b.json.gz",
                   f"{RES}/raw/serving_h100_qwen3-8bchain_random_s32.json.gz",
                   f"{RES}/raw/serving_h100_qwen3-8bchain_random_s38.json.gz",
                   f"{RES}/raw/serving_h100_qwen3-8bchain_ids_s39.json.gz",
                   f"{RES}/raw/serving_h200_qwen3-8bchain_ids_s40.json.gz")


@reads(f"{RES}/default_h200.json", f"{RES}/default_h200.md", *DEFAULT_SOURCES)
def check_default_report(root, tmp):
    """default_h200.{json,md} (issue 52's proof table, in progress) is what ``bench/default_report.py``
    makes of the serving reports it names, byte for byte; it names exactly those.  Today's default
    (``regime=auto`` since s40) is each report's ``ddtree_regimeauto`` arm here (no report yet from
    after the flip), so the older reports' spec-only ``ddtree`` arms are not judged: four cells, none
    passing, none failing: s38's random ids c=16 (no DFLASH), s40's chain prompts c = 1 / 16 / 64 on
    an H200 beside DFLASH (taken over s39's H100 report without it): c=1 1.51x DFLASH, INCOMPLETE only
    because its identity requests were left unrun; c = 16 / 64 cut.  Each cell's tok/s are the raw
    report's medians and its regime line the level's record.  The floor's two cells (random ids,
    c = 16 and 64, s38's report) hold their ratios as the raw report gives them and stay INCOMPLETE:
    each ratio lies within 3 % of the 0.99 bar and had 2 repeats, not the 3 the rule then asks."""
    import gzip
    import subprocess
    import sys
    doc = json.load(open(resolve(root, f"{RES}/default_h200.json")))
    assert doc["sources"] == list(DEFAULT_SOURCES) and doc["default_arm"] is None, doc["sources"]
    out = os.path.join(str(tmp), "rerender")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "default_report.py"), out,
                        *[os.path.relpath(resolve(root, s), root) for s in DEFAULT_SOURCES]], cwd=root, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        raise RendererFailed(r.stderr[-2000:])
    assert open(out + ".md").read() == open(resolve(root, f"{RES}/default_h200.md")).read(), "default_h200.md differs"
    assert json.load(open(out + ".json"))["cells"] == doc["cells"], "default_h200.json's cells differ"
    assert doc["passed"] == 0 and [c["status"] for c in doc["cells"]] == ["INCOMPLETE"] * 4
    assert all(c["default_arm"] == "ddtree_regimeauto" for c in doc["cells"])
    by = {(c["workload"], c["concurrency"]): c for c in doc["cells"]}
    assert by[("random", 16)]["source"] == DEFAULT_SOURCES[3] and "dflash not measured" in by[("random", 16)]["why"]
    assert all(by[("ids", c)]["source"] == DEFAULT_SOURCES[5] for c in (1, 16, 64)), doc["cells"]
    assert by[("ids", 1)]["why"] == ["outputs not compared"] and not by[("ids", 1)]["fails"]
    assert by[("ids", 1)]["x_dflash"] > 1.05
    for c in doc["cells"]:
        raw = json.load(gzip.open(resolve(root, c["source"]), "rt"))
        lv = {(a["name"], l["concurrency"]): l for a in raw["arms"] for l in a["levels"]}
        if c["tok_s"]["ddtree_regimeauto"] is not None:      # s40's c=64: its only repeat failed
            for arm in ("base", "ddtree_regimeauto"):
                assert c["tok_s"][arm] == lv[(arm, c["concurrency"])]["output_throughput"], (c, arm)
        assert c["regime"]["spec_share"] == lv[("ddtree_regimeauto", c["concurrency"])]["regime"]["spec_share"]
    assert doc["floor_passed"] == 0 and doc["floor_total"] == 2
    raw = json.load(gzip.open(resolve(root, DEFAULT_SOURCES[3]), "rt"))
    med = {(a["name"], lv["concurrency"]): lv["output_throughput"] for a in raw["arms"] for lv in a["levels"]}
    for c in doc["floor_cells"]:
        assert c["source"] == DEFAULT_SOURCES[3] and c["status"] == "INCOMPLETE", c
        want = med[("ddtree_regimeplain", c["concurrency"])] / med[("base", c["concurrency"])]
        assert abs(c["x_base"] - want) < 1e-3 and 0.99 <= want < 0.99 + 0.03, (c, want)


def test_report_default_h200(tmp_path):
    check_default_report(REPO, tmp_path)


# ------------------------------------------------------------------------------- the checks can fail

def _plugin_run_died(root):
    def fn(doc):
        r = next(r for r in doc["runs"] if r["label"] == "with_plugin")
        r["alive"] = r["server_process_alive"] = False
    edit_json(root, f"{RES}/badids_h200.json", fn)


def _badids_rerendered(root):
    _plugin_run_died(root)
    doc = json.load(open(resolve(root, f"{RES}/badids_h200.json")))
    open(resolve(root, f"{RES}/badids_h200.md"), "w").write(SOAK.render_probe_md(doc))


def _largest_mla_cell_slower(root):
    def fn(doc):
        row = max((r for r in doc["rows"] if r["arch"] == "mla"), key=lambda r: (r["bs"], r["prefix"], r["N"]))
        row["ours_us"] *= 1.5
    edit_json(root, f"{RES}/verify_attention_h200.json", fn)


def _auto_faster(root):
    def fn(doc):
        arm = next(a for a in doc["arms"] if a["name"] == "ddtree_regimeauto")
        arm["levels"][0]["output_throughput"] *= 1.1          # s40's c=1, the cell it takes
    edit_json(root, DEFAULT_SOURCES[5], fn)


def _plain_regime_slower(root):
    def fn(doc):
        arm = next(a for a in doc["arms"] if a["name"] == "ddtree_regimeplain")
        arm["levels"][0]["output_throughput"] *= 0.97
    edit_json(root, DEFAULT_SOURCES[3], fn)


CONTROLS = {
    "default_report": (check_default_report, _auto_faster),
    "default_report_floor": (check_default_report, _plain_regime_slower),
    "badids": (check_badids_probe, _plugin_run_died),
    "badids_rerendered": (check_badids_probe, _badids_rerendered),
    "verify_attention": (check_verify_attention, _largest_mla_cell_slower),
}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_check_fails_on_a_corrupted_copy(name, tmp_path):
    """The check passes on a faithful copy of the files it declares, and fails once one fact is
    changed."""
    assert_fails_on_a_corrupted_copy(*CONTROLS[name], tmp_path)
