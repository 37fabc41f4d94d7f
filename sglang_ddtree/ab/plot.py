"""Plots of an A/B serving benchmark result (the JSON of ``sglang-ddtree-ab`` / bench/ab_serve.py),
matplotlib, Agg backend.  ``sglang-ddtree-ab`` writes OUT.png itself when matplotlib is installed;
later, from the JSON:

    python -m sglang_ddtree.ab.plot OUT.json [PNG]   (default PNG: OUT.png; bench/ab_plot.py in a checkout)

One row of panels per pair (a merged JSON holds several runs; the runs of one pair share its row):
  1. output tokens per second against concurrency, one line per arm (log-2 x axis);
  2. the DDTREE arms' round time split at each concurrency, stacked bars (ms): draft (+ top-K),
     tree, verify prep, verify, accept, commit, and "outside" (client ms per decode round minus
     the GPU round: scheduler, host, HTTP);
and, when the JSON holds a kernel sweep, a last panel: GPU build_tree vs the CPU heap (us) against
batch size, one pair of lines per budget (log-log), depth 15 first.
"""
from __future__ import annotations

import json
import os
import sys

STAGES = ("draft", "tree", "verify_prep", "verify", "accept", "commit")
COLORS = {"draft": "#4c72b0", "tree": "#dd8452", "verify_prep": "#937860", "verify": "#55a868",
          "accept": "#c44e52", "commit": "#8172b3", "outside": "#bbbbbb"}


def _runs(doc):
    return doc["runs"] if doc.get("kind") == "ab_serve_merged" else [doc]


def _title(run):
    s = run.get("settings") or {}
    if s.get("pair"):
        return {"text": "text pair"}.get(s["pair"], f"tiny {s['pair']} pair") + \
            (f", run {run['run_id']}" if run.get("run_id") else "")
    return os.path.basename(str(s.get("model_path") or "")) or "run"


def _group(runs):
    """Runs of the same pair side by side: [[run, ...] per pair], in first-seen order."""
    groups = {}
    for r in runs:
        groups.setdefault((r.get("settings") or {}).get("pair") or id(r), []).append(r)
    return list(groups.values())


def _tput_panel(ax, runs):
    runs = runs if isinstance(runs, list) else [runs]
    levels = sorted({c for r in runs for c in (r.get("settings") or {}).get("concurrency") or []})
    markers = "osD^v"
    for k, run in enumerate(runs):
        styles = {"base": dict(color="black", lw=2.2), "dflash": dict(color="#888888", lw=2.2, ls="--")}
        for a in run.get("arms") or []:
            pts = [(lv["concurrency"], lv["output_throughput"]) for lv in a.get("levels") or []
                   if lv.get("output_throughput") and not lv.get("partial") and not lv.get("invalid")]
            if not pts:
                continue
            xs, ys = zip(*pts)
            kw = styles.get(a["name"], dict(ls=":" if a["kind"] == "ddtreecpu" else "-", lw=1.5))
            label = a["name"] + (f" (run {run.get('run_id', k + 1)})" if len(runs) > 1 else "")
            ax.plot(xs, ys, marker=markers[k % len(markers)], label=label, alpha=1.0 if k == 0 else 0.75, **kw)
    ax.set_xscale("log", base=2)
    if levels:
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{_title(runs[0]) if len(runs) == 1 else _title(dict(runs[0], run_id=None))}: "
                 f"throughput (greedy{', each run has its own base' if len(runs) > 1 else ''})", fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _split_panel(ax, runs):
    runs = runs if isinstance(runs, list) else [runs]
    run = runs[0]
    bars = []  # (label, {part: ms})
    for k, r in enumerate(runs):
        for a in r.get("arms") or []:
            for lv in a.get("levels") or []:
                sp = lv.get("stage_profile")
                if not sp:
                    continue
                parts = {s: (sp.get("stage_ms") or {}).get(s) or 0.0 for s in STAGES}
                parts["outside"] = max(0.0, sp.get("outside_ms") or 0.0)
                tag = f" r{r.get('run_id', k + 1)}" if len(runs) > 1 else ""
                bars.append((f"{a['name']}{tag}\nc={lv['concurrency']}", parts))
    if not bars:
        ax.text(0.5, 0.5, "no DDTREE stage records", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    x = range(len(bars))
    bottom = [0.0] * len(bars)
    for part in STAGES + ("outside",):
        vals = [b[1][part] for b in bars]
        ax.bar(x, vals, bottom=bottom, color=COLORS[part], label=part.replace("_", " ")
               + (" (+top-K)" if part == "draft" else ""), width=0.75)
        bottom = [u + v for u, v in zip(bottom, vals)]
    ax.set_xticks(list(x))
    ax.set_xticklabels([b[0] for b in bars], fontsize=6, rotation=90)
    ax.set_ylabel("ms per decode round")
    ax.set_title(f"{_title(run) if len(runs) == 1 else _title(dict(run, run_id=None))}: DDTREE round time split",
                 fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)


def _sweep_panel(ax, ks):
    rows = ks.get("rows") or []
    depths = sorted({r["D"] for r in rows}, reverse=True)
    D = depths[0] if depths else None
    budgets = sorted({r["budget"] for r in rows if r["D"] == D})
    cmap = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for i, b in enumerate(budgets):
        pts = sorted((r["bs"], r["gpu_us"], r["cpu_heap_us"]) for r in rows if r["D"] == D and r["budget"] == b)
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", color=cmap[i % len(cmap)], label=f"GPU, budget {b}")
        ax.plot(xs, [p[2] for p in pts], marker="s", ls="--", color=cmap[i % len(cmap)], label=f"CPU heap, budget {b}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("us per tree build (whole batch)")
    ax.set_title(f"tree build: GPU kernels vs CPU heap (D={D})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)


def plot(doc: dict, png: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _group([r for r in _runs(doc) if r.get("arms")])
    sweeps = [doc["kernel_sweep"]] if doc.get("kind") == "ab_serve_merged" and doc.get("kernel_sweep") else \
        [r["kernel_sweep"] for r in _runs(doc) if r.get("kernel_sweep")]
    sweep = next((k for k in sweeps if k.get("rows")), None)
    nrows = len(runs) + (1 if sweep else 0)
    if nrows == 0:
        raise ValueError("nothing to plot: no measured arms and no kernel sweep")
    fig, axes = plt.subplots(nrows, 2, figsize=(13, 4.6 * nrows), squeeze=False)
    for i, run in enumerate(runs):
        _tput_panel(axes[i][0], run)
        _split_panel(axes[i][1], run)
    if sweep:
        _sweep_panel(axes[-1][0], sweep)
        axes[-1][1].set_axis_off()
        rows = sweep["rows"]
        exact = all(r.get("exact") for r in rows)
        txt = [f"{len(rows)} cases, trees identical: {'all' if exact else 'NOT ALL'}"]
        big = [r for r in rows if r["bs"] == max(x["bs"] for x in rows)]
        for r in sorted(big, key=lambda r: (-r["D"], r["budget"])):
            txt.append(f"D={r['D']} bs={r['bs']} budget={r['budget']}: GPU {r['gpu_us']:.1f} us, "
                       f"CPU {r['cpu_heap_us'] / 1000:.2f} ms ({r['speedup']:.0f}x)")
        axes[-1][1].text(0.0, 1.0, "\n".join(txt), va="top", family="monospace", fontsize=7,
                         transform=axes[-1][1].transAxes)
    fig.tight_layout()
    fig.savefig(png, dpi=80 if doc.get("kind") == "ab_serve_merged" else 110)
    plt.close(fig)
    return png


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    src = argv[0]
    png = argv[1] if len(argv) > 1 else (src[:-5] if src.endswith(".json") else src) + ".png"
    with open(src) as f:
        doc = json.load(f)
    plot(doc, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
