"""The proof table of issue 39 (``bench/results/default_h200.{json,md}``): DDTREE-GPU's default arm
against base and DFLASH under ``sglang.bench_serving``, one cell per (pair, workload, concurrency),
assembled from the A/B's serving reports (``python -m sglang_ddtree.ab --client bench_serving``, one
JSON per device call).

usage: python bench/default_report.py OUT_PREFIX REPORT.json[.gz] [REPORT ...]
       (writes OUT_PREFIX.json and OUT_PREFIX.md)

A cell takes all three arms from ONE report (ratios only within one run: one device call, or several
on one warm machine joined by the A/B's ``--resume``); where several reports hold the cell, the one
with the most arms measured, then the most repeats, then the latest, is used.  A report without all
three arms at c gives an INCOMPLETE cell naming the missing ones.  The GPU column is each report's.  Per cell:

* measured: every arm's level complete (not partial), >= 3 repeats, no repeat shorter than 20 s
  (the report's ``min_level_seconds`` >= 20 and the level not flagged short); else INCOMPLETE;
* bar 1: ``ddtree >= 0.97 x max(base, dflash)`` (median output tok/s of the repeats);
* bar 2: where DFLASH beats base, ``ddtree >= 1.05 x dflash``;
* outputs: the ddtree arm's identity verdict identical, or every difference a classified bf16 near
  tie and no error.
PASS needs all of them.  The markdown also lists what the issue's matrix still lacks: pairs (the
text pair and the chain pair at the Qwen3-8B shape, one MoE shape), workloads random / natural / long
/ mix, concurrency 1 / 4 / 16 / 64.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rawio import open_maybe_gz  # noqa: E402

ARMS = ("base", "dflash", "ddtree")
WORKLOADS = ("random", "natural", "long", "mix")
CONCURRENCY = (1, 4, 16, 64)
MIN_REPEATS, MIN_SECONDS = 3, 20.0
BAR_MAX, BAR_DFLASH = 0.97, 1.05


def pair_label(doc: dict) -> str:
    s = doc.get("settings") or {}
    return str(s.get("pair") or os.path.basename(str(s.get("model_path") or "?").rstrip("/")))


def _level(arm: Optional[dict], c: int) -> Optional[dict]:
    return next((lv for lv in (arm or {}).get("levels") or [] if lv.get("concurrency") == c), None)


def outputs_verdict(doc: dict, arm: str) -> Tuple[bool, str]:
    """(ok, text) of an arm's identity requests against the reference arm."""
    idn = doc.get("identity") or {}
    d = (idn.get("arms") or {}).get(arm)
    if not d or not d.get("compared"):
        return False, "not compared"
    if not d.get("mismatched"):
        return True, f"identical ({d['compared']})"
    cls = ((idn.get("classification") or {}).get("arms") or {}).get(arm)
    if cls and not cls.get("error") and cls.get("near_tie", 0) >= d["mismatched"]:
        return True, f"{d['mismatched']} of {d['compared']} differ, all bf16 near ties"
    return False, f"{d['mismatched']} of {d['compared']} differ" + (
        f" ({cls.get('near_tie')} near ties, {cls.get('error')} errors)" if cls else " (not classified)")


def card(doc: dict) -> str:
    """The GPU a report ran on, short ("H100", "H200"), from its meta (``nvidia-smi`` name)."""
    g = ((doc.get("meta") or {}).get("gpu") or ["?"])[0]
    name = str(g).split(",")[0].replace("NVIDIA ", "")
    return name.split()[0] if name.strip() else "?"


def cell_from(doc: dict, c: int, source: str) -> Optional[dict]:
    """One (pair, workload, c) cell from one report (INCOMPLETE, naming them, when arms are missing at
    c), or None when the report has no arm at c."""
    by = {a.get("name"): a for a in doc.get("arms") or []}
    lv = {name: _level(by.get(name), c) for name in ARMS}
    if all(v is None for v in lv.values()):
        return None
    s = doc.get("settings") or {}
    absent = [k for k, v in lv.items() if v is None]
    lv = {k: (v or {}) for k, v in lv.items()}
    tput = {k: v.get("output_throughput") for k, v in lv.items()}
    why = [f"{k} not measured" for k in absent]
    for k, v in lv.items():
        if k in absent:
            continue
        if v.get("partial") or not tput[k]:
            why.append(f"{k} partial")
        if int(v.get("repeats") or 0) < MIN_REPEATS:
            why.append(f"{k} {v.get('repeats')} repeats")
        if v.get("short") or float(s.get("min_level_seconds") or 0) < MIN_SECONDS:
            why.append(f"{k} level < {MIN_SECONDS:.0f} s")
    cell = dict(pair=pair_label(doc), workload=(s.get("workload") or {}).get("name"), concurrency=c,
                source=source, date=(doc.get("meta") or {}).get("date"), card=card(doc), tok_s=tput,
                repeats={k: v.get("repeats") for k, v in lv.items()},
                median_ttft_ms={k: v.get("median_ttft_ms") for k, v in lv.items()},
                accept_length={k: v.get("accept_length") for k, v in lv.items()})
    ok_out, out_txt = outputs_verdict(doc, "ddtree")
    cell["outputs"] = out_txt
    if any(not tput[k] for k in ARMS):
        cell.update(status="INCOMPLETE", why=why)
        return cell
    best = max(tput["base"], tput["dflash"])
    cell["x_best"] = tput["ddtree"] / best
    cell["x_base"] = tput["ddtree"] / tput["base"]
    cell["x_dflash"] = tput["ddtree"] / tput["dflash"]
    cell["dflash_beats_base"] = tput["dflash"] > tput["base"]
    fails = []
    if cell["x_best"] < BAR_MAX:
        fails.append(f"{cell['x_best']:.2f}x max(base, dflash) < {BAR_MAX}")
    if cell["dflash_beats_base"] and cell["x_dflash"] < BAR_DFLASH:
        fails.append(f"{cell['x_dflash']:.2f}x dflash < {BAR_DFLASH} where dflash beats base")
    if not ok_out:
        fails.append(f"outputs: {out_txt}")
    if why:
        cell.update(status="INCOMPLETE", why=why, fails=fails)
    else:
        cell.update(status="FAIL" if fails else "PASS", fails=fails)
    return cell


def assemble(docs: List[Tuple[str, dict]]) -> Dict[tuple, dict]:
    """{(pair, workload, c): cell}: per key the cell of the report with the most arms measured, then
    the most repeats, then the latest date, then the later argument."""
    cells: Dict[tuple, dict] = {}
    for i, (src, doc) in enumerate(docs):
        if doc.get("kind") != "ab_serving":
            raise ValueError(f"{src}: not a bench_serving A/B report (kind {doc.get('kind')!r})")
        for c in (doc.get("settings") or {}).get("concurrency") or []:
            cell = cell_from(doc, int(c), src)
            if cell is None:
                continue
            key = (cell["pair"], cell["workload"], int(c))
            rank = (sum(1 for x in cell["tok_s"].values() if x), min(int(x or 0) for x in cell["repeats"].values()),
                    str(cell["date"] or ""), i)
            if key not in cells or rank >= cells[key]["_rank"]:
                cell["_rank"] = rank
                cells[key] = cell
    for cell in cells.values():
        cell.pop("_rank", None)
    return cells


def missing(cells: Dict[tuple, dict]) -> List[str]:
    """What the issue's matrix lacks, given the cells (pairs named as the reports name them)."""
    out = []
    pairs = sorted({k[0] for k in cells})
    if len(pairs) < 3:
        out.append(f"pairs: {len(pairs)} measured ({', '.join(pairs) or 'none'}); the issue asks the text "
                   "pair and the chain pair at the Qwen3-8B shape and one MoE shape")
    for p in pairs:
        for w in WORKLOADS:
            have = sorted(c for (pp, ww, c) in cells if pp == p and ww == w)
            lack = [c for c in CONCURRENCY if c not in have]
            if lack:
                out.append(f"{p} / {w}: c = {', '.join(map(str, lack))} not measured")
    return out


def render(cells: Dict[tuple, dict], gaps: List[str]) -> str:
    keys = sorted(cells, key=lambda k: (k[0], WORKLOADS.index(k[1]) if k[1] in WORKLOADS else 99, k[2]))
    n_pass = sum(1 for k in keys if cells[k]["status"] == "PASS")
    L = ["# DDTREE-GPU default vs base and DFLASH under sglang.bench_serving (issue 39)", "",
         f"Produced by `bench/default_report.py` from the serving reports named per row. Bars per cell: "
         f"ddtree >= {BAR_MAX} x max(base, dflash); >= {BAR_DFLASH} x dflash where dflash beats base; "
         f"ddtree's outputs identical to base's (or classified bf16 near ties, no error); >= {MIN_REPEATS} "
         f"repeats of >= {MIN_SECONDS:.0f} s. Output tok/s, median of repeats; ratios within one report.", "",
         f"**{n_pass} of {len(keys)} cells pass.**", "",
         "| pair | workload | c | base | dflash | ddtree | x max | x dflash | outputs | status | GPU | report |",
         "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for k in keys:
        x = cells[k]
        t = x["tok_s"]
        f = lambda v: "-" if not v else f"{v:.0f}"
        r = lambda v: "-" if v is None else f"{v:.2f}"
        st = x["status"] + ("" if x["status"] == "PASS" else ": " + "; ".join(x.get("why", []) + x.get("fails", [])))
        L.append(f"| {k[0]} | {k[1]} | {k[2]} | {f(t['base'])} | {f(t['dflash'])} | {f(t['ddtree'])} | "
                 f"{r(x.get('x_best'))} | {r(x.get('x_dflash'))} | {x['outputs']} | {st} | {x.get('card', '?')} | "
                 f"`{os.path.basename(x['source'])}` |")
    L += ["", "## Not measured yet", ""] + ([f"- {g}" for g in gaps] or ["- nothing: the matrix is complete"])
    return "\n".join(L) + "\n"


def main(argv: List[str]) -> int:
    if len(argv) < 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out, paths = argv[1], argv[2:]
    docs = []
    for p in paths:
        with open_maybe_gz(p) as fh:
            docs.append((p, json.load(fh)))
    cells = assemble(docs)
    gaps = missing(cells)
    doc = dict(kind="default_report", bars=dict(x_max=BAR_MAX, x_dflash=BAR_DFLASH, repeats=MIN_REPEATS,
                                                level_seconds=MIN_SECONDS),
               sources=[os.path.relpath(p) for p in paths],
               cells=[cells[k] for k in sorted(cells)], missing=gaps,
               passed=sum(1 for c in cells.values() if c["status"] == "PASS"), total=len(cells))
    with open(out + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(out + ".md", "w") as fh:
        fh.write(render(cells, gaps))
    print(f"{doc['passed']} of {doc['total']} cells pass; wrote {out}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
