"""Drafter training against DFLASH acceptance (issue 12 item 2, the code pair of issue 51), from committed files.

Each point is a bench/textpair/train.py or bench/codepair/recipe.py run (its log: drafter shape, steps,
seconds, the offline held-out DFLASH simulation) and, where one exists, an A/B report that served it
under stock DFLASH (accepted tokens per verify round at each concurrency, as SGLang reports them).

usage: python bench/textpair/drafter_curve.py OUT_PREFIX NAME=LOG_JSON[:AB_JSON] ...
(either file may be gzip: .gz). Writes OUT_PREFIX.json and OUT_PREFIX.md.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rawio import open_maybe_gz  # noqa: E402  (bench/rawio.py: gzip when the name ends in .gz)


def load(path):
    """A JSON file, plain or gzipped."""
    with open_maybe_gz(path) as fh:
        return json.load(fh)


def served_accept(doc, name):
    """{concurrency: accept length} of the A/B's arm `name` ({} when it did not run)."""
    arm = next((a for a in doc["arms"] if a["name"] == name and a.get("status") == "ok"), None)
    return {} if arm is None else {str(lv["concurrency"]): lv.get("accept_length") for lv in arm["levels"]}


def served_trees(doc):
    """{budget: {concurrency: accept length}} of the A/B's fixed-budget DDTree arms (ddtree_b<N>)."""
    out = {}
    for a in doc["arms"]:
        n = a["name"]
        if n.startswith("ddtree_b") and n[len("ddtree_b"):].isdigit() and a.get("status") == "ok":
            out[n[len("ddtree_b"):]] = served_accept(doc, n)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def point(name, log_path, ab_path=None):
    log = load(log_path)
    cfg = log.get("drafter_config") or {}
    sim = log.get("dflash_sim_heldout") or {}
    block = (cfg.get("dflash_config") or {}).get("block_size") or log["args"].get("block_size") or 8
    p = {"name": name, "log": log_path, "block_size": block,
         "layers": cfg.get("num_hidden_layers", 2), "intermediate": cfg.get("intermediate_size", 256),
         "params": log["drafter"].get("params"), "steps": log["drafter"]["steps"],
         "train_seconds": log["drafter"]["seconds"],
         "drafter_data_tokens": (log.get("drafter_data") or {}).get("greedy_tokens"),
         "offline_depth1_top1": (sim.get("depth_top1") or [None])[0],
         "offline_dflash_tokens_per_round": sim.get("dflash_tokens_per_round"),
         "device": log.get("device")}
    if ab_path:
        doc = load(ab_path)
        p["served_dflash_accept"] = served_accept(doc, "dflash")
        p["ab_gpu"] = ((doc["meta"].get("gpu") or ["?"])[0]).split(",")[0]
        p["ab_date"], p["ab_commit"] = doc["meta"].get("date"), doc["meta"].get("git_commit")
        p["ab"] = ab_path
        trees = served_trees(doc)
        if trees:
            p["served_ddtree_accept"] = trees
    if log.get("offline_tree"):   # the code pair's recipe: the tree walked beside the chain
        p["offline_ddtree"] = log["offline_tree"]["all"]
    return p


def tree_table(pts, f):
    """The tree against the chain, per budget (budget 15 verifies 16 tokens: the block-16 chain's width)."""
    md = ["\n## The tree against the chain\n",
          "Offline: the recipe's DDTree (the project's best-first tree of b nodes from the drafter's top-b per "
          "depth) walked against the same greedy continuations as the chain; a sibling win = the round's "
          "accepted path holds a node that is not its parent's first child. Served: accepted tokens per verify "
          "round of the A/B's `ddtree_b<N>` arm, and its ratio to the `dflash` arm at the same concurrency.\n",
          "| drafter | budget | offline tokens/round | offline gain over the chain | rounds with a sibling win | "
          "served accept (c: value, x DFLASH) |", "|---|---:|---:|---:|---:|---|"]
    for p in pts:
        off, srv = p.get("offline_ddtree") or {}, p.get("served_ddtree_accept") or {}
        dfl = p.get("served_dflash_accept") or {}
        for b in sorted(set(off) | set(srv), key=int):
            o = off.get(b, {})
            served = ", ".join(f"c={c}: {f(v)}" + (f" ({v / dfl[c]:.2f}x)" if v and dfl.get(c) else "")
                               for c, v in srv.get(b, {}).items()) or "-"
            sw = o.get("sibling_win_round_frac")
            md.append(f"| {p['name']} | {b} | {f(o.get('tokens_per_round'))} | {f(o.get('gain_over_chain'))} | "
                      f"{'-' if sw is None else f'{100 * sw:.1f} %'} | {served} |")
    return md


def main(argv):
    out, specs = argv[0], argv[1:]
    pts = []
    for spec in specs:
        name, rest = spec.split("=", 1)
        log_path, _, ab_path = rest.partition(":")
        pts.append(point(name, log_path, ab_path or None))
    doc = {"points": pts, "target_accept": 3.0,
           "reached": any(max([v for v in (p.get("served_dflash_accept") or {}).values() if v] or [0]) >= 3.0
                          for p in pts)}
    json.dump(doc, open(out + ".json", "w"), indent=1)
    f = (lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v)))
    md = ["# Drafters: training time vs DFLASH acceptance (issue 12 item 2, issue 51)\n",
          "Produced by `bench/textpair/drafter_curve.py` from the committed training logs and A/B reports. "
          "Offline = the trainer's held-out DFLASH simulation (bf16 weights, fp32 forward; text pair: 256 "
          "held-out windows x 128 greedy tokens, code pair: 64 held-out prompts x 256); served = stock "
          "DFLASH's accepted tokens per verify round in an A/B (SGLang 0.5.16; the GPU in the last column).\n",
          "| drafter | block | layers x MLP | params | steps | train s | drafter data (greedy tokens) | "
          "offline depth-1 top-1 | offline DFLASH tokens/round | served DFLASH accept (c: value) | A/B |",
          "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for p in pts:
        served = ", ".join(f"c={c}: {f(v)}" for c, v in (p.get("served_dflash_accept") or {}).items()) or "-"
        md.append(f"| {p['name']} | {p['block_size']} | {p['layers']} x {p['intermediate']} | {f(p['params'])} | "
                  f"{p['steps']} | {f(p['train_seconds'])} | {f(p['drafter_data_tokens'])} | "
                  f"{f(p['offline_depth1_top1'])} | {f(p['offline_dflash_tokens_per_round'])} | {served} | "
                  f"{'`' + os.path.basename(p['ab']) + '`, ' + p['ab_gpu'] if p.get('ab') else '-'} |")
    md.append(f"\nStock DFLASH reaches >= 3 tokens per round: {'yes' if doc['reached'] else '**no**'}.")
    if any(p.get("offline_ddtree") or p.get("served_ddtree_accept") for p in pts):
        md += tree_table(pts, f)
    open(out + ".md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main(sys.argv[1:])
