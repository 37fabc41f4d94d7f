"""Report checks, not code tests: the worker's lossless matrices in bench/results/ (worker_h200*.md,
int4_mla_h200.md, kimicost_h200.md) are what ``bench/worker_report.py`` renders from the committed raw
records of the GPU test bed, byte for byte, and those records say what the reports claim (every
stage token-identical, the stages that left no result named).  They read committed files, so they
pass whatever the kernels or the worker do today: no claim about the code rests on them.

Each check must be able to fail: ``test_check_fails_on_a_corrupted_copy`` runs it on a copy of just
the files it reads with one record changed (a stage whose outputs left the chain, a text divergence
classified an error, a stage killed at its cap that finished), and requires an AssertionError (a
renderer crash does not count); the ``_rerendered`` controls also replace the committed markdown with
the changed records' own rendering, so the claims on the records, not only the byte comparison, are
shown to catch it."""
import json
import os
import shutil

import pytest

from reportlib import (RAW, RES, REPO, assert_fails_on_a_corrupted_copy, reads, replace_text, resolve, run_script,
                       set_json, stage_left_the_chain)

pytestmark = pytest.mark.report


def _worker_report(root, tmp, name, summaries, records, divergence=None, ab=None):
    """bench/worker_report.py on the records under root -> (OUT_PREFIX, its JSON)."""
    out = os.path.join(str(tmp), name)
    args = [os.path.join(REPO, "bench", "worker_report.py"), out,
            ",".join(resolve(root, f"{RAW}/{s}") for s in summaries)] + [resolve(root, f"{RAW}/{r}") for r in records]
    if divergence:
        args += ["--divergence", resolve(root, f"{RES}/{divergence}")]
    if ab:
        args += ["--ab", resolve(root, f"{RES}/{ab}")]
    run_script(args, timeout=120)
    return out, json.load(open(out + ".json"))


def _assert_same_md(out, root, md):
    assert open(out + ".md").read() == open(resolve(root, f"{RES}/{md}")).read(), f"{md} differs from its re-rendering"


def _assert_all_exact(stages):
    """Every stage token-identical on its bs16, bs1, mixed and sampled checks (the plain target's
    stages run no sampled check)."""
    for s in stages:
        assert s["bs16_exact"] and s["bs1_exact"] and s["mixed_exact"], s["stage"]
        assert s["sampled_exact"] or (s["algo"] == "base" and s["sampled_exact"] is None), s["stage"]


class Matrix:
    """One worker_report.py rendering: its inputs, and the committed markdown it must equal."""

    def __init__(self, name, summaries, records, md, divergence=None, ab=None):
        self.name, self.summaries, self.records, self.md = name, summaries, records, md
        self.divergence, self.ab = divergence, ab
        self.reads = tuple([f"{RAW}/{f}" for f in summaries + records] + [f"{RES}/{f}" for f in (divergence, ab, md) if f])

    def render(self, root, tmp):
        return _worker_report(root, tmp, self.name, self.summaries, self.records, self.divergence, self.ab)


def matrix(m):
    """check(root, tmp): the re-rendering of ``m`` equals its committed markdown, then the decorated
    function's claims hold on the rendered JSON."""
    def wrap(claims):
        def check(root, tmp):
            out, doc = m.render(root, tmp)
            _assert_same_md(out, root, m.md)
            claims(doc)
        check.reads, check.matrix, check.__doc__, check.__name__ = m.reads, m, claims.__doc__, claims.__name__
        return check
    return wrap


@matrix(Matrix("w", ["worker_h200_toy_run2_summary.txt"],
               ["worker_h200_toy_run2.jsonl.gz", "worker_h200_text_run4.jsonl", "worker_h200_text_run6.jsonl.gz"],
               "worker_h200.md", divergence="text_divergence_h200.json"))
def check_worker_h200(doc):
    """bench/results/worker_h200.md: the toy pairs at every budget, eager and graph, token-identical;
    the text pair's divergences near ties, except the stage without the tree-mask patch."""
    assert doc["all_ok"]
    budgets = {(s["pair"], s["mode"], s["budget"]) for s in doc["stages"] if s["algo"] == "ddtree"}
    assert {(p, m, b) for p in ("gqa", "mla") for m in ("eager", "graph") for b in (8, 16, 32, 64)} <= budgets
    assert {s["algo"] for s in doc["stages"]} == {"base", "ddtree", "ddtreecpu"}
    _assert_all_exact(doc["stages"])
    text = {s["stage"]: s for s in doc["text_pair"]}
    assert text["text_ddtree_graph_b16_nomaskpatch"]["errors"] >= 10   # the check has power
    for name, s in text.items():
        if name.startswith(("text_ddtree", "text_dflash")) and "nomaskpatch" not in name and s["requests"]:
            assert s["errors"] == 0, name


def test_report_worker_h200_matrix(tmp_path):
    check_worker_h200(REPO, tmp_path)


@reads(f"{RAW}/int4_mla_h200_run1_summary.txt", f"{RAW}/int4_mla_h200_run1.jsonl",
       f"{RAW}/int4_mla_h200_run2_summary.txt", f"{RAW}/int4_mla_h200_run2.jsonl")
def check_int4_unfinished_stages(root, tmp):
    """INT4 run 1: the Marlin stages hit their cap inside Marlin's JIT build; the report must say so
    and not call the run a pass (run 2's logprobs stage, no worker stage, is not counted)."""
    _, doc = _worker_report(root, tmp, "i1", ["int4_mla_h200_run1_summary.txt"], ["int4_mla_h200_run1.jsonl"])
    assert not doc["all_ok"]
    gone = {m["stage"]: m["rc"] for m in doc["unfinished"]}
    assert gone.get("mlaint4_ddtree_graph_b16") == 124 and gone.get("mlaint4_ddtree_eager_b8") == 137, gone
    assert "mlaint4_ddtree_graph_b16_moetriton" not in gone
    _, doc2 = _worker_report(root, tmp, "i2", ["int4_mla_h200_run2_summary.txt"], ["int4_mla_h200_run2.jsonl"])
    assert doc2["unfinished"] == [] and doc2["all_ok"]


def test_report_int4_names_stages_that_left_no_result(tmp_path):
    check_int4_unfinished_stages(REPO, tmp_path)


@matrix(Matrix("i12k", ["int4_mla_h200_run1_summary.txt", "int4_mla_h200_run2_summary.txt",
                          "kimicost_h200_run1_summary.txt"],
               ["int4_mla_h200_run1.jsonl", "int4_mla_h200_run2.jsonl", "kimicost_h200_run1.jsonl"],
               "int4_mla_h200.md", ab="ab_h200_kimicost.json"))
def check_int4_matrix(doc):
    """bench/results/int4_mla_h200.md: INT4 runs 1+2 (toy widths), the Kimi-cost stages (K2 widths)
    and the Kimi-cost A/B's ratio table (issue 14's done-when names this one file)."""
    assert doc["all_ok"] and doc["unfinished"] == []
    ab = {row["arm"]: row for row in doc["ab"][0]["rows"]}
    assert set(ab) == {"base", "dflash", "ddtree_b16", "ddtree_b16_vattn"}
    for arm, row in ab.items():
        assert set(row["levels"]) == {1, 4, 16, 64} or set(row["levels"]) == {"1", "4", "16", "64"}, arm
        assert all(v["tput"] for v in row["levels"].values()), arm
        if arm != "base":
            assert row["identity"].startswith("identical"), (arm, row["identity"])
    assert {"kimicost_base_graph", "kimicost_dflash_graph", "kimicost_ddtree_graph_b16"} <= {
        s["stage"] for s in doc["stages"] if s["moe_method"] == "CompressedTensorsWNA16MarlinMoEMethod"}
    st = {s["stage"]: s for s in doc["stages"]}
    for name, s in st.items():
        assert s["bs16_exact"] and s["bs1_exact"] and s["mixed_exact"], name
    marlin = {n for n, s in st.items() if s["moe_method"] == "CompressedTensorsWNA16MarlinMoEMethod"}
    assert {"mlaint4_ddtree_graph_b8", "mlaint4_ddtree_graph_b16", "mlaint4_ddtree_graph_b32",
            "mlaint4_ddtree_eager_b8", "mlaint4_dflash_graph", "mlaint4_base_graph"} <= marlin
    assert st["mlaint4_ddtree_graph_b16_moetriton"]["moe_method"].startswith("CompressedTensorsWNA16TritonMoE")


def test_report_int4_matrix(tmp_path):
    check_int4_matrix(REPO, tmp_path)


@matrix(Matrix("w10", ["worker_h200_run10a_summary.txt", "worker_h200_run10b_summary.txt"],
               ["worker_h200_run10a.jsonl.gz", "worker_h200_run10b.jsonl.gz"], "worker_h200_run10.md",
               divergence="text_divergence_h200_run10.json"))
def check_worker_run10(doc):
    """Run 10 (session 8): the worker after the round split, the adaptive budget's forced widths
    (_cycle) and policy (_auto), and our verify attention (_vattn), which needs no tree-mask patch:
    the _nomaskpatch_vattn text stage must be free of errors where plain _nomaskpatch is not."""
    assert doc["all_ok"] and doc["unfinished"] == []
    names = {s["stage"] for s in doc["stages"]}
    assert {"gqa_ddtree_graph_b16_vattn", "mla_ddtree_graph_b64_vattn", "gqa_ddtree_graph_b31_cycle",
            "mla_ddtree_graph_b31_cycle", "gqa_ddtree_graph_b16_auto"} <= names
    _assert_all_exact(doc["stages"])
    text = {s["stage"]: s for s in doc["text_pair"]}
    assert text["text_ddtree_graph_b16_nomaskpatch_vattn"]["requests"] == 16
    for name, s in text.items():
        assert s["errors"] == 0, name
    http = {h["stage"]: h for h in doc["http"]}
    assert http["http_mla_ddtree"]["logprob_handled"] and http["http_mla_ddtree_metrics"]["ok"]


def test_report_worker_run10(tmp_path):
    check_worker_run10(REPO, tmp_path)


@matrix(Matrix("k1", ["kimicost_h200_run1_summary.txt"], ["kimicost_h200_run1.jsonl"], "kimicost_h200.md"))
def check_kimicost_matrix(doc):
    """Issue 14 item 3's pair (K2 widths, INT4 Marlin experts): every arm token-identical to the chain,
    and the server log names the Marlin MoE method for each."""
    assert doc["all_ok"]
    st = {s["stage"]: s for s in doc["stages"]}
    assert set(st) == {"kimicost_base_graph", "kimicost_dflash_graph", "kimicost_ddtree_graph_b16",
                       "kimicost_ddtree_graph_b16_vattn"}
    for name, s in st.items():
        assert s["bs16_exact"] and s["bs1_exact"] and s["mixed_exact"], name
        assert s["moe_method"] == "CompressedTensorsWNA16MarlinMoEMethod", name


def test_report_kimicost_matrix(tmp_path):
    check_kimicost_matrix(REPO, tmp_path)


@matrix(Matrix("w11", ["worker_h200_run11_summary.txt"], ["worker_h200_run11.jsonl"], "worker_h200_run11.md"))
def check_worker_run11(doc):
    """Run 11: the first GPU run with patches/triton_cuda_graph_state.py (commit bfeba5a): MLA budget 31
    with forced widths (four verify backends), MLA with our verify attention (its workspace now
    comes from the resized scratch), GQA budget 16, all exact."""
    assert doc["all_ok"] and doc["unfinished"] == []
    assert {s["stage"] for s in doc["stages"]} == {"mla_ddtree_graph_b31_cycle", "mla_ddtree_graph_b16_vattn",
                                                  "gqa_ddtree_graph_b16"}
    _assert_all_exact(doc["stages"])


def test_report_worker_run11(tmp_path):
    check_worker_run11(REPO, tmp_path)


@matrix(Matrix("w14", ["worker_h200_run14_summary.txt"], ["worker_h200_run14.jsonl.gz"], "worker_h200_run14.md",
               divergence="text_divergence_h200_run14.json"))
def check_worker_run14(doc):
    """Run 14 (session 10): the first GPU run of the K/V commit by req_to_token permutation (d63d41b):
    GQA graph b16, GQA eager b8 and MLA graph b31 with forced widths exact; the text pair's
    divergences (bs16 and mixed) all near ties."""
    assert doc["all_ok"] and doc["unfinished"] == []
    assert {s["stage"] for s in doc["stages"]} == {"gqa_ddtree_graph_b16", "gqa_ddtree_eager_b8",
                                                  "mla_ddtree_graph_b31_cycle"}
    _assert_all_exact(doc["stages"])
    text = {s["stage"]: s for s in doc["text_pair"]}
    assert text["text_ddtree_graph_b16"]["errors"] == 0 and text["text_ddtree_graph_b16"]["mixed_exact"]


def test_report_worker_run14(tmp_path):
    check_worker_run14(REPO, tmp_path)


@matrix(Matrix("w12", ["worker_h200_run12a_summary.txt", "worker_h200_run12b_summary.txt"],
               ["worker_h200_run12a.jsonl", "worker_h200_run12b.jsonl.gz"], "worker_h200_run12.md",
               divergence="text_divergence_h200_run12.json"))
def check_worker_run12(doc):
    """Run 12 (session 9): DDTREE-GPU with --attention-backend flashinfer (prefill on flashinfer, verify
    on triton through SGLang's hybrid split): GQA graph b16 / eager b8 and MLA eager b16 / graph b16 with
    our verify attention exact; the text pair's divergences all near ties; the MLA graph stage without
    our verify attention and the fa3 stage left no result (the report lists them)."""
    st = {s["stage"]: s for s in doc["stages"]}
    assert set(st) == {"gqa_ddtree_graph_b16_flashinfer", "gqa_ddtree_eager_b8_flashinfer",
                       "mla_ddtree_eager_b16_flashinfer", "mla_ddtree_graph_b16_flashinfer_vattn"}
    _assert_all_exact(st.values())
    assert {u["stage"] for u in doc["unfinished"]} >= {"mla_ddtree_graph_b16_flashinfer", "gqa_ddtree_graph_b16_fa3"}
    text = {s["stage"]: s for s in doc["text_pair"]}
    assert text["text_ddtree_graph_b16_flashinfer"]["errors"] == 0


def test_report_worker_run12(tmp_path):
    check_worker_run12(REPO, tmp_path)


@matrix(Matrix("w13", ["worker_h200_run13_summary.txt"], ["worker_h200_run13.jsonl.gz"], "worker_h200_run13.md",
               divergence="text_divergence_h200_run13.json"))
def check_worker_run13(doc):
    """Run 13 (session 10): the two flashinfer stages run 12 left open.  MLA graph b16 with
    --attention-backend flashinfer (no verify attention of ours) exact; the text pair b16 under
    flashinfer: every bs16 divergence a near tie, and the mixed check's request 7, which ran to 15
    tokens where the reference stops at 4 (run 12 too), leaves the reference at position 2: a near tie
    that bench/text_divergence.py classifies from the stage's mixed_outputs (its logit distance is
    recomputed on this CPU in test_report_text_recompute.py)."""
    st = {s["stage"]: s for s in doc["stages"]}
    assert set(st) == {"mla_ddtree_graph_b16_flashinfer"}
    s = st["mla_ddtree_graph_b16_flashinfer"]
    assert s["bs16_exact"] and s["bs1_exact"] and s["mixed_exact"] and s["sampled_exact"] and s["repeat_exact"]
    text = {s["stage"]: s for s in doc["text_pair"]}
    fi = text["text_ddtree_graph_b16_flashinfer"]
    assert fi["errors"] == 0 and fi["diverged"] == fi["near_ties"] == 5
    assert {(m["request"], m["position"]) for m in fi["mixed_mismatches"]} == {(7, 2), (14, 23)}
    assert all(m["near_tie"] for m in fi["mixed_mismatches"])


def test_report_worker_run13(tmp_path):
    check_worker_run13(REPO, tmp_path)


def rerendered(check, corrupt):
    """``corrupt``, then the committed markdown replaced by the corrupted records' own rendering (as if
    a bad run had been committed with its report): the check's claims, not its byte comparison,
    must catch it."""
    def both(root):
        corrupt(root)
        tmp = os.path.join(root, "rerender")
        os.makedirs(tmp, exist_ok=True)
        out, _ = check.matrix.render(root, tmp)
        shutil.copy(out + ".md", resolve(root, f"{RES}/{check.matrix.md}"))
    return both


def _controls():
    out = {"int4_unfinished": (check_int4_unfinished_stages, replace_text(
        f"{RAW}/int4_mla_h200_run1_summary.txt", "[mlaint4_ddtree_eager_b8] rc=137", "[mlaint4_ddtree_eager_b8] rc=0")),
           "worker_h200_text": (check_worker_h200, set_json(f"{RES}/text_divergence_h200.json",
                                                           ["stages", "text_ddtree_graph_b16", "error"], 1))}
    lossy = {check_worker_h200: ("worker_h200_toy_run2.jsonl.gz", None),
             check_int4_matrix: ("int4_mla_h200_run2.jsonl", None),
             check_worker_run10: ("worker_h200_run10b.jsonl.gz", None),
             check_kimicost_matrix: ("kimicost_h200_run1.jsonl", "kimicost_ddtree_graph_b16_vattn"),
             check_worker_run11: ("worker_h200_run11.jsonl", None),
             check_worker_run14: ("worker_h200_run14.jsonl.gz", None),
             check_worker_run12: ("worker_h200_run12a.jsonl", None),
             check_worker_run13: ("worker_h200_run13.jsonl.gz", None)}
    for check, (rec, stage) in lossy.items():
        name = check.__name__[len("check_"):]
        corrupt = stage_left_the_chain(f"{RAW}/{rec}", stage)
        out[name] = (check, corrupt)
        out[name + "_rerendered"] = (check, rerendered(check, corrupt))
    out["worker_h200_text_rerendered"] = (check_worker_h200, rerendered(check_worker_h200, out["worker_h200_text"][1]))
    return out


CONTROLS = _controls()


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_check_fails_on_a_corrupted_copy(name, tmp_path):
    """The check passes on a faithful copy of the files it declares, and fails once one record is
    changed."""
    assert_fails_on_a_corrupted_copy(*CONTROLS[name], tmp_path)
