"""The report: markdown of a single or merged result, the summary tables (the README's), the plot
hook (:mod:`sglang_ddtree.ab.plot`), and writing JSON + MD (+ PNG)."""
from __future__ import annotations

import json
import os
from typing import List

from .stats import STAGES


# ------------------------------------------------------------------------------------------ report

def _spread_note(settings: dict) -> str:
    """" (x0.5-1.5 per prompt, the same in every arm)" when the run spread the output lengths."""
    f = float(settings.get("new_tokens_spread") or 0.0)
    return f" (x{1 - f:g}-{1 + f:g} per prompt, the same in every arm)" if f else ""


def _f(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _runs(doc):
    return doc["runs"] if doc.get("kind") == "ab_serve_merged" else [doc]


def _valid(lv) -> bool:
    """A complete level that was not marked invalid (``merge --invalid``: a measurement known to be broken)."""
    return bool(lv) and not lv.get("partial") and not lv.get("invalid")


def _level(arm, c):
    for lv in arm.get("levels") or []:
        if lv["concurrency"] == c:
            return lv
    return None


PAIR_TITLES = {"text": "text-trained pair (bench/textpair)", "gqa": "tiny GQA pair", "mla": "tiny MLA + MoE pair"}


def _identity_of(run, arm_name):
    """(is the reference arm, the arm's identity counts or None, its divergence classification or
    None) from a run's ``identity`` record."""
    idn = run.get("identity") or {}
    d = (idn.get("arms") or {}).get(arm_name)
    c = ((idn.get("classification") or {}).get("arms") or {}).get(arm_name)
    return arm_name == idn.get("reference"), d, c


def _identity_cell(run, arm_name):
    """'identical (n)', or 'k of n differ' (+ the text pair's classification)."""
    is_ref, d, c = _identity_of(run, arm_name)
    if is_ref:
        return "reference"
    if not d or not d.get("compared"):
        return "-"
    ref = (run.get("identity") or {}).get("reference")
    against = "" if ref in (None, "base") else f" vs {ref}"   # e.g. runs of the chain pairs without a base arm
    if not d["mismatched"]:
        return f"identical{against} ({d['compared']})"
    txt = f"{d['mismatched']} of {d['compared']} differ{against}"
    if c:
        txt += (f": all {c['near_tie']} near ties" if not c["error"] else
                f": {c['near_tie']} near ties, **{c['error']} errors**")
    return txt


def _lossless(run, arm_name) -> bool:
    """Outputs equal the reference's, or differ only at classified near ties (never an error)."""
    is_ref, d, c = _identity_of(run, arm_name)
    if is_ref:
        return True
    if not d or not d.get("compared"):
        return False
    if not d["mismatched"]:
        return True
    return bool(c) and not c["error"] and c["near_tie"] == d["mismatched"]


def recommendations(run: dict) -> List[dict]:
    """Per concurrency of one run: the fastest arm whose outputs are lossless (identical to the
    reference arm's, or bf16 near ties only) -> {c, arm, tput, x_base, x_dflash, best_ddtree}.
    ``best_ddtree``: the fastest lossless DDTREE-GPU arm (``ddtree_b<N>``), the budget to run at
    that load when speculating at all."""
    s = run.get("settings") or {}
    arms = [a for a in run.get("arms") or [] if a.get("status") != "skipped"]
    # arms pinned to one budget on an adaptive server (``_pin<B>``): fixed budgets (B > 0), not the policy
    pinned = {a["name"]: a["pin"] for a in arms if a.get("pin") is not None}
    out = []
    for c in s.get("concurrency") or []:
        t = {}
        for a in arms:
            lv = _level(a, c)
            if _valid(lv) and lv.get("output_throughput") and _lossless(run, a["name"]):
                t[a["name"]] = lv["output_throughput"]
        if not t:
            out.append(dict(c=c, arm=None))
            continue
        best = max(t, key=t.get)
        dd = [n for n in t if n.startswith("ddtree_b") or pinned.get(n, 0) > 0]
        best_dd = max(dd, key=t.get) if dd else None
        # the adaptive arms (``_nospec``: every round forced to plain decode, a diagnostic, not the policy)
        auto = [n for n in t if n.startswith("ddtree_auto") and not n.endswith("_nospec") and n not in pinned]
        ref = [t[n] for n in ("base", "dflash") if n in t]
        out.append(dict(c=c, arm=best, tput=t[best],
                        x_base=t[best] / t["base"] if "base" in t else None,
                        x_dflash=t[best] / t["dflash"] if "dflash" in t else None,
                        best_ddtree=best_dd,
                        best_ddtree_x_base=(t[best_dd] / t["base"]) if best_dd and "base" in t else None,
                        # issue 17's bar: the adaptive arm >= max(base, DFLASH) and within 5 % of the best fixed budget
                        auto={n: dict(x_best_of_base_dflash=t[n] / max(ref) if ref else None,
                                      x_best_fixed=t[n] / t[best_dd] if best_dd else None) for n in auto}))
    return out


def _render_recommendations(run, h) -> List[str]:
    rec = recommendations(run)
    if not rec:
        return []
    L = ["", f"{h} Which arm to run at each concurrency", "",
         "The fastest arm whose outputs are lossless (identical to the reference, or bf16 near ties "
         "only), and the fastest DDTREE-GPU budget (x base).", "",
         "| c | fastest lossless arm | tok/s | x base | x dflash | best DDTREE-GPU budget |",
         "|---:|---|---:|---:|---:|---|"]
    for r in rec:
        if r["arm"] is None:
            L.append(f"| {r['c']} | - (no lossless arm measured) | - | - | - | - |")
            continue
        dd = "-" if not r["best_ddtree"] else (
            f"{r['best_ddtree']} ({_f(r['best_ddtree_x_base'], 2)}x)" if r["best_ddtree_x_base"] else r["best_ddtree"])
        L.append(f"| {r['c']} | {r['arm']} | {r['tput']:.0f} | {_f(r['x_base'], 2)} | {_f(r['x_dflash'], 2)} | {dd} |")
    autos = sorted({n for r in rec for n in (r.get("auto") or {})})
    if autos:
        L += ["", "The adaptive arm against issue 17's bar: >= 1.00x the better of base and DFLASH, and >= 0.95x "
                  "the best fixed DDTREE-GPU budget, at every concurrency (lossless levels only).", "",
              "| c | arm | x max(base, dflash) | x best fixed budget | meets the bar |", "|---:|---|---:|---:|---|"]
        for r in rec:
            for n in autos:
                a = (r.get("auto") or {}).get(n)
                if a is None:
                    L.append(f"| {r['c']} | {n} | - | - | - (not measured or not lossless) |")
                    continue
                xb, xf = a["x_best_of_base_dflash"], a["x_best_fixed"]
                ok = (xb is not None and xb >= 1.0) and (xf is None or xf >= 0.95)
                L.append(f"| {r['c']} | {n} | {_f(xb, 2)} | {_f(xf, 2)} | {'yes' if ok else '**no**'} |")
    return L


def summary_rows(doc: dict) -> List[dict]:
    """One row per (run, arm) of a merged (or single) result: pair, run id, output tok/s per concurrency,
    x base of the same run, accept length, identity."""
    rows = []
    for run in _runs(doc):
        s = run.get("settings") or {}
        arms = run.get("arms") or []
        by = {a["name"]: a for a in arms}
        for a in arms:
            if a.get("status") == "skipped":  # never started (deadline): measured in another run, if at all
                continue
            cells = {}
            for c in s.get("concurrency") or []:
                lv, blv = _level(a, c), _level(by["base"], c) if "base" in by else None
                t = lv.get("output_throughput") if _valid(lv) else None
                bt = blv.get("output_throughput") if _valid(blv) else None
                cells[c] = dict(tput=t, x_base=(t / bt) if t and bt else None,
                                accept=lv.get("accept_length") if lv else None,
                                invalid=bool(lv and lv.get("invalid")))
            # a run without --pair (token-id prompts) is titled by its target's folder
            pair = s.get("pair") or os.path.basename(str(s.get("model_path") or "")) or "run"
            rows.append(dict(pair=pair, run=run.get("run_id", "1"), arm=a["name"], levels=cells,
                             identity=_identity_cell(run, a["name"]), status=a.get("status")))
    return rows


def render_summary(doc: dict, h: str = "##") -> List[str]:
    """Per pair: every arm of every run, output tok/s (x the same run's base) at each concurrency,
    accepted tokens per round, and the token-identity verdict.  The README's results table."""
    rows = summary_rows(doc)
    L = []
    for pair in dict.fromkeys(r["pair"] for r in rows):
        pr = [r for r in rows if r["pair"] == pair]
        levels = sorted({c for r in pr for c in r["levels"]})
        nruns = len({r["run"] for r in pr})
        L += [f"{h} {PAIR_TITLES.get(pair, pair)}", "",
              "| arm | " + ("run | " if nruns > 1 else "") + " | ".join(f"c={c}" for c in levels)
              + " | accepted / round | outputs vs base |",
              "|---|" + ("---|" if nruns > 1 else "") + "---:|" * len(levels) + "---:|---|"]
        for r in pr:
            cells = []
            for c in levels:
                v = r["levels"].get(c) or {}
                if v.get("invalid"):
                    cells.append("invalid")
                elif v.get("tput") is None:
                    cells.append("-")
                elif r["arm"] == "base":
                    cells.append(f"{v['tput']:.0f}")
                elif v.get("x_base") is None:
                    cells.append(f"{v['tput']:.0f} (-)")
                else:
                    cells.append(f"{v['tput']:.0f} ({v['x_base']:.2f}x)")
            acc = [r["levels"][c].get("accept") for c in levels if (r["levels"].get(c) or {}).get("accept")]
            acc_txt = f"{min(acc):.2f}-{max(acc):.2f}" if acc and min(acc) != max(acc) else (f"{acc[0]:.2f}" if acc else "-")
            L.append(f"| {r['arm']} | " + (f"{r['run']} | " if nruns > 1 else "") + " | ".join(cells)
                     + f" | {acc_txt} | {r['identity']} |")
        L.append("")
    return L


def render_markdown(doc: dict) -> str:
    if doc.get("kind") == "ab_serving":   # --client bench_serving
        from .serving_client import render_markdown as serving_markdown
        return serving_markdown(doc)
    L = []
    runs = _runs(doc)
    if doc.get("kind") == "ab_serve_merged":
        L += ["# A/B serving benchmark", "", f"{len(runs)} runs merged by `python bench/ab_serve.py --merge`. "
              "Output tokens per second at each concurrency (x the base arm of the same run: runs are never "
              "compared with each other), accepted tokens per verify round, and whether every output equals "
              "the base arm's (in a run without one, the reference it names, e.g. `chain`: the chain pairs' greedy "
              "output by construction). Details of each run follow the summary.", ""]
        L += ["## Summary", ""] + render_summary(doc, h="###")
    for run in runs:
        L += _render_run(run, top=doc.get("kind") != "ab_serve_merged")
    ks = doc.get("kernel_sweep") if doc.get("kind") == "ab_serve_merged" else None
    if ks:
        L += _render_sweep(ks)
    return "\n".join(L).rstrip() + "\n"


def _render_run(doc, top=True):
    s, m, p = doc["settings"], doc.get("meta", {}), doc["prompts"]
    title = (s.get("pair") == "text" and "the text-trained pair (bench/textpair)"
             or s.get("pair") and f"tiny {s['pair']} pair" or os.path.basename(str(s.get("model_path"))))
    h = "##" if top else "###"
    v = m.get("versions") or {}
    stamp = (f"{m.get('date', '?')} · GPU {', '.join(m.get('gpu') or ['?'])} · torch {v.get('torch')} · triton "
             f"{v.get('triton')} · sglang {v.get('sglang')} · commit {m.get('git_commit')}"
             f"{' (dirty)' if m.get('git_dirty') else ''}")
    if not doc["arms"]:  # --kernel-sweep-only
        L = [("# " if top else "## ") + "Tree build: GPU kernels vs the CPU heap", "", stamp, "",
             "Command: `" + " ".join(m.get("argv") or []) + "`."]
        if doc.get("kernel_sweep"):
            L += _render_sweep(doc["kernel_sweep"], h)
        return L + [""]
    L = [("# " if top else "## ") + f"A/B serving benchmark: {title}"
         + (f", run {doc['run_id']}" if doc.get("run_id") else ""), ""]
    kinds = {k: n for k, n in (p.get("kinds") or {}).items() if n}
    L += [f"{stamp} · {doc.get('elapsed_s')} s", "",
          f"Target `{s['model_path']}`, drafter `{s['draft_model_path']}`. {p['count']} prompts "
          f"({p['kind']}{'; ' + ', '.join(f'{n} {k}' for k, n in kinds.items()) if kinds else ''}; mean input {p['mean_input_len']} {p.get('input_len_unit', '')}; "
          f"sha256 {p['sha256_16']}), {p['source']}. Greedy ({s['greedy']}), max_new_tokens "
          f"{s['max_new_tokens']}{_spread_note(s)}; requests per level {s['requests_per_level']}; each level run "
          f"{s.get('repeats', 1)} time(s), the run with the median output tok/s reported. "
          "Command: `" + " ".join(m.get("argv") or []) + "`.", ""]
    arms = doc["arms"]
    levels = s["concurrency"]
    by = {a["name"]: a for a in arms}
    hdr = "| arm | " + " | ".join(f"c={c}" for c in levels) + " |"
    sep = "|---|" + "---:|" * len(levels)

    def tput(name, c):
        a = by.get(name)
        lv = _level(a, c) if a else None
        return lv.get("output_throughput") if _valid(lv) else None

    L += [f"{h} Output tokens per second (x base, x dflash)", "", hdr, sep]
    for a in arms:
        cells = []
        for c in levels:
            t = tput(a["name"], c)
            if t is None:
                lv = _level(a, c)
                cells.append("-" if lv is None else "partial" if lv.get("partial") else
                             f"invalid: {str(lv.get('invalid'))[:60]}")
                continue
            r = []
            for ref in ("base", "dflash"):
                rt = tput(ref, c)
                if rt and a["name"] != ref:
                    r.append(f"{t / rt:.2f}x")
                elif a["name"] == ref:
                    r.append("1.00x")
                else:
                    r.append("-")
            cells.append(f"{t:.0f} ({' / '.join(r)})")
        L.append(f"| {a['name']} | " + " | ".join(cells) + " |")
    L += _render_recommendations(doc, h)

    def level_table(title, cell):
        """One row per arm, one column per concurrency; cell(level record) -> text."""
        L.extend(["", f"{h} {title}", "", hdr, sep])
        for a in arms:
            L.append(f"| {a['name']} | " + " | ".join(
                "-" if not lv else cell(lv) for lv in (_level(a, c) for c in levels)) + " |")

    repeated = any((lv.get("repeats") or 1) > 1 for a in arms for lv in a.get("levels") or [])
    if repeated:
        level_table("Every repeat's output tok/s (the median one is reported above)",
                    lambda lv: " / ".join(f"{x:.0f}" for x in lv.get("output_throughput_repeats") or []
                                          if x is not None) or "-")
    level_table("Latency: TTFT median / p99, ITL median / p99 (ms)",
                lambda lv: f"{_f(lv['median_ttft_ms'])} / {_f(lv['p99_ttft_ms'])} · "
                           f"{_f(lv['median_itl_ms'], 2)} / {_f(lv['p99_itl_ms'], 2)}")
    level_table("Accepted tokens per verify round; client ms per decode round",
                lambda lv: f"{_f(lv['accept_length'], 2)} · {_f(lv['ms_per_step'], 2)} ms")
    idn = doc.get("identity") or {}
    L += ["", f"{h} Token identity against `{idn.get('reference')}` (same prompt, same concurrency)", ""]
    if idn.get("note"):
        L += [idn["note"], ""]
    if idn.get("arms"):
        L += ["| arm | requests compared | mismatching | errors | by concurrency | first mismatches (c, prompt, index) |",
              "|---|---:|---:|---:|---|---|"]
        for name, d in idn["arms"].items():
            ex = ", ".join(f"({e['concurrency']}, {e['prompt']}, {e['first_diff']})" for e in d["examples"][:4])
            L.append(f"| {name} | {d['compared']} | {'**' + str(d['mismatched']) + '**' if d['mismatched'] else 0} | "
                     f"{d['errors']} | {d['by_concurrency']} | {ex or '-'} |")
        rs = idn.get("reference_vs_own_first_level")
        if rs:
            L += ["", f"`{idn['reference']}` against itself at c={rs['level']} (mismatching requests per level): "
                      f"{rs['mismatched_by_concurrency']}."]
    if repeated:
        rep = {a["name"]: sum(lv.get("repeat_output_mismatches") or 0 for lv in a.get("levels") or [])
               for a in arms}
        L += ["", "Outputs that differ between the repeats of one arm and level (same server): "
                  + ", ".join(f"{k} {v}" for k, v in rep.items()) + "."]
    cls = idn.get("classification")
    if cls:
        L += _render_classification(cls, h)
    # stage split, and the verify's own cost: per verify slot (width N = budget + 1 for DDTREE arms) and
    # against the base arm's decode step at the same concurrency (client ms per step)
    base_step = {lv["concurrency"]: lv.get("ms_per_step") for a in arms if a.get("kind") == "base"
                 for lv in a.get("levels") or []}
    rows = []
    for a in arms:
        for lv in a.get("levels") or []:
            sp = lv.get("stage_profile")
            if sp:
                st = sp["stage_ms"]
                ver, bstep = st.get("verify"), base_step.get(lv["concurrency"])
                width = a.get("verify_width") or a.get("num_draft_tokens")
                per_slot = ver / width if ver is not None and width else None
                vs_base = ver / bstep if ver is not None and bstep else None
                rows.append(f"| {a['name']} | {lv['concurrency']} | {_f(sp['bs_mean'])} | {sp['rounds']} | "
                            + " | ".join(_f(st.get(k), 3) for k in STAGES)
                            + f" | {_f(sp['round_ms'], 3)} | {_f(sp['host_ms'], 3)} | {_f(lv.get('ms_per_step'), 3)} | "
                              f"{_f(sp.get('outside_ms'), 3)} | {_f(per_slot, 4)} | {_f(vs_base, 2)} |")
    L += ["", f"{h} Round time split of the speculative arms (ms, GPU time between CUDA events, per-record medians "
              "weighted by rounds)", ""]
    if rows:
        L += ["draft includes the drafter's top-K head; tree = build_tree + mask (DDTREE only); host = the worker "
              "call's host wall time; client = ms per decode round seen by the client; outside = client - round "
              "(scheduler, output processing, HTTP); verify/slot = verify ms / verify width (DDTREE: budget + 1; DFLASH: block size); "
              "verify/base = verify ms / the base arm's client ms per decode step at the same c.", "",
              "| arm | c | bs mean | rounds | " + " | ".join(STAGES)
              + " | round | host | client | outside | verify/slot | verify/base |",
              "|---|---:|---:|---:|" + "---:|" * (len(STAGES) + 6)] + rows
    else:
        L += ["No stage records (no DDTREE arm measured, or --no-stage-profile)."]
    hrows = []
    for a in arms:
        for lv in a.get("levels") or []:
            sp = lv.get("stage_profile") or {}
            hst = sp.get("host_stage_ms")
            if hst:
                rest = (sp["host_ms"] - sum(hst.values())) if sp.get("host_ms") is not None else None
                hrows.append(f"| {a['name']} | {lv['concurrency']} | {_f(sp.get('bs_mean'))} | "
                             + " | ".join(_f(hst.get(k), 3) for k in STAGES)
                             + f" | {_f(sp.get('host_ms'), 3)} | {_f(rest, 3)} | {_f(sp.get('round_ms'), 3)} |")
    if hrows:
        L += ["", f"{h} Host time per stage (ms, host wall time between the same marks, per-record medians "
                  "weighted by rounds)", "",
              "Where the worker call's host time goes: each column is the host's time from one stage mark to the "
              "next (draft: from the call's start to the drafter forward's return, launch and its graph-replay "
              "preparation included); host = the whole call; rest = host - the stages' sum (medians do not add "
              "exactly); round = the GPU round. A host at or above the GPU round means the GPU waits for launches.", "",
              "| arm | c | bs mean | " + " | ".join(STAGES) + " | host | rest | round |",
              "|---|---:|---:|" + "---:|" * (len(STAGES) + 3)] + hrows
    wrows = []
    for a in arms:
        for lv in a.get("levels") or []:
            bw = (lv.get("stage_profile") or {}).get("by_width") or {}
            if len(bw) < 2:
                continue
            total = sum(v["rounds"] for v in bw.values()) or 1
            for wd, v in sorted(bw.items(), key=lambda kv: int(kv[0])):
                per = v["verify_ms"] / int(wd) if v.get("verify_ms") is not None and int(wd) > 1 else None
                wrows.append(f"| {a['name']} | {lv['concurrency']} | {'no spec' if wd == '1' else wd} | {v['rounds']} "
                             f"({100.0 * v['rounds'] / total:.0f} %) | {_f(v.get('bs_mean'))} | "
                             f"{_f(v.get('verify_ms'), 3)} | {_f(v.get('round_ms'), 3)} | {_f(per, 4)} |")
    if wrows:
        L += ["", f"{h} Rounds per verify width (arms that mix widths: the adaptive budget)", "",
              "Rounds of the profile records per width the round ran (1 = no speculation), their mean batch "
              "size and the rounds-weighted medians of the verify stage and of the whole round (GPU ms).", "",
              "| arm | c | width | rounds | bs mean | verify | round | verify/slot |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"] + wrows
    prows = []
    for a in arms:
        for lv in a.get("levels") or []:
            sp = lv.get("stage_profile") or {}
            st, g = sp.get("stalls"), sp.get("gc")
            if not st and not g:
                continue
            prows.append(f"| {a['name']}{' (gc frozen)' if a.get('freeze_gc') else ''} | {lv['concurrency']} | "
                         f"{_f(lv.get('duration'), 3)} | {_f((st or {}).get('span_s'), 3)} | {(st or {}).get('n', '')} | "
                         f"{_f((st or {}).get('s'), 3)} | "
                         + (f"{g['n'][2]} | {_f(g['ms'][2], 1)} | {g['n'][0] + g['n'][1]} | {_f(g['ms'][0] + g['ms'][1], 1)} | "
                            f"{_f(g['max_ms'], 1)} |" if g else "| | | | |"))
    if prows:
        L += ["", f"{h} Pauses between rounds and the scheduler's garbage collections (the reported repeat)", "",
              "level = the client's seconds for the level; span = first to last profiled round; stalls = gaps of "
              "more than 100 ms with no round while the level ran (count, seconds); gc = the scheduler process's "
              "collections in that time (generation 2; generations 0-1), total ms and the longest. A collection "
              "stops the host loop: no round is launched while it runs.", "",
              "| arm | c | level s | span s | stalls | stall s | gen2 | gen2 ms | gen0-1 | gen0-1 ms | max gc ms |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + prows
    L += _render_traces(arms, h)
    bad = [a for a in arms if a.get("status") != "ok"]
    if bad:
        L += ["", f"{h} Arms not fully measured", ""]
        for a in bad:
            L.append(f"- `{a['name']}`: {a.get('status')}: {a.get('error', '')}"
                     + (f" (skipped levels {a['skipped_levels']})" if a.get("skipped_levels") else ""))
            if a.get("log_tail"):
                L += ["", "```", "\n".join(a["log_tail"].splitlines()[-12:]), "```"]
    wrows = []
    for a in arms:
        wu = a.get("warmup") or {}
        if wu:
            parts = [wu.get(k) or {} for k in ("burst", "single")]
            wrows.append(f"| {a['name']} | " + " | ".join(
                f"{p.get('concurrency', '')} | {p.get('num_requests', '')} | {_f(p.get('accept_length'), 2)} | "
                f"{_f(p.get('ms_per_step'), 2)}" for p in parts) + " |")
    if wrows:
        L += ["", f"{h} Warm-up (uncounted): the first batch after start-up", "",
              "burst = the first requests, all at the largest concurrency (16 new tokens at most); single = "
              "full-length requests at c=1 after it. accept = tokens per verify round; ms/step as in the levels.",
              "", "| arm | burst c | n | accept | ms/step | single c | n | accept | ms/step |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"] + wrows
    L += ["", f"{h} Server command lines", ""]
    for a in arms:
        if a.get("command_str"):
            env = " ".join(f"{k}=..." for k in (a.get("env") or {}))
            L.append(f"- `{a['name']}` (up in {a.get('start_s')} s): `{(env + ' ') if env else ''}{a['command_str']}`"
                     + (f"; target verify attention: {a['verify_attention']}" if a.get("verify_attention") else "")
                     + (f"; drafter block attention: {a['draft_attention']}" if a.get("draft_attention") else ""))
    if doc.get("kernel_sweep"):
        L += _render_sweep(doc["kernel_sweep"], h)
    L += ["", f"{h} Definitions", ""] + [f"- {k}: {v}" for k, v in (doc.get("definitions") or {}).items()]
    return L + [""]


TRACE_CATS = ("attention", "moe", "gemm", "ddtree", "sampling", "norm_act", "elementwise", "copy", "comm", "other")


def _render_traces(arms, h) -> List[str]:
    """--torch-profile: each arm's GPU trace of one uncounted pass (sglang_ddtree.ab.trace)."""
    rows, tops = [], []
    for a in arms:
        for lv in a.get("levels") or []:
            t = lv.get("torch_profile")
            if not t:
                continue
            if t.get("error"):
                rows.append(f"| {a['name']} | {lv['concurrency']} | error: {t['error'][:120]} |" + " |" * (len(TRACE_CATS) + 5))
                continue
            ps, cat = t["per_step"], t.get("kernel_ms_per_step_by_category") or {}
            syncs = sum(v["calls"] for n, v in (t.get("host_calls_per_step") or {}).items()
                        if "Synchronize" in n or n == "cudaMemcpy")
            rows.append(f"| {a['name']} | {lv['concurrency']} | {t['steps']}{' (stopped early)' if t.get('stopped_early') else ''} | "
                        f"{_f(ps['window_ms'], 3)} | {_f(ps['busy_ms'], 3)} | {_f(ps['idle_ms'], 3)} | "
                        + " | ".join(_f(cat.get(k), 3) for k in TRACE_CATS) + f" | {_f(syncs, 2)} |")
            tops.append(f"- `{a['name']}` c={lv['concurrency']}: "
                        + "; ".join(f"{k['name'][:60]} ({k['category']}) {_f(k['ms_per_step'], 3)} ms, "
                                    f"{_f(k['calls_per_step'], 1)} calls" for k in (t.get("top_kernels") or [])[:6])
                        + ". Longest idle gaps (us, after -> before): "
                        + "; ".join(f"{g['us']} ({g['after'][:40]} -> {g['before'][:40]})"
                                    for g in (t.get("longest_gaps") or [])[:3]))
            ho = t.get("host_ops")
            if ho:
                tops.append(f"  - host: {_f(ho['ops_per_step'], 1)} top-level torch ops, {_f(ho['ms_per_step'], 3)} ms "
                            "per step; " + "; ".join(f"{o['name'][:40]} {_f(o['ms_per_step'], 3)} ms ({_f(o['calls_per_step'], 1)})"
                                                     for o in ho["top"][:8]))
    if not rows:
        return []
    return ["", f"{h} GPU trace of one uncounted pass (--torch-profile)", "",
            "SGLang's /start_profile (torch.profiler, CUDA activities) over the steps shown; per scheduler step: "
            "window = first kernel start to last kernel end, busy = union of GPU kernel / copy intervals, idle = "
            "window - busy; kernel ms per step by category (sglang_ddtree.ab.trace.CATEGORIES, by kernel name); "
            "syncs = blocking host calls per step.", "",
            "| arm | c | steps | step | busy | idle | " + " | ".join(TRACE_CATS) + " | syncs |",
            "|---|---:|---:|---:|---:|---:|" + "---:|" * (len(TRACE_CATS) + 1)] + rows + ["", "Top kernels per step:", ""] + tops


def _render_classification(cls, h):
    """bench/ab_divergence.py's verdict on every mismatch (text pair: bf16 near ties vs errors)."""
    cal = cls.get("calibration") or {}
    L = ["", f"{h} Why outputs differ: every first divergence classified", "", cls["method"] + "."
         + (f" Noise quantiles over {cal['positions']} positions: {cal['quantiles']}." if cal else ""), "",
         "| compared | requests | diverged | near ties | errors |", "|---|---:|---:|---:|---:|"]
    rows = list(cls["arms"].items())
    r = cls.get("reference_vs_own_first_level")
    if r:
        rows.append((f"{cls['reference']} (c>1) vs {cls['reference']} (c={r['level']})", r))
    for name, d in rows:
        L.append(f"| {name} | {d['compared']} | {d['diverged']} | {d['near_tie']} | "
                 f"{'**' + str(d['error']) + '**' if d['error'] else 0} |")
    for pair in cls.get("cpu_vs_gpu") or []:
        L += ["", f"`{pair['cpu']}` and `{pair['gpu']}` (the CPU heap and the GPU kernels build the same trees): "
                  f"{pair['identical']} of {pair['compared']} outputs identical; by concurrency "
                  f"{pair['identical_by_concurrency']}."]
    errs = [x for _, d in rows for x in d["rows"] if not x.get("near_tie")]
    if errs:
        L += ["", "Errors (a token outside the noise band of the target's top logit):", "",
              "| arm | c | prompt | index | reference token | arm token | logit gap | below top | target top-2 gap |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for x in errs[:20]:
            L.append(f"| {x['arm']} | {x['concurrency']} | {x['prompt']} | {x['pos']} | {x.get('ref_tok', '-')} | "
                     f"{x.get('out_tok', '-')} | {x.get('gap', x.get('note', '-'))} | {x.get('below_top', '-')} | "
                     f"{x.get('top2_gap', '-')} |")
    gaps = sorted(x.get("below_top", x["gap"]) for _, d in rows for x in d["rows"] if x.get("near_tie"))
    if gaps:
        L += ["", f"Near ties: {len(gaps)}; the lower token's distance below the top fp32 logit "
                  f"{gaps[0]}-{gaps[-1]} (median {gaps[len(gaps) // 2]})."]
    return L


def _render_sweep(ks, h="##"):
    L = ["", f"{h} Kernel level: GPU tree build vs the CPU heap (same inputs, same card)", ""]
    if ks.get("status") != "ok":
        L += [f"Status: {ks.get('status')}. {ks.get('note', '')}", ""]
    info = ks.get("info") or {}
    if ks.get("rows"):
        L += [f"{info.get('gpu', '')} · torch {info.get('torch')} · triton {info.get('triton')}. {ks.get('method', '')}.", "",
              "| D | bs | budget | GPU build+mask (us) | CPU heap (us) | speed-up | identical |",
              "|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in ks["rows"]:
            L.append(f"| {r['D']} | {r['bs']} | {r['budget']} | {r['gpu_us']:.2f} | {r['cpu_heap_us']:.0f} | "
                     f"{r['speedup']:.0f}x | {'yes' if r['exact'] else '**NO**'} |")
    return L


def write_outputs(doc: dict, out: str, plot: bool = True):
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    with open(out + ".json", "w") as f:  # a merged report is written compact (it is committed whole)
        json.dump(doc, f, **({"separators": (",", ":")} if doc.get("kind") == "ab_serve_merged" else {"indent": 1}))
    with open(out + ".md", "w") as f:
        f.write(render_markdown(doc))
    if plot:
        plot_hook(doc, out)
    print(f"wrote {out}.json, {out}.md", flush=True)


def plot_hook(doc: dict, out: str):
    """OUT.png (:mod:`sglang_ddtree.ab.plot`, matplotlib): a message instead when matplotlib is missing."""
    try:
        from . import plot
        plot.plot(doc, out + ".png")
        print(f"wrote {out}.png", flush=True)
    except ImportError as e:
        print(f"no plot ({e}); `pip install matplotlib`, then `python -m sglang_ddtree.ab.plot {out}.json`",
              flush=True)
    except Exception as e:  # noqa: BLE001 - the numbers are written already
        print(f"plot failed: {e!r}", flush=True)

