"""Where a repeat's wall time goes: the plugin's rounds against the time between them, per A/B repeat.

    python bench/scale/round_gaps.py AB.json LOGS.tgz [--levels 16] [--arms a,b] [--out PREFIX]

AB.json: one A/B run (``python -m sglang_ddtree.ab``, not a merged file; plain or ``.json.gz``, as the
committed raw records are); LOGS.tgz: that run's logs
(the ``scalechain_logs_<shape>.tgz`` / ``ab_logs_<tag>.tgz`` a device call returns, holding each
DDTREE server's round-profile records ``profile_<server arm>.jsonl``).  For every DDTREE arm, level
and repeat: the rounds and request-rounds the profiler recorded, the sum of their round times (CUDA
events), the wall span of those rounds, and what is left of the span ("outside": prefills, the
scheduler between rounds, idle), the widest pause between two records, the verify widths run, and
the client's output tok/s of that repeat, and the prefill batches the server logged in it (its
log, between the cache flushes the A/B sends before every repeat) with the outside time per batch.

Which records belong to which repeat: the level's ``repeat_windows`` (wall clock, recorded by the A/B
since session 23) when present; for older runs a sequential split: the records of a server are
walked in time order through its warm-up (burst, then single requests) and then every arm served by
it, level by level, repeat by repeat.  A record never spans two repeats (the profiler closes one at
an idle gap, and the A/B flushes the cache and sleeps 0.2 s between repeats), so a repeat ends at a
record edge: the one whose running request-rounds come closest to the expected count (the reported
repeat's ``spec_verify_ct`` plus one round per request: the profiler also counts each request's
last round), preferring edges followed by a pause of at least ``--gap`` seconds.  The output says
which split each row used, and the request-rounds it got against that expectation.  This split is
sound while the repeats of a level differ in request-rounds by less than about half a record; a
mid-repeat pause (a drained batch) next to a repeat's edge, with repeats further apart than that,
can shift a boundary by one record (the request-rounds column shows it).  Runs with
``repeat_windows`` do not need it.

A record's ``t_first`` / ``t_last`` are taken at the end of its first / last round, so a repeat's
span misses its first round: outside = span - (round-time sum - the first record's mean round).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tarfile
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rawio import open_maybe_gz, record_name  # noqa: E402

PREFILL_RE = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+)")


def _log_files(path: str):
    """(base name, text) of every file in a logs tgz or an extracted folder."""
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            for f in files:
                with open(os.path.join(root, f), errors="replace") as fh:
                    yield f, fh.read()
    else:
        with tarfile.open(path) as tf:
            for m in tf.getmembers():
                if m.isfile():
                    yield os.path.basename(m.name), tf.extractfile(m).read().decode("utf-8", "replace")


def _prefills_of(text: str) -> List[dict]:
    """Per cache flush in one SGLang server log, the prefill batches logged until the next flush."""
    segs, cur = [], None
    for line in text.splitlines():
        if "Cache flushed successfully" in line:
            cur = {"batches": 0, "requests": 0, "tokens": 0}
            segs.append(cur)
            continue
        m = PREFILL_RE.search(line)
        if m and cur is not None:
            cur["batches"] += 1
            cur["requests"] += int(m.group(1))
            cur["tokens"] += int(m.group(2))
    return segs


def read_logs(path: str) -> Tuple[Dict[str, List[dict]], Dict[str, List[dict]]]:
    """One pass over a logs tgz (or folder): ({server arm: its round-profile records
    (``profile_<arm>.jsonl``) sorted by t_first}, {server arm: per cache flush, the prefill batches its
    SGLang log (``server_<arm>.log``) shows until the next flush}).  The A/B flushes the radix cache
    before every measured repeat, so the k-th flush entry is the server's k-th measured repeat (the
    last one also holds the short request that closes the round profile after the last level)."""
    profiles: Dict[str, List[dict]] = {}
    prefills: Dict[str, List[dict]] = {}
    for base, text in _log_files(path):
        if base.startswith("profile_") and base.endswith(".jsonl"):
            recs = [json.loads(x) for x in text.splitlines() if x.strip()]
            profiles[base[len("profile_"):-len(".jsonl")]] = sorted(
                (r for r in recs if "t_first" in r and "t_last" in r), key=lambda r: r["t_first"])
        elif base.startswith("server_") and base.endswith(".log"):
            prefills[base[len("server_"):-len(".log")]] = _prefills_of(text)
    return profiles, prefills


def _segments(doc: dict, server: str) -> List[dict]:
    """The run-order segments of one server: warm-up burst / single, then (arm, level, repeat)."""
    arms = [a for a in doc["arms"] if (a.get("server_of") or a["name"]) == server]
    segs = []
    head = next((a for a in arms if a["name"] == server), None)
    for key in ("burst", "single"):
        w = ((head or {}).get("warmup") or {}).get(key)
        if w and w.get("spec_verify_ct"):
            segs.append(dict(arm=server, level=f"warm-up {key}", repeat=0,
                             expected=w["spec_verify_ct"] + (w.get("completed") or w.get("num_requests") or 0),
                             window=None, tok_s=None))
    for a in arms:
        for lv in a.get("levels") or []:
            reps = lv.get("output_throughput_repeats") or [lv.get("output_throughput")]
            wins = lv.get("repeat_windows") or [None] * len(reps)
            for i, tput in enumerate(reps):
                exp = lv.get("spec_verify_ct")
                if exp is not None:
                    exp += lv.get("completed") or lv.get("num_requests") or 0
                segs.append(dict(arm=a["name"], level=lv["concurrency"], repeat=i + 1,
                                 expected=exp, window=wins[i] if i < len(wins) else None, tok_s=tput))
    return segs


def _request_rounds(r: dict) -> float:
    return r["rounds"] * r["bs_mean"]


def assign(segs: List[dict], recs: List[dict], gap_s: float = 0.15, pause_bonus: float = 0.05) -> None:
    """Give each segment its records (``seg["recs"]``, ``seg["split"]``): by window where every
    segment has one, else sequentially (module docstring): the end edge minimising
    |request-rounds - expected| / expected, + ``pause_bonus`` for an edge not followed by a pause."""
    if segs and all(s["window"] for s in segs if not str(s["level"]).startswith("warm-up")):
        for s in segs:
            w = s["window"]
            s["split"] = "window" if w else "none"
            s["recs"] = [] if not w else [r for r in recs if w[0] - 0.05 <= r["t_first"] and r["t_last"] <= w[1] + 0.05]
        return
    i = 0
    for s in segs:
        s["split"] = "sequential"
        want = float(s["expected"] or 0)
        best, best_j, acc = None, i, 0.0
        for j in range(i, len(recs)):
            acc += _request_rounds(recs[j])
            paused = j + 1 == len(recs) or recs[j + 1]["t_first"] - recs[j]["t_last"] >= gap_s
            score = abs(acc - want) / max(want, 1.0) + (0.0 if paused else pause_bonus)
            if best is None or score < best:
                best, best_j = score, j + 1
            if acc > 1.5 * want:
                break
        s["recs"] = recs[i:best_j]
        i = best_j


def summarize(seg: dict) -> dict:
    recs = seg["recs"]
    row = {k: seg[k] for k in ("arm", "level", "repeat", "split", "expected", "tok_s")}
    if not recs:
        return dict(row, records=0)
    rounds = sum(r["rounds"] for r in recs)
    round_ms = sum(r["rounds"] * r["round_ms"]["mean"] for r in recs)
    host_ms = sum(r["rounds"] * r["host_ms"]["mean"] for r in recs)
    span_ms = (recs[-1]["t_last"] - recs[0]["t_first"]) * 1000.0
    gaps = [(b["t_first"] - a["t_last"]) * 1000.0 for a, b in zip(recs, recs[1:])]
    widths: Dict[str, int] = {}
    for r in recs:
        for w, v in (r.get("by_width") or {}).items():
            widths[w] = widths.get(w, 0) + v["rounds"]
    return dict(row, records=len(recs), rounds=rounds, request_rounds=round(sum(map(_request_rounds, recs))),
                round_ms=round(round_ms, 1), host_ms=round(host_ms, 1), span_ms=round(span_ms, 1),
                outside_ms=round(span_ms - (round_ms - recs[0]["round_ms"]["mean"]), 1),
                max_gap_ms=round(max(gaps), 1) if gaps else 0.0,
                widths=dict(sorted(widths.items(), key=lambda kv: int(kv[0]))))


def analyse(doc: dict, profiles: Dict[str, List[dict]], arms: Optional[List[str]] = None,
            levels: Optional[List[int]] = None, gap_s: float = 0.15,
            prefills: Optional[Dict[str, List[dict]]] = None) -> List[dict]:
    rows = []
    for server, recs in profiles.items():
        segs = _segments(doc, server)
        if not segs:
            continue
        assign(segs, recs, gap_s)
        measured = [s for s in segs if not str(s["level"]).startswith("warm-up")]
        flushes = (prefills or {}).get(server) or []
        if len(flushes) == len(measured):    # one cache flush per measured repeat, in run order
            for s, f in zip(measured, flushes):
                s["prefill"] = f
        for s in segs:
            if arms and s["arm"] not in arms:
                continue
            if levels and s["level"] not in levels:
                continue
            row = summarize(s)
            if s.get("prefill"):
                row.update(prefill_batches=s["prefill"]["batches"], prefill_tokens=s["prefill"]["tokens"])
                if row.get("outside_ms") is not None and s["prefill"]["batches"]:
                    row["outside_per_prefill_ms"] = round(row["outside_ms"] / s["prefill"]["batches"], 2)
            rows.append(row)
    return rows


def level_summary(rows: List[dict], pause_ms: float = 250.0) -> List[dict]:
    """Per (arm, level) over its repeats: medians of round ms, outside ms and client tok/s, over every
    repeat and over the repeats whose widest pause is below ``pause_ms`` (a drained batch)."""
    out, groups = [], {}
    for r in rows:
        if r.get("records") and not str(r["level"]).startswith("warm-up"):
            groups.setdefault((r["arm"], r["level"]), []).append(r)
    for (arm, level), rs in groups.items():
        calm = [r for r in rs if r["max_gap_ms"] < pause_ms]

        def med(xs, key):
            vals = [x[key] for x in xs if x.get(key) is not None]
            return round(statistics.median(vals), 1) if vals else None
        out.append(dict(arm=arm, level=level, repeats=len(rs), calm=len(calm),
                        round_ms=med(rs, "round_ms"), outside_ms=med(rs, "outside_ms"), tok_s=med(rs, "tok_s"),
                        calm_round_ms=med(calm, "round_ms"), calm_outside_ms=med(calm, "outside_ms"),
                        calm_tok_s=med(calm, "tok_s"), prefill_batches=med(rs, "prefill_batches"),
                        calm_outside_per_prefill_ms=med(calm, "outside_per_prefill_ms")))
    return out


def render(rows: List[dict], title: str, summary: Optional[List[dict]] = None, pause_ms: float = 250.0) -> str:
    L = [f"# Round time against the time between rounds: {title}", "",
         "Made by `bench/scale/round_gaps.py` (see its docstring). ms summed over the repeat; outside = "
         "the wall span of the repeat's rounds minus their round time (prefills, scheduling, pauses).", "",
         "| arm | c | repeat | split | request-rounds (expected) | rounds | round ms | host ms | span ms | "
         "outside ms | widest pause ms | prefill batches (ms outside each) | widths | client tok/s |",
         "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if not r.get("records"):
            L.append(f"| {r['arm']} | {r['level']} | {r['repeat']} | {r['split']} | 0 ({r['expected']}) | - | - | - | - "
                     f"| - | - | - | - | {r['tok_s'] or '-'} |")
            continue
        w = ", ".join(f"{k}:{v}" for k, v in r["widths"].items())
        tok = "-" if r["tok_s"] is None else f"{r['tok_s']:.0f}"
        pf = "-" if r.get("prefill_batches") is None else (
            f"{r['prefill_batches']} ({r['outside_per_prefill_ms']:.1f})" if r.get("outside_per_prefill_ms") is not None
            else str(r["prefill_batches"]))
        L.append(f"| {r['arm']} | {r['level']} | {r['repeat']} | {r['split']} | {r['request_rounds']} "
                 f"({r['expected']}) | {r['rounds']} | {r['round_ms']:.0f} | {r['host_ms']:.0f} | {r['span_ms']:.0f} | "
                 f"{r['outside_ms']:.0f} | {r['max_gap_ms']:.0f} | {pf} | {w} | {tok} |")
    if summary:
        f = lambda v: "-" if v is None else f"{v:.0f}"   # noqa: E731
        L += ["", f"## Per level: medians over the repeats (all / the repeats whose widest pause is under "
                  f"{pause_ms:.0f} ms)", "",
              "| arm | c | repeats (calm) | round ms | outside ms | client tok/s | prefill batches (all) | "
              "outside ms per prefill batch (calm) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        g = lambda v: "-" if v is None else f"{v:.1f}"   # noqa: E731
        for r in summary:
            L.append(f"| {r['arm']} | {r['level']} | {r['repeats']} ({r['calm']}) | {f(r['round_ms'])} / "
                     f"{f(r['calm_round_ms'])} | {f(r['outside_ms'])} / {f(r['calm_outside_ms'])} | "
                     f"{f(r['tok_s'])} / {f(r['calm_tok_s'])} | {f(r['prefill_batches'])} | "
                     f"{g(r['calm_outside_per_prefill_ms'])} |")
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ab_json")
    ap.add_argument("logs", help="the run's logs tgz (or an extracted folder)")
    ap.add_argument("--arms", default=None, help="comma-separated arm names (default: every DDTREE arm)")
    ap.add_argument("--levels", default=None, help="comma-separated concurrencies (default: all)")
    ap.add_argument("--gap", type=float, default=0.15, help="seconds of pause that may end a repeat (sequential split)")
    ap.add_argument("--pause-ms", type=float, default=250.0,
                    help="a repeat whose widest pause reaches this is left out of the 'calm' medians")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    a = ap.parse_args(argv)
    with open_maybe_gz(a.ab_json) as f:
        doc = json.load(f)
    if doc.get("kind") == "ab_serve_merged":
        raise SystemExit(f"{a.ab_json}: a merged report; give one run's JSON (bench/results/raw/...)")
    profiles, prefills = read_logs(a.logs)
    rows = analyse(doc, profiles, a.arms.split(",") if a.arms else None,
                   [int(x) for x in a.levels.split(",")] if a.levels else None, a.gap, prefills)
    summary = level_summary(rows, a.pause_ms)
    md = render(rows, record_name(a.ab_json), summary, a.pause_ms)
    print(md, end="")
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write(md)
        with open(a.out + ".json", "w") as f:
            json.dump(dict(source=record_name(a.ab_json), logs=os.path.basename(a.logs), pause_ms=a.pause_ms,
                           rows=rows, levels=summary), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
