# Acceptance per round vs the request's age on the toy chain pair (the scaled chain pair computes the same
# function), fp32 CPU, counterfactual budgets 7/15/31/63 from one budget-63 tree per round.
# usage: PYTHONPATH=. python bench/scale/acceptance_by_age.py N_PROMPTS  -> /tmp/life.json (slow: ~40 s per prompt)
# Session 21 question: do fresh requests accept less in their first rounds (random-id prompts, chain later)?
import sys, json, random, collections, torch
sys.path.insert(0, "bench/device"); sys.path.insert(0, "bench/scale")
import chain_pair as CP
from sglang_ddtree import demo, ddtree
sys.path.insert(0, "bench/device"); import mk_chain_prompts as MCP
tsd, tcfg, P, dcfg, perm = CP.small_pair()
import mk_models as M
class Pair(demo._Pair):
    pass
p = Pair(); p.sd, p.P, p.target_cfg, p.drafter_cfg = tsd, P, tcfg, dcfg
p.block_size, p.mask_id, p.layer_ids, p.vocab = 16, M.MASK_ID, M.TARGET_LAYER_IDS, M.VOCAB
p._heads()
prompts = MCP.chain_prompts(int(sys.argv[1]), seed=0)
budgets = [7, 15, 31, 63]
by_age = collections.defaultdict(lambda: collections.defaultdict(list))
for pi, pr in enumerate(prompts):
    seq = list(pr); gen = 0; r = 0
    while gen < 64:
        lg = p.draft_logits(seq)[None].float()
        lp, ids = ddtree.topk_logprobs(lg, 63)
        tree = ddtree.build_tree(lp, ids, 63, root_tokens=torch.tensor([seq[-1]]))
        tok, dep, vis = tree.tokens, tree.depth, tree.visibility
        tgt = p.verify(seq, tok[0], dep[0], vis[0])[None]
        acc = ddtree.accept_greedy(tree, tgt)
        path = acc.path[0].tolist(); a = int(acc.accept_len[0])
        for b in budgets:  # counterfactual: accepted prefix restricted to node index <= b
            k = 0
            for node in path[1:a + 1]:
                if node <= b: k += 1
                else: break
            by_age[r][b].append(k)
        new = [t for t in acc.new_tokens(tree)[0].tolist() if t >= 0]
        seq.extend(new); gen += len(new); r += 1
    print(pi, len(pr), r, flush=True)
out = {r: {b: sum(v) / len(v) for b, v in d.items()} | {"n": len(d[7])} for r, d in sorted(by_age.items())}
json.dump(out, open("/tmp/life.json", "w"))
for r, d in out.items(): print(r, d)
