"""The main job on a built-in default: the DDTree pipeline through the real kernels.

    python -m sglang_ddtree.demo [--budget 16] [--new-tokens 40] [--json out.json]

Runs on CUDA when present, else on the CPU with the Triton kernels under the interpreter.

1. Captured tensors: every ``sglang_ddtree/data/fixtures/*.npz`` (package data: top-k captured from the text pair's DFlash
   drafter inside SGLang on the GPU test bed) is turned into trees by the GPU kernels and by the
   exact CPU heap; they must agree node for node.
2. A tiny model pair, end to end (``--pair``): by default the text pair (package data; model card
   in the checkout's ``bench/textpair``: a Qwen3 target and its DFlash drafter trained on the Python
   standard library, 4 held-out prompts); ``--pair gqa`` (checkout only) is the test bed's
   deterministic permutation-chain GQA target and its drafter.  Both run in plain torch (fp32) on the forward SGLang runs.  Each round: drafter block
   forward -> ``topk_logprobs`` ->
   ``build_tree`` -> one target forward over the tree (positions start + depth, ancestor-only
   mask) -> ``accept_greedy`` -> commit.  The output must equal the target's own greedy decoding
   token for token; acceptance per round and sibling wins are reported.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402

from . import assets, ddtree  # noqa: E402
from . import reference_model as RM  # noqa: E402
from . import textpair as TP  # noqa: E402

# the checkout, for --pair gqa only (realpath: the GPU test bed installs the package as symlinks
# into the checkout); the default run needs nothing outside the package
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
TESTBED = os.path.join(ROOT, "bench", "device")


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_fixtures(fixture_dir, budgets, dev):
    rows = []
    for path in sorted(glob.glob(os.path.join(fixture_dir, "*.npz"))):
        z = np.load(path, allow_pickle=False)
        meta = json.loads(str(z["meta"]))
        lp = torch.from_numpy(z["log_probs"]).to(dev)
        ids = torch.from_numpy(z["token_ids"]).to(dev)
        for budget in budgets:
            k = min(budget, lp.shape[-1])
            a, b = lp[..., :k].contiguous(), ids[..., :k].contiguous()
            t0 = time.perf_counter()
            got = ddtree.build_tree(a, b, budget, validate=False)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_kernel = time.perf_counter() - t0
            want = ddtree.build_tree(a.cpu(), b.cpu(), budget, backend="reference")
            same = all(torch.equal(getattr(got, f).cpu(), getattr(want, f))
                       for f in ("tokens", "depth", "parent", "num_nodes", "visibility", "mask_words"))
            row = dict(fixture=os.path.basename(path), source=meta.get("source", "")[:80],
                       bs=int(lp.shape[0]), D=int(lp.shape[1]), budget=budget, identical=same,
                       mean_max_depth=float(got.depth.max(1).values.float().mean()),
                       kernel_s=round(t_kernel, 3))
            if "target_greedy" in meta:  # the target's true continuation of each root
                greedy = torch.tensor(meta["target_greedy"], dtype=torch.int64)
                target = true_path_targets(got, greedy).to(dev)
                acc = ddtree.accept_greedy(got, target)
                ref = ddtree.accept_greedy(want, target.cpu(), backend="reference")
                row["identical"] = same and torch.equal(acc.path.cpu(), ref.path)
                row["tree_tokens_per_round"] = float(acc.accept_len.float().mean()) + 1
                chain = (ids[..., 0].cpu() == greedy).long().cumprod(1).sum(1)
                row["chain_tokens_per_round"] = float(chain.float().mean()) + 1
            rows.append(row)
    return rows


def true_path_targets(tree, greedy):
    """Target choices that make the accept walk follow the target's true continuation.

    greedy [bs, D]: the target's greedy tokens after each root.  A node at depth d gets
    greedy[d]; the walk only visits nodes whose path equals the greedy prefix, so nodes off
    that path never matter.
    """
    bs, N = tree.tokens.shape
    D = greedy.shape[1]
    depth = tree.depth.cpu().long().clamp(max=D - 1)
    out = torch.gather(greedy, 1, depth)
    return torch.where(tree.depth.cpu() >= D, torch.zeros_like(out), out)


class _Pair:
    """A target + DFlash drafter in plain torch (fp32 compute): the forwards SGLang runs
    (:mod:`sglang_ddtree.reference_model`).  Subclasses set sd / P / E / W, the two configs,
    block_size, mask_id, layer_ids and vocab."""

    def target_logits(self, ids, pos, mask):
        """Target forward of ids [T] at positions pos [T] with a boolean mask [T, T] -> logits [T, V]."""
        return RM.target_logits(self.sd, self.target_cfg, ids[None], pos, mask)[0]

    def greedy(self, prompt, n_new):
        seq = list(prompt)
        for _ in range(n_new):
            ids = torch.tensor(seq)
            L = len(seq)
            logits = self.target_logits(ids, torch.arange(L), torch.ones(L, L, dtype=torch.bool).tril())
            seq.append(int(logits[-1].argmax()))
        return seq[len(prompt):]

    def draft_logits(self, seq):
        """Drafter block logits [D, V] (bf16-rounded, as SGLang's are) for committed tokens seq."""
        n = len(seq) - 1  # features of tokens 0..n-1; seq[n] (the bonus) is the block's root
        ids = torch.tensor(seq[:n])[None]
        f = RM.target_features(self.sd, self.target_cfg, ids, self.layer_ids)
        feats = torch.cat([f[i] for i in self.layer_ids], -1)
        lg = RM.drafter_forward(self.P, self.drafter_cfg, self.block_size, self.mask_id, self.E, self.W,
                                feats, torch.tensor([seq[n]]), n)
        return lg[0].to(torch.bfloat16)

    def verify(self, seq, tree_tokens, tree_depth, visibility):
        """Target argmax at every tree slot; slot 0 is seq[-1] (the root)."""
        n = len(seq) - 1
        N = tree_tokens.shape[0]
        ids = torch.cat([torch.tensor(seq[:n]), tree_tokens.clamp(min=0)])
        pos = torch.cat([torch.arange(n), n + tree_depth.long()])
        mask = torch.zeros(n + N, n + N, dtype=torch.bool)
        mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        mask[n:, :n] = True
        mask[n:, n:] = visibility
        return self.target_logits(ids, pos, mask)[n:].argmax(-1)

    def _heads(self):
        self.E, self.W = self.sd["model.embed_tokens.weight"], self.sd["lm_head.weight"]
        self.depth = self.block_size - 1


class TextPair(_Pair):
    """The text-trained pair (:mod:`sglang_ddtree.textpair`: its weights and held-out prompts ship
    with the package)."""

    def __init__(self, drafter_path=None):
        from safetensors.torch import load_file

        tgt, drf = TP.load_pair()
        self.sd = {k: v.float() for k, v in tgt.items()}
        self.P = {k: v.float() for k, v in (load_file(drafter_path).items() if drafter_path
                                             else drf.items())}
        self.target_cfg, self.drafter_cfg = TP.TARGET, TP.DRAFTER
        self.block_size, self.mask_id, self.layer_ids = TP.BLOCK_SIZE, TP.MASK, TP.TARGET_LAYER_IDS
        self.vocab = TP.VOCAB
        self._heads()

    def prompts(self, g):
        return [p["ids"] for p in sorted(TP.heldout_prompts(), key=lambda p: len(p["ids"]))[:4]]


class TinyPair(_Pair):
    """The test bed's GQA permutation-chain target + its trained drafter (``bench/device``: needs the
    checkout, the wheel does not carry the test bed)."""

    def __init__(self, drafter_path=None):
        if not os.path.isfile(os.path.join(TESTBED, "mk_models.py")):
            raise SystemExit(f"--pair gqa needs the sglang-ddtree checkout (bench/device/, not found at "
                             f"{TESTBED}); the installed package runs the default --pair text")
        sys.path.insert(0, TESTBED)
        import mk_models as M
        from safetensors.torch import load_file
        self.sd, _ = M.qwen3_target_state()
        self.P = {k: v.float() for k, v in load_file(drafter_path or M.DEFAULT_DRAFTER).items()}
        self.target_cfg, self.drafter_cfg = M.QWEN3, M.DRAFTER
        self.block_size, self.mask_id, self.layer_ids = M.BLOCK_SIZE, M.MASK_ID, M.TARGET_LAYER_IDS
        self.vocab = M.VOCAB
        self._heads()

    def prompts(self, g):
        return [torch.randint(3, self.vocab - 1, (int(n),), generator=g).tolist() for n in (3, 5, 8, 6)]


def run_pipeline(pair, prompts, budget, n_new, dev):
    """DDTree speculative decoding of all prompts together (batched kernels, per-request models)."""
    bs = len(prompts)
    seqs = [list(p) for p in prompts]
    done = [0] * bs
    rounds, accepted, sibling_rounds = 0, [], 0
    k = min(budget, pair.vocab)
    while min(done) < n_new:
        live = [i for i in range(bs) if done[i] < n_new]
        logits = torch.stack([pair.draft_logits(seqs[i]) for i in live]).to(dev)  # [b, D, V]
        lp, ids = ddtree.topk_logprobs(logits, k)
        roots = torch.tensor([seqs[i][-1] for i in live], device=dev)
        tree = ddtree.build_tree(lp, ids, budget, root_tokens=roots)
        tok, dep, vis = tree.tokens.cpu(), tree.depth.cpu(), tree.visibility.cpu()
        target = torch.stack([pair.verify(seqs[i], tok[j], dep[j], vis[j]) for j, i in enumerate(live)])
        acc = ddtree.accept_greedy(tree, target.to(dev))
        new = acc.new_tokens(tree).cpu()
        path = acc.path.cpu()
        par = tree.parent.cpu()
        for j, i in enumerate(live):
            n_acc = int(acc.accept_len[j])
            toks = [t for t in new[j].tolist() if t >= 0][: n_new - done[i]]
            seqs[i].extend(toks)
            done[i] += len(toks)
            accepted.append(n_acc)
            # did the accepted path leave the drafter's first-rank chain (a sibling won)?
            for node in path[j, 1:n_acc + 1].tolist():
                earlier = (par[j, 1:node] == par[j, node]).any()
                if bool(earlier):
                    sibling_rounds += 1
                    break
        rounds += 1
    outs = [s[len(p):len(p) + n_new] for s, p in zip(seqs, prompts)]
    return outs, dict(rounds=rounds, request_rounds=len(accepted),
                      mean_tokens_per_round=float(np.mean(accepted)) + 1.0,
                      sibling_win_rounds=sibling_rounds)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--fixtures", default=assets.FIXTURES_DIR)
    ap.add_argument("--pair", choices=("text", "gqa"), default="text",
                    help="text: the stdlib-trained pair (default); gqa: the test bed's permutation-chain pair")
    ap.add_argument("--drafter", default=None, help="drafter safetensors (default: the pair's own)")
    ap.add_argument("--json", default=None, help="also write the report here")
    a = ap.parse_args(argv)
    if a.budget < 1 or a.new_tokens < 1:
        ap.error("--budget and --new-tokens must be >= 1")
    dev = _device()
    print(f"sglang-ddtree demo on {dev} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})")
    report = dict(device=str(dev))
    pair = (TextPair if a.pair == "text" else TinyPair)(a.drafter)   # fails fast without its files

    print("\n[1] captured drafter top-k -> GPU tree kernels vs the exact CPU heap")
    fx = run_fixtures(a.fixtures, sorted({8, a.budget, 32}), dev)
    if not fx:
        sys.exit(f"no fixtures found under {a.fixtures}")
    for r in fx:
        acc = ""
        if "tree_tokens_per_round" in r:
            acc = (f"  tokens/round on the true continuation: tree {r['tree_tokens_per_round']:.2f}"
                   f" vs chain {r['chain_tokens_per_round']:.2f}")
        print(f"  {r['fixture']:<24} bs={r['bs']} D={r['D']} budget={r['budget']:>3}: "
              f"identical={r['identical']}  mean max depth {r['mean_max_depth']:.1f}{acc}")
    report["fixtures"] = fx

    name = ("text pair (Qwen3 target + DFlash drafter trained on the Python stdlib, held-out prompts)"
            if a.pair == "text" else "tiny GQA permutation-chain target + trained DFlash drafter")
    print(f"\n[2] {name}, budget {a.budget}, {a.new_tokens} new tokens")
    g = torch.Generator().manual_seed(0)
    prompts = pair.prompts(g)
    t0 = time.perf_counter()
    outs, stats = run_pipeline(pair, prompts, a.budget, a.new_tokens, dev)
    t_spec = time.perf_counter() - t0
    greedy = [pair.greedy(p, a.new_tokens) for p in prompts]
    identical = outs == greedy
    stats.update(identical_to_greedy=identical, seconds=round(t_spec, 1), budget=a.budget, pair=a.pair,
                 new_tokens=a.new_tokens, requests=len(prompts))
    print(f"  {len(prompts)} requests, {stats['rounds']} batched rounds; tokens per request-round "
          f"{stats['mean_tokens_per_round']:.2f} (accepted + bonus); rounds where a non-first-rank "
          f"sibling was accepted: {stats['sibling_win_rounds']}/{stats['request_rounds']}")
    print(f"  output identical to the target's greedy decoding: {identical}")
    report["pipeline"] = stats
    ok = identical and all(r["identical"] for r in fx)
    report["ok"] = ok
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    print("\nOK: every tree matched the reference and the output is lossless" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
