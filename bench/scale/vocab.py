"""Learn the lm_head rows of the ids the text pair's tokenizer never emits (2,048 -> 151,936 ids).

A production Qwen3 has 151,936 ids: its lm_head GEMM, logsumexp and the drafter's top-K all run
over that width. The text pair has 2,048. Padding the head with zero rows would put 149,888 junk
ids at logit 0 -- inside the trees, since real logits are often negative. Instead the new rows are
trained the way the pair itself was, with the body and the real rows frozen (so the pair's function
on real ids is unchanged, bit for bit):

* row j = ``direction + 0.02 * r_j``, r_j ~ N(0, 1) seeded (the model's own init std), and the
  learned ``direction`` [256] is what training moves: with frozen features, the gradient of row j
  is sum_n p_nj h_n, the same for every junk row up to the softmax weight, so a shared update is
  what full training of these rows does;
* the loss is the pair's: next-token cross-entropy at every position of train-split windows, for
  the target's final hidden states and for the drafter's (block positions 1..L-1, the drafter
  borrows the target's head); AdamW (0.9, 0.95), lr 3e-3 with 200 warm-up steps and a cosine to
  3e-4, weight decay 0.1, 4,861 steps: the target's recipe.
  The junk part of each position's logsumexp is ``h.direction + LSE_j(0.02 r_j . h)``; the second
  term does not depend on ``direction`` and is computed once.

Writes bench/scale/junk_head.json (seed, std, direction, recipe, and what it gives on held-out
prompts: junk probability mass, margin of the best junk id under the best real id, how often a junk
id is among the top 8). CPU, ~2 minutes; needs this machine's Python stdlib to match the corpus
manifest (bench/textpair/corpus.py).

    python bench/scale/vocab.py [--out bench/scale/junk_head.json]

The code pair (bench/codepair, issue 42; its own 8,192-id tokenizer, hidden 512) gets its rows the same
way on the GPU host, from its folders and the train split of its corpus (no file committed: the pair is
regenerated there):

    python bench/scale/vocab.py --pair code --target-dir /tmp/models/code_target \
        --drafter-dir /tmp/models/code_drafter --train-stream /tmp/codepair/corpus/train.pt \
        --prompts /tmp/models/code_heldout_prompts.json --out /tmp/models/code_junk_head.json
"""
import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # transform.py (bench/scale holds nothing else importable)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "textpair"))
import common as C  # noqa: E402
import corpus  # noqa: E402
import transform as T  # noqa: E402  (bench/scale on sys.path as the script's folder)
from sglang_ddtree import reference_model as RM  # noqa: E402
from sglang_ddtree import textpair as TP  # noqa: E402

VOCAB = T.SHAPES["qwen3-8b"]["vocab"]
SEED, STD = 20261201, 0.02
STEPS, LR, LR_MIN, WARMUP, WD = 4861, 3e-3, 3e-4, 200, 0.1


def pair_spec(tcfg, dcfg):
    """What the functions below read of a pair: configs, block size, mask id, target_layer_ids, vocab."""
    dc = dcfg.get("dflash_config", {})
    return {"target": tcfg, "drafter": dcfg, "block": dc.get("block_size", dcfg.get("block_size")),
            "mask": dc.get("mask_token_id", C.MASK), "ids": list(dc["target_layer_ids"]),
            "vocab": tcfg["vocab_size"]}


TEXT = pair_spec(TP.TARGET, dict(TP.DRAFTER, dflash_config=dict(TP.DRAFTER.get("dflash_config", {}),
                                                                  block_size=TP.BLOCK_SIZE, mask_token_id=TP.MASK,
                                                                  target_layer_ids=list(TP.TARGET_LAYER_IDS))))


def stream_windows(ids, n_windows, length, gen):
    """n_windows random windows of length + 1 tokens from a token stream (a 1-D tensor)."""
    ids = torch.as_tensor(ids).long()
    starts = torch.randint(0, len(ids) - length - 1, (n_windows,), generator=gen)
    return torch.stack([ids[s:s + length + 1] for s in starts.tolist()])


def windows(files, n_windows, length, gen):
    tok = corpus.load_tokenizer()
    ids, _ = corpus.encode_files(tok, files)
    return stream_windows(torch.tensor(ids), n_windows, length, gen)


def drafter_hidden(P, E, feats, root, n, pair=None):
    """The drafter's final normed hidden states [B, L-1, H] (reference_model.drafter_forward
    without the head): logits = hidden @ lm_head.T."""
    pair = pair or TEXT
    eye = torch.eye(E.shape[1], device=E.device, dtype=E.dtype)
    return RM.drafter_forward(P, pair["drafter"], pair["block"], pair["mask"], E, eye, feats, root, n)


def features(Tsd, P, win, n_ctx, pair=None):
    """(h [N, H] final normed hidden states, next-token ids [N]) for the target at every window
    position and for the drafter's block after the first n_ctx tokens of each window."""
    pair = pair or TEXT
    ids = win[:, :-1]
    last = pair["target"]["num_hidden_layers"] - 1
    layers = sorted(set(pair["ids"]) | {last})
    with torch.no_grad():
        f = RM.target_features(Tsd, pair["target"], ids, layers)
        h_t = RM.rms(f[last], Tsd["model.norm.weight"]).reshape(-1, Tsd["model.norm.weight"].shape[0])
        y_t = win[:, 1:].reshape(-1)
        feats = torch.cat([f[t][:, :n_ctx] for t in pair["ids"]], -1)
        L = pair["block"]
        h_d = drafter_hidden(P, Tsd["model.embed_tokens.weight"], feats, win[:, n_ctx], n_ctx, pair)
        y_d = win[:, n_ctx + 1:n_ctx + L]
    return h_t, y_t, h_d.reshape(-1, h_t.shape[1]), y_d.reshape(-1)


def lse_junk_noise(h, n_junk, chunk=512):
    """LSE_j(STD r_j . h_n) for every row of h [N, H] (the part of the junk logsumexp that does not
    depend on the learned direction)."""
    R = T.junk_rows(n_junk, h.shape[1], torch.zeros(h.shape[1]), SEED, STD).to(h.device)
    return torch.cat([torch.logsumexp(h[i:i + chunk] @ R.T, -1) for i in range(0, len(h), chunk)])


def fit(h, real_lse, noise_lse):
    """AdamW on the direction: minimise mean softplus(h.b + noise_lse - real_lse) (the junk part of
    -log p(true token)), the target's recipe."""
    b = torch.zeros(h.shape[1], device=h.device, requires_grad=True)
    opt = torch.optim.AdamW([b], lr=LR, betas=(0.9, 0.95), weight_decay=WD)
    for step in range(STEPS):
        lr = LR * step / WARMUP if step < WARMUP else \
            LR_MIN + 0.5 * (LR - LR_MIN) * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = torch.nn.functional.softplus(h @ b + noise_lse - real_lse).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return b.detach(), float(loss.detach())


def evaluate(Tsd, P, direction, prompts, n_junk, pair=None):
    """Junk statistics on held-out prompts with the extended head: target at every position, the
    drafter on one block per prompt."""
    pair = pair or TEXT
    V_s, B = pair["vocab"], pair["block"]
    head = {k: Tsd[k].cpu() for k in ("model.embed_tokens.weight", "lm_head.weight")}  # junk rows: CPU-seeded
    W = T.extend_vocab(head, VOCAB, torch.as_tensor(direction).cpu(), SEED)["lm_head.weight"].to(
        Tsd["lm_head.weight"].device)
    out = {}
    for who in ("target", "drafter"):
        mass, margin, in_top8, n = [], [], 0, 0
        for p in prompts:
            p = p["ids"] if isinstance(p, dict) else p
            ids = torch.tensor([p], device=W.device)
            if len(p) < B + 8:
                continue
            win = ids[:, :min(len(p), 160)]
            h_t, _, h_d, _ = features(Tsd, P, torch.cat([win, win[:, -1:]], 1), n_ctx=win.shape[1] - B - 1,
                                      pair=pair)
            h = h_t if who == "target" else h_d
            with torch.no_grad():
                lg = h @ W.T
            pr = torch.softmax(lg, -1)
            mass.append(pr[:, V_s:].sum(-1))
            margin.append(lg[:, V_s:].max(-1).values - lg[:, :V_s].max(-1).values)
            in_top8 += int((lg.topk(8, -1).indices >= V_s).any(-1).sum())
            n += len(h)
        mass, margin = torch.cat(mass), torch.cat(margin)
        out[who] = {"positions": n, "junk_mass_mean": float(mass.mean()), "junk_mass_max": float(mass.max()),
                    "best_junk_minus_best_real_logit_max": float(margin.max()),
                    "best_junk_minus_best_real_logit_median": float(margin.median()),
                    "positions_with_a_junk_id_in_top8": in_top8}
    return out


def learn(Tsd, P, win, n_ctx, prompts, pair=None):
    """The junk direction for a pair (fp32 state dicts ``Tsd`` / ``P``) from train windows ``win``,
    and its held-out statistics on ``prompts``: the junk_head.json document (no timing)."""
    pair = pair or TEXT
    h_t, y_t, h_d, y_d = features(Tsd, P, win, n_ctx, pair)
    h = torch.cat([h_t, h_d])
    with torch.no_grad():
        real_lse = torch.logsumexp(h @ Tsd["lm_head.weight"].T, -1)
    n_junk = VOCAB - pair["vocab"]
    noise = lse_junk_noise(h, n_junk)
    b, loss = fit(h, real_lse, noise)
    b = b.cpu()
    ev = evaluate(Tsd, P, b, prompts, n_junk, pair)
    return {"seed": SEED, "std": STD, "vocab": VOCAB, "real_vocab": pair["vocab"],
            "recipe": {"steps": STEPS, "lr": LR, "lr_min": LR_MIN, "warmup": WARMUP, "weight_decay": WD,
                       "betas": [0.9, 0.95], "train_windows": len(win), "window_tokens": win.shape[1] - 1,
                       "target_positions": len(h_t), "drafter_positions": len(h_d)},
            "final_train_junk_loss": loss, "heldout": ev,
            "made_by": "bench/scale/vocab.py", "direction": [round(float(x), 6) for x in b]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "junk_head.json"))
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--pair", choices=("text", "code"), default="text")
    ap.add_argument("--target-dir", default=None, help="--pair code: the small target's HF folder")
    ap.add_argument("--drafter-dir", default=None, help="--pair code: the small drafter's HF folder")
    ap.add_argument("--train-stream", default=None, help="--pair code: the train split's token stream "
                    "(bench/codepair/codecorpus.py's WORK/corpus/train.pt)")
    ap.add_argument("--prompts", default=None, help="--pair code: held-out prompts JSON (input_ids)")
    ap.add_argument("--device", default="cpu", help="where the features and the fit run (cuda on the GPU host)")
    a = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    if a.pair == "text":
        Tsd, P = TP.load_pair()
        pair = TEXT
        train, _ = corpus.read_corpus()
        win = windows(train, a.windows, a.length, gen)
        prompts = TP.heldout_prompts()
        extra = {}
    else:
        if not (a.target_dir and a.drafter_dir and a.train_stream and a.prompts):
            ap.error("--pair code needs --target-dir, --drafter-dir, --train-stream and --prompts")
        Tsd, tcfg = T.load_folder(a.target_dir)
        P, dcfg = T.load_folder(a.drafter_dir)
        pair = pair_spec(tcfg, dcfg)
        win = stream_windows(torch.load(a.train_stream), a.windows, a.length, gen)
        with open(a.prompts) as f:
            prompts = [p.get("ids", p.get("input_ids")) for p in json.load(f)]
        extra = {"pair": "code", "target_dir": a.target_dir, "drafter_dir": a.drafter_dir,
                 "train_stream": a.train_stream, "prompts": a.prompts}
    dev = a.device
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    Tsd = {k: v.float().to(dev) for k, v in Tsd.items()}
    P = {k: v.float().to(dev) for k, v in P.items()}
    doc = learn(Tsd, P, win.to(dev), a.length - pair["block"] - 1, prompts, pair)
    doc.update(extra)
    doc["cpu_seconds" if dev == "cpu" else "seconds"] = round(time.time() - t0, 1)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in doc.items() if k != "direction"}, indent=1))


if __name__ == "__main__":
    main()
