"""Turn test-bed results (results.jsonl of bench/device/run_stages.sh) into the worker's lossless
matrix: bench/results/worker_h200.json + worker_h200.md.

usage: python bench/worker_report.py OUT_PREFIX SUMMARY_TXT[,SUMMARY_TXT...] RESULTS_JSONL [RESULTS_JSONL ...]
           [--divergence TEXT_DIVERGENCE_JSON] [--ab AB_JSON ...]
(later files override earlier records of the same stage; a RESULTS_JSONL may be gzipped, ``.jsonl.gz``).  Toy-pair stages (gqa, mla) are strict
token-identity checks; text-pair stages are reported with bench/text_divergence.py's
classification of every divergence (near tie or error, by the rule that file records); ``--ab``
appends an A/B report's ratio table (sglang_ddtree.ab.report.render_summary).  Every number in the table is read from
the records; nothing is typed in by hand.
"""
import json
import os
import re
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rawio import open_maybe_gz  # noqa: E402


def load(paths):
    recs = OrderedDict()
    for p in paths:
        for line in open_maybe_gz(p):
            r = json.loads(line)
            recs[r["stage"]] = r
    return recs


def versions(summary):
    card, ver, date = None, None, None
    for line in open(summary):
        if line.startswith("versions:"):
            ver = line.strip()[len("versions: "):]
        if "H200" in line and "MiB" in line:
            card = line.strip()
        m = re.match(r"== start (\S+)", line)
        if m:
            date = m.group(1)
    return card, ver, date


# stages that write a STAGE_RESULT record (stage.py, http_client.py); others (A/B, logprobs, ...) report elsewhere
RECORDED = re.compile(r"^((gqa|mla|mlaint4|mlaint4ref|text)_(base|dflash|ddtree|ddtreecpu)_|http_)")


def moe_methods(summaries):
    """{stage: the MoE method SGLang logged in that stage's log ("Using ...MoE..." line the test bed
    copies under the stage's summary line)}; later runs win."""
    out, cur = {}, None
    for summary in summaries:
        for line in open(summary):
            m = re.match(r"\[(\S+)\] rc=", line)
            if m:
                cur = m.group(1)
            elif line.startswith("-- group") or line.startswith("=="):
                cur = None
            elif cur and line.startswith("Using ") and "MoE" in line:
                out[cur] = line.strip()[len("Using "):]
    return out


def unfinished(summaries, recs):
    """[{stage, rc, took_s}] for every worker stage the runs started that left no record in any
    of them (killed at its cap: rc 124 / 137, or crashed before STAGE_RESULT)."""
    out = OrderedDict()
    for summary in summaries:
        for line in open(summary):
            m = re.match(r"\[(\S+)\] rc=(\d+) took (\d+)s", line)
            if m and m.group(1) not in recs and RECORDED.match(m.group(1)):
                out[m.group(1)] = OrderedDict(stage=m.group(1), rc=int(m.group(2)), took_s=int(m.group(3)))
    return list(out.values())


def mixed_mismatches(rec, tie_ctx, classified=None):
    """[{request, position, near_tie}] for every request of the mixed run that left the reference.
    ``classified``: bench/text_divergence.py's own rows for this stage's mixed check (it classifies
    each first divergence, length mismatches included, from the stage's ``mixed_outputs``); without
    them a mismatch counts as a tie only at a context where a bs16 divergence was one."""
    if classified:
        return [{"request": v["request"], "position": v["pos"], "near_tie": bool(v["near_tie"]), "classified": True}
                for v in sorted(classified, key=lambda v: v["request"])]
    return [{"request": i, "position": j, "near_tie": (i, j) in tie_ctx}
            for i, j in enumerate(rec.get("mixed_first_mismatch") or []) if j is not None]


def mixed_cell(row):
    if row["mixed_exact"] is not False:
        return row["mixed_exact"]
    mm = row["mixed_mismatches"]
    if mm and all(m["near_tie"] for m in mm):
        return "near ties at " + ", ".join(f"r{m['request']}:{m['position']}" for m in mm)
    def why(m):
        if m["near_tie"]:
            return ""
        # a length mismatch: the first differing token is unknown unless the stage kept the outputs
        # (then bench/text_divergence.py found equal tokens with a different length: an error)
        if isinstance(m["position"], str):
            return " (same tokens, length differs)" if m.get("classified") else " (length differs: unclassified)"
        return " (not a tie)"
    return "**NO** " + ", ".join(f"r{m['request']}:{m['position']}" + why(m) for m in mm)


def main():
    args = sys.argv[1:]
    div = None
    if "--divergence" in args:
        i = args.index("--divergence")
        div = json.load(open(args[i + 1]))
        del args[i:i + 2]
    ab_paths = []
    while "--ab" in args:  # A/B reports (sglang-ddtree-ab JSON) of the same pairs: their ratio tables
        i = args.index("--ab")
        ab_paths.append(args[i + 1])
        del args[i:i + 2]
    out, summary, paths = args[0], args[1], args[2:]
    recs = load(paths)
    text = {n: r for n, r in recs.items() if n.startswith("text_")}
    recs = OrderedDict((n, r) for n, r in recs.items() if not n.startswith("text_"))
    summaries = summary.split(",")   # several runs: versions and date of the last
    card, ver, date = versions(summaries[-1])
    missing = unfinished(summaries, set(recs) | set(text))
    moe = moe_methods(summaries)
    rows = []
    for name, r in sorted(recs.items()):
        if name.startswith("http_"):
            continue
        rows.append(OrderedDict(
            stage=name, pair=r.get("pair"), algo=r.get("algo"), mode=r.get("mode"),
            budget=r.get("budget"), ok=r.get("ok"), bs16_exact=r.get("matches_target_greedy"),
            repeat_exact=r.get("repeat_identical"), bs1_exact=r.get("bs1_matches"),
            mixed_exact=r.get("mixed_matches"), sampled_exact=r.get("sampled_matches"),
            accept_bs16=r.get("accept_len_bs16_mean"), accept_bs1=r.get("accept_len_bs1"),
            ms_per_round_bs1=r.get("ms_per_round_bs1"), error=r.get("error"), moe_method=moe.get(name),
            sync_check=(None if "sync_check_rounds" not in r else
                        f"{r['sync_check_rounds_with_sync']}/{r['sync_check_rounds']} rounds with a sync "
                        f"({r['sync_check_total_syncs']} in all; sites {r.get('sync_check_sites')})")))
    http = [OrderedDict((k, r.get(k)) for k in (
        "stage", "ok", "generate_ids_match", "accept_len", "concurrent_match", "abort_ok",
        "after_abort_match", "stream_match", "logprob_handled", "bad_logprob_rejected", "logprob_served",
        "bad_temperature_rejected", "healthy_after_bad_input", "generate_text_status", "completions_status", "error"))
        for n, r in sorted(recs.items()) if n.startswith("http_")]
    for h in http:  # records before the log-probabilities went on by default: every server refused them
        if h["logprob_handled"] is None:
            h["logprob_handled"] = h["bad_logprob_rejected"]
    # Contexts (request, position) where a classified bs16 divergence of this run found the fp32
    # target's top-2 in a near tie; a mixed-run mismatch at the same context (same prompt, same
    # reference prefix) is the same near tie.
    divs = (div or {}).get("divergences", [])
    tie_ctx = {(v["request"], v["pos"]) for v in divs if v.get("near_tie") and v.get("check", "bs16") == "bs16"}
    text_rows = []
    for name, r in sorted(text.items()):
        d = (div or {}).get("stages", {}).get(name, {})
        text_rows.append(OrderedDict(
            stage=name, algo=r.get("algo"), mode=r.get("mode"), budget=r.get("budget"),
            requests=d.get("requests"), diverged=d.get("diverged"), near_ties=d.get("near_tie"),
            errors=d.get("error"), mixed_exact=r.get("mixed_matches"),
            mixed_mismatches=mixed_mismatches(r, tie_ctx, [v for v in divs if v["stage"] == name
                                                             and v.get("check") == "mixed"]),
            sampled_ok=r.get("sampled_matches"), accept_bs16=r.get("accept_len_bs16_mean"),
            accept_bs1=r.get("accept_len_bs1"), ms_per_round_bs1=r.get("ms_per_round_bs1")))
    doc = {"card": card, "versions": ver, "date": date, "stages": rows, "http": http,
           "text_pair": text_rows, "text_tie_threshold": (div or {}).get("tie_threshold_logits"),
           "text_tie_rule": (div or {}).get("tie_rule"),
           "unfinished": missing,
           "all_ok": all(r["ok"] for r in rows) and all(h["ok"] for h in http) and not missing}
    ab_docs = [(os.path.basename(p), json.load(open(p))) for p in ab_paths]
    if ab_docs:
        from sglang_ddtree.ab.report import render_summary, summary_rows

        doc["ab"] = [{"source": name, "rows": summary_rows(d)} for name, d in ab_docs]
    json.dump(doc, open(out + ".json", "w"), indent=1)

    def f(v):
        return "-" if v is None else ("yes" if v is True else ("**NO**" if v is False else str(v)))
    md = [f"# DDTree worker: lossless matrix on the GPU host\n",
          f"Card: {card}  ",
          f"Versions: {ver}  ",
          f"Date: {date} (from the run's summary.txt); produced by `bench/worker_report.py` from the "
          f"test bed's results.jsonl (`bench/device/stage.py`, `bench/device/http_client.py`).\n",
          "Every stage runs an SGLang `Engine` and compares token ids with the target's own greedy output "
          "(the toy targets' known chain; the text pair's plain-target run). bs16: 16 prompts x 96 tokens; "
          "repeat: the same with radix-cache hits; bs1: 256 tokens; mixed: 16 requests finishing inside a "
          "round (max_new_tokens 1..31, stop tokens, EOS); sampled: temperature 0.7 / top-k 20 through the "
          "tree's target-only sampling (the toy margin makes it equal the greedy chain). accept = tokens per "
          "verify round (completion_tokens / spec_verify_ct).\n",
          "| stage | pair | algo | mode | budget | bs16 | repeat | bs1 | mixed | sampled | accept bs16 | accept bs1 | ms/round bs1 |"
          + (" MoE method (server log) |" if moe else ""),
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if moe else "")]
    cols = ("stage", "pair", "algo", "mode", "budget", "bs16_exact", "repeat_exact", "bs1_exact", "mixed_exact",
            "sampled_exact", "accept_bs16", "accept_bs1", "ms_per_round_bs1") + (("moe_method",) if moe else ())
    for r in rows:
        md.append("| " + " | ".join(f(r[k]) for k in cols) + " |")
    if http:
        md += ["\n## HTTP server (`python -m sglang.launch_server --config configs/tiny_<pair>_ddtree.yaml`)\n",
               "| stage | ok | /generate exact | accept | 16 concurrent, staggered | abort | exact after abort | stream | return_logprob as expected | bad temperature 4xx | healthy after bad input |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for h in http:
            md.append("| " + " | ".join(f(h[k]) for k in (
                "stage", "ok", "generate_ids_match", "accept_len", "concurrent_match", "abort_ok",
                "after_abort_match", "stream_match", "logprob_handled", "bad_temperature_rejected",
                "healthy_after_bad_input")) + " |")
        md.append("\nreturn_logprob as expected: DFLASH servers refuse it; DDTREE servers refused it in records made "
                  "before log-probabilities went on by default (2026-12-01, session 7) and serve it after "
                  "(token ids and log-probs checked).")
    if missing:
        md += ["\n## Stages that left no result (killed at their cap or crashed)\n",
               "| stage | rc | ran (s) |", "|---|---:|---:|"]
        md += [f"| {m['stage']} | {m['rc']} | {m['took_s']} |" for m in missing]
    md.append(f"\nAll toy-pair and HTTP stages passed: {f(doc['all_ok'])}")
    syncs = [(r["stage"], r["sync_check"]) for r in rows if r.get("sync_check")]
    if syncs:
        md.append("\nHost synchronisations inside DDTree rounds (torch CUDA sync debug mode, `_synccheck` "
                  "stages): " + "; ".join(f"{n}: {v}" for n, v in syncs))
    if text_rows:
        md += ["\n## The text-trained pair (bench/textpair): real attention, bf16 near-ties\n",
               "Reference: the plain target's own greedy output (`text_base_graph`, cold run). Its bf16 greedy "
               "output is not unique: the same plain target differs from itself between a cold and a "
               "radix-cached run. So every first divergence is classified by `bench/text_divergence.py` with "
               "the fp32 reference forward: near tie = " + (
                   f"both tokens' logits within {doc['text_tie_threshold']} of the target's top logit"
                   if doc.get("text_tie_rule") == "below_top" else
                   f"the target's own top-2 are exactly the two tokens, logit gap <= {doc['text_tie_threshold']}")
               + "; error = anything else "
               "(the `--divergence` file's markdown lists each one). The `_nomaskpatch` stage runs the "
               "target verify graph captured WITHOUT the tree mask (the classic bug): it must show errors"
               + (", unless it is also `_vattn` (our verify attention reads the tree's bitmask, not that mask). "
                  if any("nomaskpatch" in r["stage"] and "vattn" in r["stage"] for r in text_rows) else ". ") +
               "mixed: exact, or the first mismatch of each request (r<request>:<position>) and whether it "
               "sits at a context where a classified bs16 divergence of this run is a near tie.\n",
               "| stage | algo | mode | budget | diverged / requests | near ties | errors | mixed | sampled runs | accept bs16 | accept bs1 | ms/round bs1 |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in text_rows:
            md.append("| " + " | ".join(f(x) for x in (
                r["stage"], r["algo"], r["mode"], r["budget"],
                f"{r['diverged']} / {r['requests']}" if r["requests"] is not None else None,
                r["near_ties"], r["errors"], mixed_cell(r), r["sampled_ok"], r["accept_bs16"],
                r["accept_bs1"], r["ms_per_round_bs1"])) + " |")
    for name, d in ab_docs:
        meta = d.get("meta") or {}
        md += [f"\n## Production cost: the A/B (`bench/results/{name[:-5] if name.endswith('.json') else name}.md`; it has the latency, "
               "stage split and identity tables)\n",
               f"{meta.get('date', '')} · {', '.join(meta.get('gpu') or []) if isinstance(meta.get('gpu'), list) else meta.get('gpu', '')} · commit {meta.get('git_commit', '')}"
               f"{' (dirty)' if meta.get('git_dirty') else ''}. Output tok/s per concurrency (x the same "
               "run's base), accepted tokens per verify round, token identity against base.\n"]
        if not (d.get("settings") or {}).get("pair"):  # a user-style run (--model-path): name it by the model
            d = dict(d, settings=dict(d["settings"], pair=os.path.basename(
                str(d["settings"].get("model_path") or "model").rstrip("/"))))
        md += render_summary(d, "###")
    open(out + ".md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
