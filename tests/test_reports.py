"""The committed GPU result files are reproducible from the committed raw records by the scripts
that made them (every claim names its source; nothing in those tables is typed by hand)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(REPO, "bench", "results")
RAW = os.path.join(RES, "raw")


def test_worker_report_reproduces_the_committed_matrix(tmp_path):
    out = str(tmp_path / "w")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "worker_report.py"), out,
                        os.path.join(RAW, "worker_h200_toy_run2_summary.txt"),
                        os.path.join(RAW, "worker_h200_toy_run2.jsonl"),
                        os.path.join(RAW, "worker_h200_text_run4.jsonl"),
                        os.path.join(RAW, "worker_h200_text_run6.jsonl"),
                        "--divergence", os.path.join(RES, "text_divergence_h200.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert open(out + ".md").read() == open(os.path.join(RES, "worker_h200.md")).read()
    doc = json.load(open(out + ".json"))
    assert doc["all_ok"]
    toy = [s for s in doc["stages"] if s["algo"] in ("ddtree", "ddtreecpu")]
    budgets = {(s["pair"], s["mode"], s["budget"]) for s in toy if s["algo"] == "ddtree"}
    assert {(p, m, b) for p in ("gqa", "mla") for m in ("eager", "graph") for b in (8, 16, 32, 64)} <= budgets
    assert all(s["bs16_exact"] and s["bs1_exact"] and s["mixed_exact"] and s["sampled_exact"] for s in toy)
    text = {s["stage"]: s for s in doc["text_pair"]}
    assert text["text_ddtree_graph_b16_nomaskpatch"]["errors"] >= 10   # the check has power
    for name, s in text.items():
        if name.startswith(("text_ddtree", "text_dflash")) and "nomaskpatch" not in name and s["requests"]:
            assert s["errors"] == 0, name


def test_text_divergence_classification_is_stable():
    """Re-classify a few committed divergences with the fp32 reference forward (CPU)."""
    doc = json.load(open(os.path.join(RES, "text_divergence_h200.json")))
    rows = doc["divergences"]
    picks = [r for r in rows if r["near_tie"]][:2] + [r for r in rows if not r["near_tie"]][:2]
    code = r'''
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import common as C, pairlib as PL
from materialize import load_pair
T, _ = load_pair(); T = {k: v.float() for k, v in T.items()}
raw = {json.loads(l)["stage"]: json.loads(l) for l in open(sys.argv[2])}
prompts = [p["ids"] for p in json.load(open(C.PROMPTS))[:16]]
out = []
for r in json.loads(sys.argv[3]):
    ref = raw[r["stage"]]["reference_bs16"][r["request"]]
    with torch.no_grad():
        lg = PL.logits(T, torch.tensor([prompts[r["request"]] + ref[: r["pos"]]]))[0, -1].float()
    out.append(round(float((lg[r["ref_tok"]] - lg[r["out_tok"]]).abs()), 4))
print(json.dumps(out))
'''
    r = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "bench", "textpair"),
                        os.path.join(RAW, "worker_h200_text_run6.jsonl"), json.dumps(picks)],
                       cwd="/", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    gaps = json.loads(r.stdout.strip().splitlines()[-1])
    for row, gap in zip(picks, gaps):
        assert abs(gap - row["gap"]) < 1e-3, (row, gap)
        assert (gap <= doc["tie_threshold_logits"]) == row["near_tie"]
