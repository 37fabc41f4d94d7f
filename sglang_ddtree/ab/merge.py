"""One report (JSON + MD + PNG, per-request columns in a gzip file beside it) from several runs."""
from __future__ import annotations

import json
import os
from typing import List, Optional

from .report import _level, _runs, write_outputs


def per_request_path(report: str) -> str:
    """The gzip file of per-request columns beside a merged report (``x.json`` -> ``x.per_request.json.gz``)."""
    return (report[:-5] if report.endswith(".json") else report) + ".per_request.json.gz"


def _reattach_per_request(path: str, doc: dict) -> None:
    """A merged report keeps its per-request columns in a gzip file beside it (keys run index / arm /
    concurrency): put them back into their levels, so merging that report again carries them on
    instead of dropping every earlier run's columns."""
    gz = per_request_path(path)
    if doc.get("kind") != "ab_serve_merged" or not os.path.exists(gz):
        return
    import gzip
    with gzip.open(gz, "rt") as f:
        cols = json.load(f)
    for k, r in enumerate(doc["runs"]):
        for a in r.get("arms") or []:
            for lv in a.get("levels") or []:
                key = f"{k}/{a['name']}/{lv['concurrency']}"
                if key in cols and "per_request" not in lv:
                    lv["per_request"] = cols[key]


def merge(out: str, paths: List[str], invalid: Optional[List[List[str]]] = None):
    """One report from several runs.  invalid: [source file name, arm, concurrency, reason] entries that
    mark a measured level as broken (kept in the JSON, left out of every ratio)."""
    runs, sources, sweep = [], [], None  # sources[i]: the file name runs[i] came from
    for p in paths:
        d = json.load(open(p))
        _reattach_per_request(p, d)
        for r in _runs(d):
            if r.get("kernel_sweep") and (r["kernel_sweep"].get("rows")) and sweep is None:
                sweep = r["kernel_sweep"]
            if r.get("arms"):  # a --kernel-sweep-only run contributes its sweep only
                runs.append(r)
                sources.append(os.path.basename(p))
    unknown = sorted({src for src, *_ in invalid or []} - set(sources))
    if unknown:
        raise SystemExit(f"--invalid names files that were not merged: {unknown}")
    for src, arm, c, why in invalid or []:
        lv = next((_level(a, int(c)) for s, r in zip(sources, runs) if s == src for a in r["arms"]
                   if a["name"] == arm and _level(a, int(c))), None)
        if lv is None:
            raise SystemExit(f"--invalid {src} {arm} {c}: no such level")
        lv["invalid"] = why
    count = {}
    for r in runs:  # run ids per pair: text-1, text-2, ...
        pair = (r.get("settings") or {}).get("pair") or "run"
        count[pair] = count.get(pair, 0) + 1
        r["run_id"] = str(count[pair])
    doc = dict(kind="ab_serve_merged", runs=runs, kernel_sweep=sweep, sources=[os.path.basename(p) for p in paths],
               per_request_file=os.path.basename(out) + ".per_request.json.gz (keys: run index/arm/concurrency)")
    per_request = {}
    for k, r in enumerate(runs):  # the sweep is reported once, at the end; output ids stay in the run files
        r.pop("kernel_sweep", None)
        r.pop("output_ids", None)
        r.pop("prompt_ids", None)
        for a in r.get("arms") or []:  # per-request columns: a gzip file beside the report (it stays small)
            for lv in a.get("levels") or []:
                if "per_request" in lv:
                    per_request[f"{k}/{a['name']}/{lv['concurrency']}"] = lv.pop("per_request")
    if per_request:
        import gzip
        with gzip.open(per_request_path(out), "wt") as f:
            json.dump(per_request, f, separators=(",", ":"))
    write_outputs(doc, out, plot=True)
    return doc

