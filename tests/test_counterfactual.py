"""``tree_ops.counterfactual_accept_len``: after a verify of a budget-b tree, the accept length each
budget b' <= b would have given, against a brute-force replay (build the budget-b' tree with the
reference heap and walk the same target) on random trees and targets drawn fresh each run and on
the captured drafter top-k (issue 17's counterfactual acceptance)."""
import glob
import json
import os

import numpy as np
import torch

from helpers import drafter_logits, logprobs_from_logits
from sglang_ddtree import assets, ddtree, tree_ops


def _slot_paths(tree):
    """tokens along the path root..slot (root excluded) for every slot: list per request of tuples."""
    tok, par = tree.tokens.tolist(), tree.parent.tolist()
    out = []
    for t, p in zip(tok, par):
        paths = []
        for i in range(len(t)):
            seq, j = [], i
            while j > 0:
                seq.append(t[j])
                j = p[j]
            paths.append(tuple(reversed(seq)))
        out.append(paths)
    return out


def _target_tokens(tree, target):
    """The target's greedy choice at every slot: ``target(b, path tokens)``."""
    return torch.tensor([[target(b, path) for path in paths] for b, paths in enumerate(_slot_paths(tree))],
                        dtype=torch.int64)


def _check(lp, ids, roots, big, smalls, target):
    tree = ddtree.build_tree(lp[..., :big].contiguous(), ids[..., :big].contiguous(), big, root_tokens=roots,
                             backend="reference")
    acc = ddtree.accept_greedy(tree, _target_tokens(tree, target), backend="reference")
    got = tree_ops.counterfactual_accept_len(acc.path, smalls)
    assert got.shape == (lp.shape[0], len(smalls))
    for j, b in enumerate(smalls):
        t2 = ddtree.build_tree(lp[..., :b].contiguous(), ids[..., :b].contiguous(), b, root_tokens=roots,
                               backend="reference")
        a2 = ddtree.accept_greedy(t2, _target_tokens(t2, target), backend="reference")
        assert torch.equal(got[:, j], a2.accept_len), (b, got[:, j], a2.accept_len)
    assert torch.equal(got[:, -1], acc.accept_len) if smalls[-1] == big else True
    return got


def test_random_trees_against_a_brute_force_replay(rng):
    for _ in range(6):
        bs, D, V = 6, int(torch.randint(2, 8, (1,), generator=rng)), 12
        big = int(torch.randint(8, 40, (1,), generator=rng))
        smalls = sorted({1, 2, 3, big // 4 or 1, big // 2, big - 1, big})
        logits = drafter_logits(bs, D, V, rng)
        lp, ids = logprobs_from_logits(logits, min(big, V))
        if lp.shape[-1] < big:   # pad the rows (tiny vocabulary): -inf entries, distinct ids
            pad = big - lp.shape[-1]
            lp = torch.cat([lp, torch.full((bs, D, pad), float("-inf"))], -1)
            ids = torch.cat([ids, torch.arange(V, V + pad).expand(bs, D, pad)], -1)
        roots = torch.randint(0, V, (bs,), generator=rng)
        seed = int(torch.randint(0, 2 ** 31, (1,), generator=rng))
        drafted = [[int(x) for x in ids[b, :, 0]] for b in range(bs)]

        def target(b, path, seed=seed, drafted=drafted):
            # follow the drafter's top-1 mostly, sometimes another token: accepts of every length
            h = hash((seed, b, path)) % 7
            d = len(path)
            if d < len(drafted[b]) and h < 4:
                return drafted[b][d]
            return int(ids[b, min(d, D - 1), 1 + h % (ids.shape[-1] - 1)]) if h < 6 else 0
        _check(lp, ids, roots, big, smalls, target)


def test_captured_topk_along_the_true_continuation():
    for path in sorted(glob.glob(os.path.join(assets.FIXTURES_DIR, "*.npz"))):
        z = np.load(path, allow_pickle=False)
        meta = json.loads(str(z["meta"]))
        lp, ids = torch.from_numpy(z["log_probs"]), torch.from_numpy(z["token_ids"])
        roots = torch.tensor(meta["root_ids"], dtype=torch.int64)
        cont = meta["target_greedy"]
        big = min(32, lp.shape[-1])

        def target(b, p, cont=cont):
            return cont[b][len(p)] if list(p) == cont[b][: len(p)] and len(p) < len(cont[b]) else 0
        got = _check(lp, ids, roots, big, [1, 4, 8, 16, big], target)
        assert got[:, -1].sum() > got[:, 0].sum()      # a larger budget accepts more somewhere
