"""Turn test-bed results (results.jsonl of bench/device/run_stages.sh) into the worker's lossless
matrix: bench/results/worker_h200.json + worker_h200.md.

usage: python bench/worker_report.py OUT_PREFIX SUMMARY_TXT RESULTS_JSONL [RESULTS_JSONL ...]
(later files override earlier records of the same stage).  Every number in the table is read from
the records; nothing is typed in by hand.
"""
import json
import re
import sys
from collections import OrderedDict


def load(paths):
    recs = OrderedDict()
    for p in paths:
        for line in open(p):
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


def main():
    out, summary, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    recs = load(paths)
    card, ver, date = versions(summary)
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
            ms_per_round_bs1=r.get("ms_per_round_bs1"), error=r.get("error")))
    http = [OrderedDict((k, r.get(k)) for k in (
        "stage", "ok", "generate_ids_match", "accept_len", "concurrent_match", "abort_ok",
        "after_abort_match", "stream_match", "bad_logprob_rejected", "bad_temperature_rejected",
        "healthy_after_bad_input", "generate_text_status", "completions_status", "error"))
        for n, r in sorted(recs.items()) if n.startswith("http_")]
    doc = {"card": card, "versions": ver, "date": date, "stages": rows, "http": http,
           "all_ok": all(r["ok"] for r in rows) and all(h["ok"] for h in http)}
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
          "| stage | pair | algo | mode | budget | bs16 | repeat | bs1 | mixed | sampled | accept bs16 | accept bs1 | ms/round bs1 |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append("| " + " | ".join(f(r[k]) for k in ("stage", "pair", "algo", "mode", "budget", "bs16_exact",
                                                        "repeat_exact", "bs1_exact", "mixed_exact", "sampled_exact",
                                                        "accept_bs16", "accept_bs1", "ms_per_round_bs1")) + " |")
    if http:
        md += ["\n## HTTP server (`python -m sglang.launch_server --config configs/tiny_<pair>_ddtree.yaml`)\n",
               "| stage | ok | /generate exact | accept | 16 concurrent, staggered | abort | exact after abort | stream | return_logprob rejected | bad temperature 4xx | healthy after bad input |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for h in http:
            md.append("| " + " | ".join(f(h[k]) for k in (
                "stage", "ok", "generate_ids_match", "accept_len", "concurrent_match", "abort_ok",
                "after_abort_match", "stream_match", "bad_logprob_rejected", "bad_temperature_rejected",
                "healthy_after_bad_input")) + " |")
    md.append(f"\nAll stages passed: {f(doc['all_ok'])}")
    open(out + ".md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
