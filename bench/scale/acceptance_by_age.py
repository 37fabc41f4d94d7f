"""Accepted tokens per round vs the round's index in the request's life, on the toy chain pair.

    PYTHONPATH=. python bench/scale/acceptance_by_age.py [--prompts 24] [--new-tokens 64] [--run-budget 63]
        [--out F.json]

Why (session 21): at the start of every c=64 repeat the adaptive controller's counterfactual
acceptance halves, even with the width pinned, while SGLang counts no penalty per request.  Question:
does a request accept less in its first rounds (a random-id prompt, the chain only after it), so that a
burst of fresh requests is truly low for a while?  The scaled chain pair computes the toy pair's
function (``chain_pair.py``), so the toy pair (fp32, CPU) answers it: the A/B's prompts
(``mk_chain_prompts.chain_prompts``), one budget-63 tree per round, the counterfactual accept length
of budgets 7/15/31/63 (``tree_ops.counterfactual_accept_len``) per round index.  Slow (the plain-torch
forwards recompute the whole sequence: ~40 s per prompt); the JSON is rewritten after every prompt.

``--run-budget B`` runs trees of budget B (the sequence of rounds a server pinned at B runs; budgets
above B are not counted) and the JSON also lists every round (``rounds``: prompt, round index, output
tokens before the round, counterfactual accepted per budget, tokens emitted), so runs at two budgets
can be compared: does the narrower budget's counterfactual, read from the wider run's rounds, predict
what the narrower run's own rounds accept (session 22: the MoE c=1 records say it reads low)?
"""
import argparse
import collections
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "device"))
sys.path.insert(0, HERE)

import chain_pair as CP  # noqa: E402
import mk_chain_prompts as MCP  # noqa: E402
import mk_models as M  # noqa: E402
from sglang_ddtree import ddtree, demo, tree_ops  # noqa: E402

BUDGETS = (7, 15, 31, 63)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--run-budget", type=int, default=max(BUDGETS))
    ap.add_argument("--out", default="/tmp/acceptance_by_age.json")
    a = ap.parse_args()
    budgets = [b for b in BUDGETS if b <= a.run_budget]
    if not budgets or a.run_budget < 1:
        raise SystemExit(f"--run-budget must be >= {min(BUDGETS)}")
    rounds = []
    pair = demo.TinyPair(CP.DEFAULT_DRAFTER)         # the toy chain target + the block-16 drafter
    pair.block_size, pair.drafter_cfg = CP.DEFAULT_BLOCK, M.drafter_config(CP.DEFAULT_BLOCK)
    pair.depth = pair.block_size - 1
    sums = collections.defaultdict(lambda: [0, [0] * len(budgets)])   # round index -> [n, sums]
    for i, prompt in enumerate(MCP.chain_prompts(a.prompts, seed=0)):
        seq, emitted, r = list(prompt), 0, 0
        while emitted < a.new_tokens:
            lp, ids = ddtree.topk_logprobs(pair.draft_logits(seq)[None].float(), a.run_budget)
            tree = ddtree.build_tree(lp, ids, a.run_budget, root_tokens=torch.tensor([seq[-1]]))
            target = pair.verify(seq, tree.tokens[0], tree.depth[0], tree.visibility[0])[None]
            acc = ddtree.accept_greedy(tree, target)
            cf = tree_ops.counterfactual_accept_len(acc.path, budgets)[0].tolist()
            s = sums[r]
            s[0] += 1
            s[1] = [x + y for x, y in zip(s[1], cf)]
            new = [t for t in acc.new_tokens(tree)[0].tolist() if t >= 0]
            rounds.append([i, r, emitted, cf, len(new)])
            seq += new
            emitted += len(new)
            r += 1
        out = {str(k): dict(n=n, **{f"b{b}": round(v / n, 3) for b, v in zip(budgets, tot)})
               for k, (n, tot) in sorted(sums.items())}
        with open(a.out, "w") as f:
            json.dump(dict(prompts_done=i + 1, new_tokens=a.new_tokens, run_budget=a.run_budget,
                           budgets=budgets, by_round=out, rounds=rounds), f, indent=1)
        print(f"prompt {i} (len {len(prompt)}): {r} rounds -> {a.out}", flush=True)
    for k, v in out.items():
        print(k, v)


if __name__ == "__main__":
    main()
