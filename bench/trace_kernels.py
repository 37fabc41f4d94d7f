"""Kernel variants of GPU traces side by side: for each labelled Chrome trace (what
``sglang-ddtree-ab --torch-profile`` leaves in its workdir, ``trace_<arm>_c<C>/*.trace.json.gz``),
every kernel grouped by (name, grid, block, registers per thread, shared memory) with its call
count and median / total time, so the same kernel compiled two ways shows up as two rows.

    python bench/trace_kernels.py --out bench/results/NAME dflash=PATH ddtree_b7=PATH [--match _fwd_kernel]

Writes NAME.json and NAME.md (the top ``--top`` variants per trace by total time, optionally only
kernels whose name contains ``--match``)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sglang_ddtree.ab.trace import load_events, category  # noqa: E402


def variants(path: str, match: str = None, top: int = 12) -> list:
    groups = {}
    for e in load_events(path):
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") != "kernel" or "dur" not in e:
            continue
        name = str(e.get("name", "?"))
        if match and match not in name:
            continue
        a = e.get("args") or {}
        key = (name, json.dumps(a.get("grid")), json.dumps(a.get("block")), a.get("registers per thread"),
               a.get("shared memory"))
        groups.setdefault(key, []).append(float(e["dur"]))
    rows = []
    for (name, grid, block, regs, smem), d in groups.items():
        rows.append(dict(name=name[:160], category=category(name), grid=json.loads(grid), block=json.loads(block),
                         registers_per_thread=regs, shared_memory=smem, calls=len(d),
                         median_us=round(statistics.median(d), 2), total_ms=round(sum(d) / 1e3, 3)))
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:top]


def render(doc) -> str:
    L = ["# Kernel variants in GPU traces", "", f"Made by `bench/trace_kernels.py` from {doc['source']}"
         + (f"; kernels whose name contains `{doc['match']}`" if doc.get("match") else "") + ". One row per "
         "(kernel, grid, block, registers per thread, shared memory): the same kernel compiled twice is two rows.", ""]
    for label, rows in doc["traces"].items():
        L += [f"## {label}", "", "| kernel | grid | block | regs | smem | calls | median us | total ms |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            L.append(f"| {r['name'][:60]} | {r['grid']} | {r['block']} | {r['registers_per_thread']} | "
                     f"{r['shared_memory']} | {r['calls']} | {r['median_us']} | {r['total_ms']} |")
        L.append("")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", metavar="LABEL=PATH")
    ap.add_argument("--out", required=True)
    ap.add_argument("--match", default=None)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--source", default="the traces named on the command line")
    a = ap.parse_args(argv)
    traces = {}
    for spec in a.traces:
        if "=" not in spec:
            raise SystemExit(f"error: {spec!r} is not LABEL=PATH")
        label, path = spec.split("=", 1)
        traces[label] = variants(path, a.match, a.top)
    doc = dict(kind="trace_kernels", source=a.source, match=a.match, traces=traces)
    with open(a.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(render(doc))
    print(f"wrote {a.out}.json, {a.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
