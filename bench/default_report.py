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

The floor (the issue's item 2), from the reports that hold a forced no-speculation arm
(``ddtree_nospec``: the default server with every round plain) beside ``base``, one cell per (pair,
workload, c), the same measured rule and the same choice among reports:

* ``ddtree_nospec >= 0.98 x base`` output tok/s;
* its median ITL <= 1.03 x base's: with one token per round and a batch of c, the ITL is the
  round time the client sees, against base's decode step measured the same way (bs 1-64 = c 1-64);
* its outputs token-identical to base's (no near-tie allowance: its rounds are SGLang's decode step).
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
FLOOR_ARMS = ("base", "ddtree_nospec")
WORKLOADS = ("random", "natural", "long", "mix")
CONCURRENCY = (1, 4, 16, 64)
MIN_REPEATS, MIN_SECONDS = 3, 20.0
BAR_MAX, BAR_DFLASH = 0.97, 1.05
FLOOR_TPUT, FLOOR_ITL = 0.98, 1.03


def pair_label(doc: dict) -> str:
    s = doc.get("settings") or {}
    return str(s.get("pair") or os.path.basename(str(s.get("model_path") or "?").rstrip("/")))


def _level(arm: Optional[dict], c: int) -> Optional[dict]:
    return next((lv for lv in (arm or {}).get("levels") or [] if lv.get("concurrency") == c), None)


def outputs_verdict(doc: dict, arm: str, near_ties: bool = True) -> Tuple[bool, str]:
    """(ok, text) of an arm's identity requests against the reference arm; ``near_ties``: a difference
    that is a classified bf16 near tie is allowed (False: token-identical only)."""
    idn = doc.get("identity") or {}
    d = (idn.get("arms") or {}).get(arm)
    if not d or not d.get("compared"):
        return False, "not compared"
    if not d.get("mismatched"):
        return True, f"identical ({d['compared']})"
    if not near_ties:
        return False, f"{d['mismatched']} of {d['compared']} differ"
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


def _levels_at(doc: dict, c: int, arms) -> Tuple[Dict[str, dict], List[str]]:
    """({arm: its level at c, {} when absent}, why the levels are not a measurement: absent, partial,
    fewer than MIN_REPEATS repeats, a level under MIN_SECONDS)."""
    by = {a.get("name"): a for a in doc.get("arms") or []}
    got = {name: _level(by.get(name), c) for name in arms}
    s = doc.get("settings") or {}
    why = [f"{k} not measured" for k, v in got.items() if v is None]
    for k, v in got.items():
        if v is None:
            continue
        if v.get("partial") or not v.get("output_throughput"):
            why.append(f"{k} partial")
        if int(v.get("repeats") or 0) < MIN_REPEATS:
            why.append(f"{k} {v.get('repeats')} repeats")
        if v.get("short") or float(s.get("min_level_seconds") or 0) < MIN_SECONDS:
            why.append(f"{k} level < {MIN_SECONDS:.0f} s")
    return {k: (v or {}) for k, v in got.items()}, why


def _cell_head(doc: dict, c: int, source: str, lv: Dict[str, dict]) -> dict:
    s = doc.get("settings") or {}
    return dict(pair=pair_label(doc), workload=(s.get("workload") or {}).get("name"), concurrency=c,
                source=source, date=(doc.get("meta") or {}).get("date"), card=card(doc),
                tok_s={k: v.get("output_throughput") for k, v in lv.items()},
                repeats={k: v.get("repeats") for k, v in lv.items()},
                median_ttft_ms={k: v.get("median_ttft_ms") for k, v in lv.items()})


def cell_from(doc: dict, c: int, source: str) -> Optional[dict]:
    """One (pair, workload, c) cell from one report (INCOMPLETE, naming them, when arms are missing at
    c), or None when the report has no arm at c."""
    lv, why = _levels_at(doc, c, ARMS)
    if not (lv["dflash"] or lv["ddtree"]):    # base alone (or beside the floor's arm) is no cell here
        return None
    cell = _cell_head(doc, c, source, lv)
    cell["accept_length"] = {k: v.get("accept_length") for k, v in lv.items()}
    tput = cell["tok_s"]
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


def floor_cell_from(doc: dict, c: int, source: str) -> Optional[dict]:
    """One floor cell (forced no-speculation vs base) from one report, or None when the report has no
    ``ddtree_nospec`` level at c."""
    lv, why = _levels_at(doc, c, FLOOR_ARMS)
    nospec = FLOOR_ARMS[1]
    if not lv[nospec]:
        return None
    cell = _cell_head(doc, c, source, lv)
    cell["median_itl_ms"] = itl = {k: v.get("median_itl_ms") for k, v in lv.items()}
    round_ms = (lv[nospec].get("stage_profile") or {}).get("round_ms")
    cell["nospec_gpu_round_ms"] = round_ms
    tput = cell["tok_s"]
    identical, cell["outputs"] = outputs_verdict(doc, nospec, near_ties=False)
    if not all(tput.values()) or not all(itl.values()):
        cell.update(status="INCOMPLETE", why=why or ["no ITL"])
        return cell
    cell["x_base"] = tput[nospec] / tput["base"]
    cell["itl_x_base"] = itl[nospec] / itl["base"]
    fails = []
    if cell["x_base"] < FLOOR_TPUT:
        fails.append(f"{cell['x_base']:.2f}x base tok/s < {FLOOR_TPUT}")
    if cell["itl_x_base"] > FLOOR_ITL:
        fails.append(f"ITL {cell['itl_x_base']:.2f}x base's > {FLOOR_ITL}")
    if not identical:
        fails.append(f"outputs: {cell['outputs']}")
    cell.update(status="INCOMPLETE" if why else ("FAIL" if fails else "PASS"), fails=fails)
    if why:
        cell["why"] = why
    return cell


def assemble(docs: List[Tuple[str, dict]], make=cell_from) -> Dict[tuple, dict]:
    """{(pair, workload, c): cell} (``make``: :func:`cell_from`, or :func:`floor_cell_from`): per key
    the cell of the report with the most arms measured, then the most repeats, then the latest date,
    then the later argument."""
    cells: Dict[tuple, dict] = {}
    for i, (src, doc) in enumerate(docs):
        if doc.get("kind") != "ab_serving":
            raise ValueError(f"{src}: not a bench_serving A/B report (kind {doc.get('kind')!r})")
        for c in (doc.get("settings") or {}).get("concurrency") or []:
            cell = make(doc, int(c), src)
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


def _table_keys(cells: Dict[tuple, dict]) -> List[tuple]:
    """Cells in table order: pair, then the issue's workload order, then c."""
    return sorted(cells, key=lambda k: (k[0], WORKLOADS.index(k[1]) if k[1] in WORKLOADS else 99, k[2]))


def _status_text(cell: dict) -> str:
    return cell["status"] + ("" if cell["status"] == "PASS" else
                             ": " + "; ".join(cell.get("why", []) + cell.get("fails", [])))


def floor_missing(floor: Dict[tuple, dict]) -> List[str]:
    """The floor's gaps: per (pair, workload) with a floor cell, the concurrencies not measured."""
    out = []
    for p, w in sorted({k[:2] for k in floor}):
        lack = [c for c in CONCURRENCY if (p, w, c) not in floor]
        if lack:
            out.append(f"floor, {p} / {w}: c = {', '.join(map(str, lack))} not measured")
    return out or ([] if floor else ["floor: no report with a ddtree_nospec arm yet"])


def render_floor(floor: Dict[tuple, dict]) -> List[str]:
    keys = _table_keys(floor)
    n_pass = sum(1 for k in keys if floor[k]["status"] == "PASS")
    L = ["", "## The floor: a forced no-speculation server against base (item 2)", "",
         f"`ddtree_nospec` is the default server with every round plain. Bars per cell: >= {FLOOR_TPUT} x "
         f"base's output tok/s; median ITL (one token per round: the round time the client sees) <= "
         f"{FLOOR_ITL} x base's decode step measured the same way; outputs token-identical; >= "
         f"{MIN_REPEATS} repeats of >= {MIN_SECONDS:.0f} s. GPU round: the no-spec arm's own profile, "
         "where recorded.", "", f"**{n_pass} of {len(keys)} cells pass.**", ""]
    if not keys:
        return L[:-2] + ["No report with a `ddtree_nospec` arm yet."]
    L += ["| pair | workload | c | base tok/s | nospec tok/s | x base | base ITL | nospec ITL | ITL x base | "
          "GPU round | outputs | status | GPU | report |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for k in keys:
        x = floor[k]
        t, i = x["tok_s"], x["median_itl_ms"]
        f = lambda v, nd=0: "-" if not v else f"{v:.{nd}f}"
        st = _status_text(x)
        L.append(f"| {k[0]} | {k[1]} | {k[2]} | {f(t['base'])} | {f(t['ddtree_nospec'])} | {f(x.get('x_base'), 2)} | "
                 f"{f(i['base'], 2)} | {f(i['ddtree_nospec'], 2)} | {f(x.get('itl_x_base'), 2)} | "
                 f"{f(x.get('nospec_gpu_round_ms'), 2)} | {x['outputs']} | {st} | {x.get('card', '?')} | "
                 f"`{os.path.basename(x['source'])}` |")
    return L


def render(cells: Dict[tuple, dict], gaps: List[str], floor: Optional[Dict[tuple, dict]] = None) -> str:
    keys = _table_keys(cells)
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
        st = _status_text(x)
        L.append(f"| {k[0]} | {k[1]} | {k[2]} | {f(t['base'])} | {f(t['dflash'])} | {f(t['ddtree'])} | "
                 f"{r(x.get('x_best'))} | {r(x.get('x_dflash'))} | {x['outputs']} | {st} | {x.get('card', '?')} | "
                 f"`{os.path.basename(x['source'])}` |")
    L += render_floor(floor or {})
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
    floor = assemble(docs, make=floor_cell_from)
    gaps = missing(cells) + floor_missing(floor)
    doc = dict(kind="default_report", bars=dict(x_max=BAR_MAX, x_dflash=BAR_DFLASH, repeats=MIN_REPEATS,
                                                level_seconds=MIN_SECONDS, floor_tok_s=FLOOR_TPUT,
                                                floor_itl=FLOOR_ITL),
               sources=[os.path.relpath(p) for p in paths],
               cells=[cells[k] for k in sorted(cells)], missing=gaps,
               passed=sum(1 for c in cells.values() if c["status"] == "PASS"), total=len(cells),
               floor_cells=[floor[k] for k in sorted(floor)],
               floor_passed=sum(1 for c in floor.values() if c["status"] == "PASS"), floor_total=len(floor))
    with open(out + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(out + ".md", "w") as fh:
        fh.write(render(cells, gaps, floor))
    print(f"{doc['passed']} of {doc['total']} cells pass, floor {doc['floor_passed']} of {doc['floor_total']}; "
          f"wrote {out}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
