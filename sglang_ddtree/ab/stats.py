"""Statistics: percentiles, one level's aggregate (sglang.bench_serving's field names), the per-stage
profile records of the DDTREE arms, the token-identity check against the reference arm, and the choice
of the median repeat."""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Dict, List, Optional

STAGES = ("draft", "tree", "verify_prep", "verify", "accept", "commit")


# ------------------------------------------------------------------------------------------ stats
def pct(xs, q):
    """numpy's default (linear) percentile; None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def _ms(x):
    return None if x is None else round(1000.0 * x, 3)


def ids_sha(ids) -> Optional[str]:
    return None if ids is None else hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


def aggregate_level(c: int, results: List[dict], duration: float, prompts: List[dict], partial: bool) -> dict:
    ok = [r for r in results if r and r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    lat = [r["latency"] for r in ok]
    cts = [r["meta"].get("completion_tokens", len(r["output_ids"] or [])) for r in ok]
    vcts = [r["meta"].get("spec_verify_ct") or 0 for r in ok]
    tpot = [(r["latency"] - r["ttft"]) / (n - 1) for r, n in zip(ok, cts) if n > 1 and r["ttft"] is not None]
    steps = [((r["latency"] - r["ttft"]) / (v if v else max(1, n - 1))) for r, n, v in zip(ok, cts, vcts)
             if r["ttft"] is not None and n > 1]
    total_out = sum(cts)
    total_in = sum(r["meta"].get("prompt_tokens", 0) for r in ok)
    lv = dict(
        concurrency=c, num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        partial=partial, duration=round(duration, 4), total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=round(len(ok) / duration, 4) if duration > 0 else None,
        output_throughput=round(total_out / duration, 3) if duration > 0 else None,
        mean_ttft_ms=_ms(mean(ttft)), median_ttft_ms=_ms(pct(ttft, 50)), p99_ttft_ms=_ms(pct(ttft, 99)),
        mean_tpot_ms=_ms(mean(tpot)), median_tpot_ms=_ms(pct(tpot, 50)), p99_tpot_ms=_ms(pct(tpot, 99)),
        mean_itl_ms=_ms(mean(itl)), median_itl_ms=_ms(pct(itl, 50)), p90_itl_ms=_ms(pct(itl, 90)),
        p99_itl_ms=_ms(pct(itl, 99)), max_itl_ms=_ms(max(itl) if itl else None),
        mean_e2e_latency_ms=_ms(mean(lat)), median_e2e_latency_ms=_ms(pct(lat, 50)), p99_e2e_latency_ms=_ms(pct(lat, 99)),
        accept_length=round(total_out / sum(vcts), 4) if sum(vcts) else None,
        spec_verify_ct=sum(vcts), ms_per_step=_ms(mean(steps)),
        tokens_per_chunk=round(total_out / max(1, sum(r["n_chunks"] for r in ok)), 3),
        cached_tokens=sum(r["meta"].get("cached_tokens", 0) or 0 for r in ok),
        errors=[r["error"] for r in results if r and not r["ok"]][:3],
        per_request=dict(
            prompt=list(range(len(results))),
            ttft_ms=[_ms(r["ttft"]) if r else None for r in results],
            latency_ms=[_ms(r["latency"]) if r else None for r in results],
            completion_tokens=[(r["meta"].get("completion_tokens") if r and r["ok"] else None) for r in results],
            spec_verify_ct=[(r["meta"].get("spec_verify_ct") if r and r["ok"] else None) for r in results],
            n_chunks=[r["n_chunks"] if r else None for r in results],
            finish_reason=[(r["meta"].get("finish_reason") if r and r["ok"] else None) for r in results],
            output_ids_sha1=[ids_sha(r["output_ids"]) if r and r["ok"] else None for r in results]),
    )
    return lv


# ------------------------------------------------------------------------------------------ profile
def read_profile(path: str) -> List[dict]:
    if not path or not os.path.isfile(path):
        return []
    out = []
    for line in open(path):
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written while we read
    return out


# = sglang_ddtree.profiling.IDLE_GAP_S (a pause longer than this closes a profile record; not imported:
# the A/B package runs without the rest of sglang_ddtree, tests/test_ab_cli.py; a test checks they agree)
STALL_S = 0.1


def aggregate_profile(recs: List[dict]) -> Optional[dict]:
    """Rounds-weighted mean of the per-record medians (stage_ms, round_ms, host_ms) and of bs_mean;
    ``gc``: the records' garbage collections summed per generation (count, ms) and the longest;
    ``stalls``: gaps of more than ``STALL_S`` between consecutive records (the end of one record's last
    round to the end of the next one's first: a pause with no round), their count and seconds, and
    the records' span."""
    recs = [r for r in recs if r.get("rounds")]
    if not recs:
        return None
    w = sum(r["rounds"] for r in recs)

    def wavg(get):
        vals = [(get(r), r["rounds"]) for r in recs if get(r) is not None]
        ww = sum(k for _, k in vals)
        return round(sum(v * k for v, k in vals) / ww, 4) if ww else None

    def per_stage(key):   # {stage: weighted median} of the stages the records have
        vals = {s: wavg(lambda r, s=s: ((r.get(key) or {}).get(s) or {}).get("median")) for s in STAGES}
        return {k: v for k, v in vals.items() if v is not None}

    out = dict(rounds=w, records=len(recs), pids=len({r.get("pid") for r in recs}),
               bs_mean=wavg(lambda r: r.get("bs_mean")),
               round_ms=wavg(lambda r: (r.get("round_ms") or {}).get("median")),
               host_ms=wavg(lambda r: (r.get("host_ms") or {}).get("median")),
               stage_ms=per_stage("stage_ms"))
    host_stages = per_stage("host_stage_ms")
    if host_stages:
        out["host_stage_ms"] = host_stages
    widths = sorted({int(k) for r in recs for k in (r.get("by_width") or {})})
    if widths:   # per verify width (adaptive arms): rounds summed, medians weighted by their rounds
        bw = {}
        for wd in widths:
            parts = [r["by_width"][str(wd)] for r in recs if str(wd) in (r.get("by_width") or {})]
            n = sum(p["rounds"] for p in parts)

            def pw(get, parts=parts, n=n):
                vals = [(get(p), p["rounds"]) for p in parts if get(p) is not None]
                ww = sum(k for _, k in vals)
                return round(sum(v * k for v, k in vals) / ww, 4) if ww else None
            bw[str(wd)] = dict(rounds=n, bs_mean=pw(lambda p: p.get("bs_mean")),
                               verify_ms=pw(lambda p: (p.get("verify_ms") or {}).get("median")),
                               round_ms=pw(lambda p: (p.get("round_ms") or {}).get("median")))
        out["by_width"] = bw
    timed = sorted((r["t_first"], r["t_last"]) for r in recs if r.get("t_first") is not None)
    gaps = [b[0] - a[1] for a, b in zip(timed, timed[1:])]
    if timed:   # pauses between rounds (a record closes at one longer than profiling.IDLE_GAP_S)
        long_ = [g for g in gaps if g > STALL_S]
        out["stalls"] = dict(n=len(long_), s=round(sum(long_), 3), span_s=round(timed[-1][1] - timed[0][0], 3))
    gcs = [r["gc"] for r in recs if isinstance(r.get("gc"), dict)]
    if gcs:   # the scheduler's garbage collections while these records' rounds ran (summed)
        out["gc"] = dict(n=[sum(g["n"][i] for g in gcs) for i in range(3)],
                         ms=[round(sum(g["ms"][i] for g in gcs), 3) for i in range(3)],
                         max_ms=max(g["max_ms"] for g in gcs))
    return out


# ------------------------------------------------------------------------------------------ identity
def first_diff(a, b) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity_check(arm_outputs: Dict[str, Dict[int, List]], ref: str) -> dict:
    """arm_outputs[arm][c] = list of output ids (None = failed).  Per arm: compared, mismatched,
    errors, by_concurrency, first examples (prompt, first differing index)."""
    res = {"reference": ref, "arms": {}}
    if ref not in arm_outputs:
        res["note"] = f"reference arm {ref!r} was not measured: no identity check"
        return res
    R = arm_outputs[ref]
    cs = sorted(R)
    if cs:  # the reference against itself across concurrency (batch-shape numerics)
        c0 = cs[0]
        sc = {}
        for c in cs[1:]:
            n = min(len(R[c]), len(R[c0]))
            sc[str(c)] = sum(1 for i in range(n) if R[c][i] is not None and R[c0][i] is not None
                             and R[c][i] != R[c0][i])
        res["reference_vs_own_first_level"] = dict(level=c0, mismatched_by_concurrency=sc)
    for arm, outs in arm_outputs.items():
        if arm == ref:
            continue
        d = dict(compared=0, mismatched=0, errors=0, by_concurrency={}, examples=[])
        for c, ids in sorted(outs.items()):
            if c not in R:
                continue
            m = 0
            for i, x in enumerate(ids):
                y = R[c][i] if i < len(R[c]) else None
                if x is None or y is None:
                    d["errors"] += 1
                    continue
                d["compared"] += 1
                if x != y:
                    m += 1
                    if len(d["examples"]) < 8:
                        d["examples"].append(dict(concurrency=c, prompt=i, first_diff=first_diff(x, y),
                                                  len_arm=len(x), len_ref=len(y)))
            d["by_concurrency"][str(c)] = m
            d["mismatched"] += m
        d["identical"] = d["compared"] > 0 and d["mismatched"] == 0
        res["arms"][arm] = d
    return res


def pick_repeat(reps):
    """The repeat of a level with the median output throughput (of the complete ones), its outputs,
    every repeat's throughput, and how many requests' outputs differ between repeats."""
    full = [r for r in reps if not r[0]["partial"]] or reps
    ranked = sorted(full, key=lambda r: r[0]["output_throughput"] or 0.0)
    lv, outs = ranked[(len(ranked) - 1) // 2]
    lv = dict(lv, repeats=len(reps), median_of=len(full),
              output_throughput_repeats=[r[0]["output_throughput"] for r in reps],
              repeat_output_mismatches=sum(1 for _, o in reps for i, x in enumerate(o)
                                           if x is not None and i < len(outs) and outs[i] is not None
                                           and x != outs[i]))
    return lv, outs

