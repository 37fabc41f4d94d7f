"""Host cost of the adaptive budget's per-round choice (``BudgetPolicy.choose``) with the default age
buckets, on this machine's CPU (no GPU involved: the choice is host arithmetic on host values).

    python bench/policy_choose_cost.py [--out bench/results/policy_choose_cost_cpu]

The policy gets a MoE-like cost table (the replay test's, tests/test_adaptive_age.py) and 40 windows
of counts in every age bucket, so each bucket holds a chained estimate; then ``choose(bs, ages)`` is
timed for batches of 1 / 16 / 64 requests of random ages (median of 7 runs of 2,000 calls).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from sglang_ddtree.policy.adaptive_config import DEFAULT_AGE_EDGES
from sglang_ddtree.policy.budget_policy import BudgetPolicy, CostTable

COSTS = CostTable(verify_ms={8: {1: 4.9, 16: 7.5, 64: 13.9}, 16: {1: 6.5, 16: 9.0, 64: 16.7},
                             32: {1: 8.0, 16: 11.0, 64: 19.3}, 64: {1: 9.5, 16: 14.0, 64: 26.0}},
                  base_ms={1: 2.06, 16: 3.5, 64: 6.0})


def filled_policy(rng: random.Random) -> BudgetPolicy:
    pol = BudgetPolicy(COSTS, allow_no_spec=True, age_edges=DEFAULT_AGE_EDGES)
    widths = sorted(COSTS.verify_ms)
    for _ in range(40):
        sums, counts, below = [], [], []
        for _b in range(pol.buckets):
            n = rng.randint(1, 50)
            acc = sorted(rng.uniform(0, 6) * n for _ in widths)
            sums.append(dict(zip(widths, acc)))
            counts.append({w: n for w in widths})
            below.append(dict(zip(widths, [0.0] + acc[:-1])))
        pol.update_window(sums, counts, below)
    return pol


def time_choose(pol: BudgetPolicy, bs: int, rng: random.Random, calls: int = 2000, runs: int = 7) -> float:
    ages = [rng.randrange(0, 200) for _ in range(bs)]
    per = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(calls):
            pol.choose(bs, ages)
        per.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(per)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rng = random.Random(0)
    pol = filled_policy(rng)
    rows = [dict(bs=bs, us_per_choose=round(time_choose(pol, bs, rng), 1)) for bs in (1, 16, 64)]
    doc = dict(made_by="bench/policy_choose_cost.py", date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               cpu=platform.processor() or platform.machine(), python=platform.python_version(),
               age_buckets=pol.buckets, rows=rows)
    md = ["# Host cost of BudgetPolicy.choose (default age buckets)", "",
          f"Made by `bench/policy_choose_cost.py` on {doc['date']}, {doc['cpu']}, Python {doc['python']}; "
          f"{doc['age_buckets']} age buckets, 4 widths + no speculation; median of 7 runs of 2,000 calls.", "",
          "| batch size | us per choose |", "|---:|---:|"] + [f"| {r['bs']} | {r['us_per_choose']} |" for r in rows]
    print("\n".join(md))
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
