"""The proof table of issue 52 item 5 (``bench/results/default_<gpu>.{json,md}``): DDTREE-GPU's default
arm against base and DFLASH under ``sglang.bench_serving``, one cell per (pair, workload, concurrency),
assembled from the A/B's serving reports (``python -m sglang_ddtree.ab --client bench_serving``, one
JSON per device call), and the floor of item 4.

usage: python bench/default_report.py [--default-arm ARM] OUT_PREFIX REPORT.json[.gz] [REPORT ...]
       (writes OUT_PREFIX.json and OUT_PREFIX.md; ARM: the arm judged as the default in every
       report; unless given, today's default per report: see ``default_arm_of``)

Today's default (since s40) is the server that switches between plain decoding and speculation
(switch ``regime=auto``): in a report from after the flip it is the ``ddtree`` arm (its server ran a
regime controller: the arm has the A/B's ``regime_final`` or a level's ``regime`` record), before
it the ``ddtree_regimeauto`` arm; a report's ``ddtree`` arm without a regime controller is the
spec-only default of its commit and is not judged as today's.

A cell takes all three arms from ONE report (ratios only within one run: one device call, or several
on one warm machine joined by the A/B's ``--resume``); where several reports hold the cell, the one
with the most arms measured, then the most repeats, then the latest, is used.  A report without all
three arms at c gives an INCOMPLETE cell naming the missing ones.  The GPU column is each report's.  Per cell:

* measured: every arm's level complete (not partial), >= 2 repeats, and >= 3 where a ratio the cell
  is judged on lies within 3 % of its bar; no repeat shorter than 20 s (the report's
  ``min_level_seconds`` >= 20 and the level not flagged short); else INCOMPLETE;
* bar 1: ``default >= 0.98 x max(base, dflash)`` (median output tok/s of the repeats);
* bar 2: where DFLASH beats base, ``default >= 1.05 x dflash``;
* outputs: the default arm's identity verdict identical, or every difference a classified bf16 near
  tie and no error;
* the regime (where the default arm's level has the A/B's ``regime`` record, ``sglang_ddtree.ab.regime_log``):
  its exploration <= 1 % of busy time (item 1); the share of time it speculated is shown, and the
  share its trips took (plain decoding only to measure it in a new state, bounded by count: once per
  state; not a bar, their cost is in the tok/s) where the record has it.
PASS needs all of them.  The markdown also lists what the issue's matrix still lacks: pairs (the
text pair and the chain pair at the Qwen3-8B shape, one MoE shape), workloads random / natural / long
/ mix, concurrency 1 / 16 / 64.

The floor (item 4), from the reports that hold a server forced into the plain regime
(``ddtree_regimeplain``) beside ``base``, one cell per (pair, workload, c), the same measured rule
(the close-to-bar rule on its one ratio) and the same choice among reports:

* ``ddtree_regimeplain >= 0.99 x base`` output tok/s;
* its outputs token-identical to base's (no near-tie allowance: its steps are SGLang's decode step);
* median ITL shown beside base's (not a bar).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rawio import open_maybe_gz  # noqa: E402

from sglang_ddtree.ab.regime_log import has_regime_controller  # noqa: E402

DEFAULT_ARM = None            # today's default, per report (default_arm_of)
UNMEASURED_DEFAULT = "ddtree (regime auto)"   # the label where a report has no arm of today's default
FLOOR_ARM = "ddtree_regimeplain"
WORKLOADS = ("random", "varied", "ids", "natural", "long", "mix")
CONCURRENCY = (1, 16, 64)
# item 5's matrix per kind of pair (the first key in the pair's name): (workload, concurrencies)
MATRIX = (("chain", (("varied", CONCURRENCY), ("ids", CONCURRENCY))),
          ("text", (("natural", CONCURRENCY), ("long", (1, 4, 16)))),
          ("code", (("natural", CONCURRENCY),)))
FLOOR_CONCURRENCY, FLOOR_WORKLOADS = (16, 64), 2      # item 4: c = 16 and 64 on two workloads
MIN_REPEATS, CLOSE_REPEATS, CLOSE, MIN_SECONDS = 2, 3, 0.03, 20.0
BAR_MAX, BAR_DFLASH = 0.98, 1.05
FLOOR_TPUT = 0.99
EXPLORE_MAX = 0.01


def arms_of(default: str) -> Tuple[str, str, str]:
    """The three arms of a cell: base, dflash and the arm judged as the default."""
    return ("base", "dflash", default)


def default_arm_of(doc: dict) -> str:
    """The arm of ``doc`` that is today's default: ``ddtree`` where its server ran the regime controller
    (a report from after the s40 flip), else ``ddtree_regimeauto``, else ``UNMEASURED_DEFAULT`` (an
    arm no report has: the cell says today's default was not measured)."""
    by = {a.get("name"): a for a in doc.get("arms") or []}
    if has_regime_controller(by.get("ddtree")):
        return "ddtree"
    return "ddtree_regimeauto" if "ddtree_regimeauto" in by else UNMEASURED_DEFAULT


def close_to(x: Optional[float], bar: float) -> bool:
    """``x`` lies within ``CLOSE`` (relative) of ``bar``: three repeats are needed to call it."""
    return x is not None and abs(x / bar - 1.0) < CLOSE


def pair_label(doc: dict) -> str:
    s = doc.get("settings") or {}
    return str(s.get("pair") or os.path.basename(str(s.get("model_path") or "?").rstrip("/")))


def _level(arm: Optional[dict], c: int) -> Optional[dict]:
    return next((lv for lv in (arm or {}).get("levels") or [] if lv.get("concurrency") == c), None)


def outputs_verdict(doc: dict, arm: str, near_ties: bool = True) -> Tuple[Optional[bool], str]:
    """(ok, text) of an arm's identity requests against the reference arm, ok None where none was
    compared (not measured: the cell is INCOMPLETE, not FAIL); ``near_ties``: a difference that is a
    classified bf16 near tie is allowed (False: token-identical only)."""
    idn = doc.get("identity") or {}
    d = (idn.get("arms") or {}).get(arm)
    if not d or not d.get("compared"):
        return None, "not compared"
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


def _close_repeats(lv: Dict[str, dict], ratios: List[Tuple[Optional[float], float]]) -> List[str]:
    """Why a cell whose ratio lies within ``CLOSE`` of its bar is not yet called: an arm with fewer
    than ``CLOSE_REPEATS`` repeats.  ``ratios``: (ratio, bar) pairs the cell is judged on."""
    near = [bar for x, bar in ratios if close_to(x, bar)]
    if not near:
        return []
    few = [k for k, v in lv.items() if int(v.get("repeats") or 0) < CLOSE_REPEATS]
    return [f"{k} {lv[k].get('repeats')} repeats (a ratio within {CLOSE:.0%} of {near[0]}: "
            f"{CLOSE_REPEATS} needed)" for k in few]


def _cell_head(doc: dict, c: int, source: str, lv: Dict[str, dict]) -> dict:
    s = doc.get("settings") or {}
    return dict(pair=pair_label(doc), workload=(s.get("workload") or {}).get("name"), concurrency=c,
                source=source, date=(doc.get("meta") or {}).get("date"), card=card(doc),
                tok_s={k: v.get("output_throughput") for k, v in lv.items()},
                repeats={k: v.get("repeats") for k, v in lv.items()},
                median_ttft_ms={k: v.get("median_ttft_ms") for k, v in lv.items()})


def regime_of(level: dict) -> Optional[dict]:
    """The default arm's regime at a level (the A/B's ``regime`` record): {spec_share, switches,
    explore_share}, or None when the level has none (a server without a regime controller)."""
    r = level.get("regime")
    if not r:
        return None
    return dict(spec_share=r.get("spec_share"), switches=r.get("switches"), explore_share=r.get("explore_share"),
                trip_share=r.get("trip_share"), partial=bool(r.get("partial")))


def cell_from(doc: dict, c: int, source: str, default: Optional[str] = DEFAULT_ARM) -> Optional[dict]:
    """One (pair, workload, c) cell from one report (INCOMPLETE, naming them, when arms are missing at
    c), or None when the report has no arm at c; ``default``: the arm judged as the default (None:
    :func:`default_arm_of` the report)."""
    default = default or default_arm_of(doc)
    arms = arms_of(default)
    lv, why = _levels_at(doc, c, arms)
    if not (lv["dflash"] or lv[default]):    # base alone (or beside the floor's arm) is no cell here
        return None
    cell = _cell_head(doc, c, source, lv)
    cell["default_arm"] = default
    cell["accept_length"] = {k: v.get("accept_length") for k, v in lv.items()}
    cell["regime"] = regime_of(lv[default])
    tput = cell["tok_s"]
    ok_out, out_txt = outputs_verdict(doc, default)
    cell["outputs"] = out_txt
    if any(not tput[k] for k in arms):
        cell.update(status="INCOMPLETE", why=why)
        return cell
    best = max(tput["base"], tput["dflash"])
    cell["x_best"] = tput[default] / best
    cell["x_base"] = tput[default] / tput["base"]
    cell["x_dflash"] = tput[default] / tput["dflash"]
    cell["dflash_beats_base"] = tput["dflash"] > tput["base"]
    fails = []
    if cell["x_best"] < BAR_MAX:
        fails.append(f"{cell['x_best']:.2f}x max(base, dflash) < {BAR_MAX}")
    if cell["dflash_beats_base"] and cell["x_dflash"] < BAR_DFLASH:
        fails.append(f"{cell['x_dflash']:.2f}x dflash < {BAR_DFLASH} where dflash beats base")
    if ok_out is False:
        fails.append(f"outputs: {out_txt}")
    elif ok_out is None:
        why = why + [f"outputs {out_txt}"]
    reg = cell["regime"]
    if reg and reg["explore_share"] is not None and reg["explore_share"] > EXPLORE_MAX:
        fails.append(f"exploration {reg['explore_share']:.1%} of busy time > {EXPLORE_MAX:.0%}")
    why = why + _close_repeats(lv, [(cell["x_best"], BAR_MAX)]
                               + ([(cell["x_dflash"], BAR_DFLASH)] if cell["dflash_beats_base"] else []))
    if why:
        cell.update(status="INCOMPLETE", why=why, fails=fails)
    else:
        cell.update(status="FAIL" if fails else "PASS", fails=fails)
    return cell


def floor_cell_from(doc: dict, c: int, source: str) -> Optional[dict]:
    """One floor cell (a server forced into the plain regime vs base) from one report, or None when the
    report has no ``ddtree_regimeplain`` level at c."""
    lv, why = _levels_at(doc, c, ("base", FLOOR_ARM))
    if not lv[FLOOR_ARM]:
        return None
    cell = _cell_head(doc, c, source, lv)
    cell["median_itl_ms"] = itl = {k: v.get("median_itl_ms") for k, v in lv.items()}
    tput = cell["tok_s"]
    identical, cell["outputs"] = outputs_verdict(doc, FLOOR_ARM, near_ties=False)
    if not all(tput.values()):
        cell.update(status="INCOMPLETE", why=why)
        return cell
    cell["x_base"] = tput[FLOOR_ARM] / tput["base"]
    cell["itl_x_base"] = itl[FLOOR_ARM] / itl["base"] if all(itl.values()) else None
    fails = []
    if cell["x_base"] < FLOOR_TPUT:
        fails.append(f"{cell['x_base']:.3f}x base tok/s < {FLOOR_TPUT}")
    if identical is False:
        fails.append(f"outputs: {cell['outputs']}")
    elif identical is None:
        why = why + [f"outputs {cell['outputs']}"]
    why = why + _close_repeats(lv, [(cell["x_base"], FLOOR_TPUT)])
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


def matrix_of(pair: str, cells: Dict[tuple, dict]) -> tuple:
    """Item 5's (workload, concurrencies) for ``pair`` (:data:`MATRIX`, by the first key its name holds),
    else every workload it has cells in at :data:`CONCURRENCY`."""
    for key, rows in MATRIX:
        if key in pair:
            return rows
    return tuple((w, CONCURRENCY) for w in WORKLOADS if any(k[0] == pair and k[1] == w for k in cells))


def missing(cells: Dict[tuple, dict]) -> List[str]:
    """What the issue's matrix lacks, given the cells (pairs named as the reports name them): item 5's
    workloads per kind of pair (:data:`MATRIX`: the chain pair varied and its own prompts, the text
    pair natural and long, the code pair natural)."""
    out = []
    pairs = sorted({k[0] for k in cells})
    if len(pairs) < 3:
        out.append(f"pairs: {len(pairs)} measured ({', '.join(pairs) or 'none'}); the issue asks the text "
                   "pair and the chain pair at the Qwen3-8B shape and one MoE shape")
    for p in pairs:
        for w, levels in matrix_of(p, cells):
            have = sorted(c for (pp, ww, c) in cells if pp == p and ww == w)
            lack = [c for c in levels if c not in have]
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
    """The floor's gaps (item 4: c = 16 and 64 on two workloads): per (pair, workload) with a floor
    cell, those concurrencies not measured; per pair, fewer than two workloads."""
    out = []
    for p, w in sorted({k[:2] for k in floor}):
        lack = [c for c in FLOOR_CONCURRENCY if (p, w, c) not in floor]
        if lack:
            out.append(f"floor, {p} / {w}: c = {', '.join(map(str, lack))} not measured")
    for p in sorted({k[0] for k in floor}):
        n = len({k[1] for k in floor if k[0] == p})
        if n < FLOOR_WORKLOADS:
            out.append(f"floor, {p}: {n} workload measured; the issue asks {FLOOR_WORKLOADS}")
    return out or ([] if floor else [f"floor: no report with a {FLOOR_ARM} arm yet"])


def render_floor(floor: Dict[tuple, dict]) -> List[str]:
    keys = _table_keys(floor)
    n_pass = sum(1 for k in keys if floor[k]["status"] == "PASS")
    L = ["", "## The floor: a server forced into the plain regime against base (item 4)", "",
         f"`{FLOOR_ARM}` is the DDTREE-GPU server with switch `regime=plain`: every batch on SGLang's plain "
         f"decode path. Bars per cell: >= {FLOOR_TPUT} x base's output tok/s; outputs token-identical; >= "
         f"{MIN_REPEATS} repeats of >= {MIN_SECONDS:.0f} s ({CLOSE_REPEATS} where the ratio is within "
         f"{CLOSE:.0%} of the bar). Median ITL beside base's, not a bar.", "",
         f"**{n_pass} of {len(keys)} cells pass.**", ""]
    if not keys:
        return L[:-2] + [f"No report with a `{FLOOR_ARM}` arm yet."]
    L += ["| pair | workload | c | base tok/s | plain regime tok/s | x base | base ITL | plain ITL | "
          "outputs | status | GPU | report |",
          "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for k in keys:
        x = floor[k]
        t, i = x["tok_s"], x["median_itl_ms"]
        f = lambda v, nd=0: "-" if not v else f"{v:.{nd}f}"
        L.append(f"| {k[0]} | {k[1]} | {k[2]} | {f(t['base'])} | {f(t[FLOOR_ARM])} | {f(x.get('x_base'), 3)} | "
                 f"{f(i['base'], 2)} | {f(i[FLOOR_ARM], 2)} | {x['outputs']} | {_status_text(x)} | "
                 f"{x.get('card', '?')} | `{os.path.basename(x['source'])}` |")
    return L


def _regime_text(reg: Optional[dict]) -> str:
    if not reg:
        return "-"
    sp, ex = reg.get("spec_share"), reg.get("explore_share")
    tr = reg.get("trip_share")
    return (f"spec {'-' if sp is None else f'{sp:.0%}'}, {reg.get('switches') or 0} sw, explore "
            f"{'-' if ex is None else f'{ex:.1%}'}" + (f", trips {tr:.1%}" if tr else "")
            + (" (partial)" if reg.get("partial") else ""))


def render(cells: Dict[tuple, dict], gaps: List[str], floor: Optional[Dict[tuple, dict]] = None,
           default: Optional[str] = DEFAULT_ARM) -> str:
    keys = _table_keys(cells)
    n_pass = sum(1 for k in keys if cells[k]["status"] == "PASS")
    which = f"the `{default}` arm" if default else (
        "today's default, switch `regime=auto` (since s40): a report's `ddtree` arm where its server ran the "
        "regime controller, else its `ddtree_regimeauto` arm (column `arm`); a `ddtree` arm without the "
        "controller is an older spec-only default and is not judged")
    L = ["# DDTREE-GPU default vs base and DFLASH under sglang.bench_serving (issue 52)", "",
         f"Produced by `bench/default_report.py` from the serving reports named per row; the default is "
         f"{which}. Bars per cell: default >= {BAR_MAX} x max(base, dflash); >= {BAR_DFLASH} x "
         f"dflash where dflash beats base; its outputs identical to base's (or classified bf16 near ties, "
         f"no error); its exploration <= {EXPLORE_MAX:.0%} of busy time where it has a regime; >= "
         f"{MIN_REPEATS} repeats of >= {MIN_SECONDS:.0f} s ({CLOSE_REPEATS} where a ratio is within "
         f"{CLOSE:.0%} of its bar). Output tok/s, median of repeats; ratios within one report.", "",
         f"**{n_pass} of {len(keys)} cells pass.**", "",
         "| pair | workload | c | base | dflash | default | arm | x max | x dflash | regime | outputs | status | GPU | report |",
         "|---|---|---:|---:|---:|---:|---|---:|---:|---|---|---|---|---|"]
    for k in keys:
        x = cells[k]
        t = x["tok_s"]
        f = lambda v: "-" if not v else f"{v:.0f}"
        r = lambda v: "-" if v is None else f"{v:.2f}"
        L.append(f"| {k[0]} | {k[1]} | {k[2]} | {f(t['base'])} | {f(t['dflash'])} | {f(t[x['default_arm']])} | "
                 f"`{x['default_arm']}` | {r(x.get('x_best'))} | {r(x.get('x_dflash'))} | {_regime_text(x.get('regime'))} | "
                 f"{x['outputs']} | {_status_text(x)} | {x.get('card', '?')} | `{os.path.basename(x['source'])}` |")
    L += render_floor(floor or {})
    L += ["", "## Not measured yet", ""] + ([f"- {g}" for g in gaps] or ["- nothing: the matrix is complete"])
    return "\n".join(L) + "\n"


def main(argv: List[str]) -> int:
    args = list(argv[1:])
    default = DEFAULT_ARM
    if args[:1] == ["--default-arm"]:
        if len(args) < 2:
            print("--default-arm needs an arm name", file=sys.stderr)
            return 2
        default, args = args[1], args[2:]
    if len(args) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out, paths = args[0], args[1:]
    docs = []
    for p in paths:
        with open_maybe_gz(p) as fh:
            docs.append((p, json.load(fh)))
    cells = assemble(docs, make=lambda d, c, src: cell_from(d, c, src, default=default))
    floor = assemble(docs, make=floor_cell_from)
    gaps = missing(cells) + floor_missing(floor)
    doc = dict(kind="default_report", default_arm=default,
               bars=dict(x_max=BAR_MAX, x_dflash=BAR_DFLASH, repeats=MIN_REPEATS, close_repeats=CLOSE_REPEATS,
                         close=CLOSE, level_seconds=MIN_SECONDS, floor_tok_s=FLOOR_TPUT, explore_max=EXPLORE_MAX),
               sources=[os.path.relpath(p) for p in paths],
               cells=[cells[k] for k in sorted(cells)], missing=gaps,
               passed=sum(1 for c in cells.values() if c["status"] == "PASS"), total=len(cells),
               floor_cells=[floor[k] for k in sorted(floor)],
               floor_passed=sum(1 for c in floor.values() if c["status"] == "PASS"), floor_total=len(floor))
    with open(out + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(out + ".md", "w") as fh:
        fh.write(render(cells, gaps, floor, default=default))
    print(f"{doc['passed']} of {doc['total']} cells pass, floor {doc['floor_passed']} of {doc['floor_total']}; "
          f"wrote {out}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
