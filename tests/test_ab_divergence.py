"""bench/ab_divergence.py: the text-pair mismatch classifier, on the real trained target (CPU, fp32).

Outputs are built here from the target's own fp32 greedy continuation of held-out prompts, then
perturbed: an arm that takes the target's 2nd choice at its closest top-2 step must be a near tie;
an arm that takes a low-ranked token must be an error at exactly that index; an identical arm has
no divergence.  The prompts come from the committed held-out set, and which prompts / steps are used
is drawn fresh each run.  The near-tie bound is the bf16-vs-fp32 noise the script calibrates.
"""
import gzip
import json
import os
import random
import sys

import pytest
from helpers import load_bench
from sglang_ddtree import assets

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_load = load_bench


AD = _load("ab_divergence")


@pytest.fixture(scope="module")
def greedy_case():
    """(prompt ids [n][p], fp32 greedy continuations [n][G], per-step top-2 gaps / 2nd / low-ranked tokens)."""
    sys.path.insert(0, os.path.join(REPO, "bench", "textpair"))
    import pairlib as PL
    from materialize import load_pair
    T, _ = load_pair()
    T = {k: v.float() for k, v in T.items()}
    rng = random.Random()
    prompts = json.load(open(assets.TEXTPAIR_PROMPTS))
    p_len, G = 32, 24
    picks = rng.sample([k for k, p in enumerate(prompts) if len(p["ids"]) >= p_len], 6)
    ids = torch.tensor([prompts[i]["ids"][-p_len:] for i in picks])
    seq = ids
    gaps, second, low = [], [], []
    with torch.no_grad():
        for _ in range(G):
            lg = PL.logits(T, seq)[:, -1].float()
            order = lg.argsort(-1, descending=True)
            top = lg.gather(1, order[:, :2])
            gaps.append((top[:, 0] - top[:, 1]).tolist())
            second.append(order[:, 1].tolist())
            low.append(order[:, 100].tolist())
            seq = torch.cat([seq, order[:, :1]], 1)
    outs = seq[:, p_len:].tolist()
    return ids.tolist(), outs, gaps, second, low


def _doc(prompt_ids, arms):
    return {"settings": {"pair": "text", "reference_arm": "base", "num_prompts": len(prompt_ids)},
            "prompts": {"sha256_16": "-"}, "identity": {"reference": "base"}, "output_ids": arms,
            "prompt_ids": prompt_ids}


def test_classifies_near_tie_error_and_identity(greedy_case, tmp_path):
    prompt_ids, outs, gaps, second, low = greedy_case
    n, G = len(outs), len(outs[0])
    # the closest top-2 step over all prompts (not an exact tie: the bounds below sit 2e-3 either side of
    # its gap, and this batch-6 forward and the classifier's single-prefix forward differ by fp32 noise)
    gap, j, i = min((gaps[j][i], j, i) for j in range(G) for i in range(n) if gaps[j][i] >= 5e-3)
    tie_arm = [list(o) for o in outs]
    tie_arm[i][j] = second[j][i]
    err_i, err_j = random.randrange(n), random.randrange(G)
    err_arm = [list(o) for o in outs]
    err_arm[err_i][err_j] = low[err_j][err_i]
    base = {"1": outs, "4": outs}
    doc = _doc(prompt_ids, {"base": base, "same": {"1": outs, "4": outs},
                            "tie": {"1": tie_arm, "4": outs}, "err": {"1": outs, "4": err_arm}})
    cls = AD.classify_doc(doc, prompt_ids, AD.Target())
    same, tie, err = cls["arms"]["same"], cls["arms"]["tie"], cls["arms"]["err"]
    assert same["compared"] == 2 * n and same["diverged"] == 0
    assert err["diverged"] == 1 and err["error"] == 1 and err["near_tie"] == 0
    row = err["rows"][0]
    assert (row["concurrency"], row["prompt"], row["pos"]) == (4, err_i, err_j)
    assert row["ref_tok"] == outs[err_i][err_j] and row["out_tok"] == low[err_j][err_i]
    assert tie["diverged"] == 1
    row = tie["rows"][0]
    assert (row["concurrency"], row["prompt"], row["pos"]) == (1, i, j)
    assert row["gap"] == pytest.approx(gap, abs=1e-3)
    # the verdict follows the calibrated bf16 noise: near tie iff the 2nd choice is within it of the top
    noise = cls["noise_logits"]
    assert 0.005 < noise < 1.0 and cls["calibration"]["positions"] == n * G
    assert row["below_top"] == pytest.approx(gap, abs=1e-3)
    if abs(gap - noise) > 1e-3:  # else either verdict is right
        assert row["near_tie"] == (gap <= noise)
        assert tie["near_tie" if gap <= noise else "error"] == 1
    # a fixed bound: the same flip is a near tie above its gap, an error below it
    assert AD.classify_doc(doc, prompt_ids, AD.Target(), noise=gap + 2e-3)["arms"]["tie"]["near_tie"] == 1
    assert AD.classify_doc(doc, prompt_ids, AD.Target(), noise=gap - 2e-3)["arms"]["tie"]["error"] == 1
    assert cls["reference_vs_own_first_level"]["diverged"] == 0


def test_main_moves_ids_and_renders(greedy_case, tmp_path):
    prompt_ids, outs, gaps, second, low = greedy_case
    err = [list(o) for o in outs]
    err[0][3] = low[3][0]
    ab = _load("ab_serve")
    doc = _doc(prompt_ids, {"base": {"1": outs}, "ddtree_b16": {"1": err}})
    doc.update(kind="ab_serve", meta={}, kernel_sweep=None,
               arms=[{"name": a, "status": "ok", "levels": []} for a in ("base", "ddtree_b16")])
    doc["settings"].update(concurrency=[1], model_path="t", draft_model_path="d", max_new_tokens=len(outs[0]),
                           requests_per_level={"1": len(outs)}, greedy="temperature 0")
    doc["prompts"].update(count=len(outs), kind="input_ids", mean_input_len=32, source="test")
    doc["identity"] = ab.identity_check({"base": {1: outs}, "ddtree_b16": {1: err}}, "base")
    p = tmp_path / "ab_text.json"
    p.write_text(json.dumps(doc))
    assert AD.main([str(p)]) == 0
    out = json.loads(p.read_text())
    assert "output_ids" not in out and "prompt_ids" not in out
    assert out["identity"]["classification"]["arms"]["ddtree_b16"]["error"] == 1
    with gzip.open(tmp_path / "ab_text.ids.json.gz", "rt") as f:
        ids = json.load(f)
    assert ids["output_ids"]["ddtree_b16"]["1"] == err and ids["prompt_ids"] == prompt_ids
    md = (tmp_path / "ab_text.md").read_text()
    assert "Why outputs differ" in md and "| ddtree_b16 | 6 | 1 | 0 | **1** |" in md


def test_refuses_toy_pairs_and_missing_ids(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps({"settings": {"pair": "gqa"}}))
    with pytest.raises(SystemExit, match="toy pairs"):
        AD.main([str(p)])
    p.write_text(json.dumps({"settings": {"pair": "text"}}))
    with pytest.raises(SystemExit, match="save-output-ids"):
        AD.main([str(p)])


def test_prompts_file_is_checked_against_the_runs_digest(greedy_case, tmp_path):
    prompt_ids, outs, gaps, second, low = greedy_case
    ab = _load("ab_serve")
    doc = _doc(prompt_ids, {"base": {"1": outs}, "ddtree_b16": {"1": outs}})
    del doc["prompt_ids"]
    doc.update(kind="ab_serve", meta={}, kernel_sweep=None,
               arms=[{"name": a, "status": "ok", "levels": []} for a in ("base", "ddtree_b16")])
    doc["settings"].update(concurrency=[1], model_path="t", draft_model_path="d", max_new_tokens=len(outs[0]),
                           requests_per_level={"1": len(outs)}, greedy="temperature 0")
    doc["prompts"].update(count=len(outs), kind="input_ids", mean_input_len=32, source="test",
                          sha256_16=ab.prompt_digest([{"input_ids": x} for x in prompt_ids]))
    doc["identity"] = ab.identity_check({"base": {1: outs}, "ddtree_b16": {1: outs}}, "base")
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in prompt_ids))
    p = tmp_path / "ab_text.json"
    p.write_text(json.dumps(doc))
    assert AD.main([str(p), "--prompts-file", str(pf)]) == 0
    assert json.loads(p.read_text())["identity"]["classification"]["arms"]["ddtree_b16"]["diverged"] == 0
    pf.write_text("".join(json.dumps({"input_ids": x[1:]}) + "\n" for x in prompt_ids))  # not the run's prompts
    doc["output_ids"] = {"base": {"1": outs}}
    p.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="sha256"):
        AD.main([str(p), "--prompts-file", str(pf)])


def test_cpu_vs_gpu_same_budget_is_compared(greedy_case):
    prompt_ids, outs, gaps, second, low = greedy_case
    other = [list(o) for o in outs]
    other[1][2] = low[2][1]
    doc = _doc(prompt_ids, {"base": {"1": outs}, "ddtreecpu_b16": {"1": outs}, "ddtree_b16": {"1": other},
                            "ddtree_b8": {"1": outs}})
    cls = AD.classify_doc(doc, prompt_ids, AD.Target(), noise=0.2)
    assert cls["cpu_vs_gpu"] == [dict(cpu="ddtreecpu_b16", gpu="ddtree_b16", compared=len(outs),
                                      identical=len(outs) - 1, identical_by_concurrency={"1": len(outs) - 1})]


def _cls(rows, noise=0.2, errors=None):
    grp = dict(compared=10, diverged=len(rows), length=0, rows=rows,
               near_tie=sum(r["near_tie"] for r in rows), error=sum(not r["near_tie"] for r in rows))
    return dict(noise_logits=noise, arms={"ddtree_b16": grp})


def _row(pos, below_top, noise=0.2, **kw):
    r = dict(arm="ddtree_b16", concurrency=1, prompt=0, pos=pos, ref_tok=5, out_tok=6, logit_ref=3.0,
             logit_out=3.0 - below_top, gap=below_top, below_top=below_top, top2_gap=below_top, top5=[5, 6],
             near_tie=below_top <= noise)
    r.update(kw)
    return r


def test_check_merged_compares_verdicts_and_floats_within_tolerance():
    """--check-merged's comparison: tolerant of machine noise, not of a changed verdict or count."""
    stored = _cls([_row(3, 0.05), _row(7, 1.5), _row(9, 0.195)])
    ok = AD.compare_classification(stored, _cls([_row(3, 0.0502), _row(7, 1.497), _row(9, 0.195)]), 0.2079)
    assert ok["problems"] == [] and ok["borderline"] == ["ddtree_b16 c=1 prompt 0 pos 9"]
    assert ok["verdict_flips_at_recomputed_noise"] == 0
    assert ok["groups"]["ddtree_b16"]["recomputed"]["error"] == 1
    # a row at the threshold (|0.195 - 0.2| <= GAP_ATOL) may flip; the error count moves with it
    again = _cls([_row(3, 0.05), _row(7, 1.5), _row(9, 0.203, noise=0.2)])
    assert again["arms"]["ddtree_b16"]["error"] == 2
    assert AD.compare_classification(stored, again, 0.2)["problems"] == []
    # beyond the tolerances: a float, the noise, a verdict away from the threshold, a count, a row
    bad = {
        "float": (_cls([_row(3, 0.05), _row(7, 1.5 + 2 * AD.GAP_ATOL), _row(9, 0.195)]), 0.2),
        "noise": (_cls([_row(3, 0.05), _row(7, 1.5), _row(9, 0.195)]), 0.2 * (1 + 1.5 * AD.NOISE_RTOL)),
        "verdict": (_cls([_row(3, 0.05, near_tie=False), _row(7, 1.5), _row(9, 0.195)]), 0.2),
        "tokens": (_cls([_row(3, 0.05, out_tok=9), _row(7, 1.5), _row(9, 0.195)]), 0.2),
        "rows": (_cls([_row(3, 0.05), _row(9, 0.195)]), 0.2),
    }
    for what, (again, noise) in bad.items():
        assert AD.compare_classification(stored, again, noise)["problems"], what
    # verdicts under this machine's own calibration are reported, not required
    low = AD.compare_classification(stored, _cls([_row(3, 0.05), _row(7, 1.5), _row(9, 0.195)]), 0.19)
    assert low["problems"] == [] and low["verdict_flips_at_recomputed_noise"] == 1
