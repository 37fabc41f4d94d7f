"""Does a narrow width's counterfactual, read from a wider width's rounds, predict the narrow width's
own rounds?  Reads two ``acceptance_by_age.py --run-budget`` JSONs (same prompts) and writes a
markdown table.

    python bench/scale/counterfactual_bias.py NARROW.json WIDE.json [--out F.md]

For the narrow budget it reports the tokens per round its own rounds emitted, the pooled
counterfactual from the wide run (mean accepted + 1 over the wide run's rounds: what the adaptive
policy used before session 22) and, per set of request-age bucket edges (output tokens), the
counterfactual read per bucket and weighed by where the wide run emitted its tokens (tokens / sum of
tokens_b / (1 + accepted_b)): what a run at the narrow budget over the same outputs would give if
acceptance depended on age alone.
"""
import argparse
import json


def compare(narrow: dict, wide: dict, edge_sets) -> dict:
    n = min(narrow["prompts_done"], wide["prompts_done"])
    own = [r for r in narrow["rounds"] if r[0] < n]
    other = [r for r in wide["rounds"] if r[0] < n]
    j = wide["budgets"].index(narrow["run_budget"])          # the narrow budget's column in the wide run
    out = {"prompts": n, "narrow_budget": narrow["run_budget"], "wide_budget": wide["run_budget"],
           "own_tokens_per_round": sum(r[4] for r in own) / len(own), "own_rounds": len(own),
           "wide_rounds": len(other),
           "pooled_counterfactual": 1 + sum(r[3][j] for r in other) / len(other), "by_age": {}}
    for edges in edge_sets:
        nb = len(edges) + 1
        acc, cnt, tok = [0.0] * nb, [0] * nb, [0.0] * nb
        for _, _, age, cf, emitted in other:
            b = sum(age >= e for e in edges)
            acc[b] += cf[j]
            cnt[b] += 1
            tok[b] += emitted
        rounds = sum(tok[b] / (1 + acc[b] / cnt[b]) for b in range(nb) if cnt[b])
        out["by_age"][",".join(map(str, edges))] = sum(tok) / rounds
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("narrow")
    ap.add_argument("wide")
    ap.add_argument("--out")
    a = ap.parse_args()
    edge_sets = [(8, 16, 32, 64), (4, 6, 9, 14, 20, 30, 45, 68, 100)]
    res = compare(json.load(open(a.narrow)), json.load(open(a.wide)), edge_sets)
    lines = [f"| budget {res['narrow_budget']}: tokens per round | value |", "|---|---|",
             f"| its own rounds ({res['own_rounds']}) | {res['own_tokens_per_round']:.3f} |",
             f"| pooled counterfactual from budget-{res['wide_budget']} rounds ({res['wide_rounds']}) | "
             f"{res['pooled_counterfactual']:.3f} |"]
    for edges, v in res["by_age"].items():
        lines.append(f"| per age bucket (edges {edges}), weighed by tokens | {v:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    main()
