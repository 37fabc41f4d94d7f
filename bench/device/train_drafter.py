"""Train the tiny DFlash drafter against the deterministic toy target (CPU or GPU, seeded).

usage: python bench/device/train_drafter.py --steps 75 --threads 2
       (the committed bench/device/weights/drafter.safetensors.xz; ~1 min on 2 CPU cores; --ckpt-dir D
        saves an evaluated checkpoint every 5 steps from step 40 to pick another operating point)

The drafter forward re-implements exactly what SGLang 0.5.16 runs (sglang/srt/models/dflash.py and
DFlashWorkerV2.forward_batch_generation):
  * context: for each committed token j < n, target hidden states after target layers [1, 2]
    (SGLang captures "before layer k+1"), concatenated -> ctx = hidden_norm(fc(.)); per draft layer
    K/V of the context = k_norm(k_proj(ctx)) with RoPE at position j, v_proj(ctx) (no input norm);
  * block: [root, mask x 7] at positions n..n+7, input = target embeddings; each draft layer is a
    pre-norm Qwen3 layer (per-head q/k RMSNorm, neox RoPE), attention NON-causal over
    [context ; block] (ENCODER_ONLY);
  * logits at block positions 1..7 = target lm_head(norm(h)).
The target's greedy continuation of root is perm^d(root), d = 1..7: the loss is cross-entropy on it.
A short training run learns depth 1 almost always and deeper depths partly, so DFLASH accepts often
but not always, and the right token is sometimes rank 2-3 in the drafter's top-k (what DDTree's
tree needs to exercise sibling paths).
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mk_models as M  # noqa: E402


# The forwards live in the package (the main job runs them from the wheel); here they read the
# shapes from mk_models' module attributes, which bench/textpair/common.install() repoints.
try:
    from sglang_ddtree import reference_model as RM  # noqa: E402
except ImportError:  # a bare checkout without the package installed: its pure-torch modules import
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from sglang_ddtree import reference_model as RM  # noqa: E402

rms, rope_cos_sin, apply_rope = RM.rms, RM.rope_cos_sin, RM.apply_rope


def target_features(sd, ids, upto_layers, pos=None, mask=None):
    """Qwen3 forward (config mk_models.QWEN3); see reference_model.target_features."""
    return RM.target_features(sd, M.QWEN3, ids, upto_layers, pos, mask)


def target_logits(sd, ids, pos=None, mask=None):
    """Full Qwen3 forward -> logits [B, T, V] (config mk_models.QWEN3)."""
    return RM.target_logits(sd, M.QWEN3, ids, pos, mask)


def drafter_forward(P, E, W, feats, root, n):
    """DFlash block forward (config mk_models.DRAFTER, BLOCK_SIZE, MASK_ID): logits [B, L-1, V]."""
    return RM.drafter_forward(P, M.DRAFTER, M.BLOCK_SIZE, M.MASK_ID, E, W, feats, root, n)


def drafter_forward_blocks(P, E, W, feats, roots, anchors, mask=None):
    """N blocks per sequence in one forward (RM.drafter_forward_blocks with mk_models' config):
    feats [b, n_ctx, F], roots / anchors [b, N] -> logits [b, N, L-1, V]."""
    return RM.drafter_forward_blocks(P, M.DRAFTER, M.BLOCK_SIZE, M.MASK_ID, E, W, feats, roots, anchors, mask)


def chain(perm, root, D):
    out, t = [], root
    for _ in range(D):
        t = perm[t]
        out.append(t)
    return torch.stack(out, 1)


def make_data(sd, perm, n_seq, T, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = torch.empty(n_seq, T, dtype=torch.long)
    plen = torch.randint(1, 9, (n_seq,), generator=g)
    for s in range(n_seq):
        p = int(plen[s])
        seqs[s, :p] = torch.randint(3, M.VOCAB - 1, (p,), generator=g)
        for j in range(p, T):
            seqs[s, j] = perm[seqs[s, j - 1]]
    with torch.no_grad():
        f = target_features(sd, seqs, M.TARGET_LAYER_IDS)
    feats = torch.cat([f[i] for i in M.TARGET_LAYER_IDS], -1)
    return seqs, plen, feats


def evaluate(P, E, W, perm, seqs, plen, feats, ns=(2, 8, 16, 30), bf16=True):
    """Per-depth top-1 accuracy, rank histogram of the true token, simulated DFLASH accept length."""
    P2 = {k: (v.detach().to(torch.bfloat16).float() if bf16 else v.detach()) for k, v in P.items()}
    acc, ranks, al = [], torch.zeros(5), []
    with torch.no_grad():
        for n in ns:
            sel = (plen <= n).nonzero().flatten()[:512]
            root = seqs[sel, n]
            lg = drafter_forward(P2, E, W, feats[sel, :n], root, n)
            tgt = chain(perm, root, M.BLOCK_SIZE - 1)
            top1 = lg.argmax(-1)
            ok = top1 == tgt
            acc.append(ok.float().mean(0))
            r = (lg > lg.gather(-1, tgt[..., None])).sum(-1).clamp(max=4)
            ranks += torch.bincount(r.flatten(), minlength=5)[:5].float()
            lead = ok.long().cumprod(1).sum(1)
            al.append(lead.float() + 1)
    acc = torch.stack(acc).mean(0)
    return {"depth_top1": [round(float(a), 3) for a in acc],
            "true_rank_hist(0,1,2,3,>=4)": [round(float(x), 3) for x in ranks / ranks.sum()],
            "sim_accept_len": round(float(torch.cat(al).mean()), 3)}


def set_block_size(B: int) -> None:
    """Repoint mk_models' drafter shape at block size B (its DRAFTER config and BLOCK_SIZE, which the
    forward and the chain targets read)."""
    if not 2 <= B <= 64:
        raise SystemExit(f"--block-size must be in [2, 64], got {B}")
    M.DRAFTER = M.drafter_config(B)
    M.BLOCK_SIZE = B


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3600, help="safety cap on wall time")
    ap.add_argument("--steps", type=int, default=75)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--noise", type=float, default=0.1, help="std of noise added to target features")
    ap.add_argument("--out", default=os.path.join(M.WEIGHTS_DIR, "drafter.safetensors.xz"),
                    help="a .safetensors file, xz-compressed as committed when it ends in .xz")
    ap.add_argument("--cosine", action="store_true")
    ap.add_argument("--ckpt-dir", default="")
    ap.add_argument("--ckpt-from", type=int, default=40)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--norm-init", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=M.BLOCK_SIZE,
                    help="drafter block B (depth B - 1); default the test bed's 8 (16: z-lab's b16 recipe)")
    a = ap.parse_args()
    if a.block_size != M.BLOCK_SIZE:
        set_block_size(a.block_size)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(M.SEED + 10)
    sd, perm = M.qwen3_target_state()
    E, W = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    seqs, plen, feats = make_data(sd, perm, 4096, 40, M.SEED + 11)
    vseqs, vplen, vfeats = make_data(sd, perm, 1024, 40, M.SEED + 12)
    init = M.random_drafter_state()
    init["norm.weight"] = init["norm.weight"] * a.norm_init  # soft logits at the start (scale ~25, not ~250)
    P = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.AdamW(P.values(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.98))
    g = torch.Generator().manual_seed(M.SEED + 13)
    t0 = time.time()
    step = 0
    print("init eval", evaluate(P, E, W, perm, vseqs, vplen, vfeats), flush=True)
    while step < a.steps and time.time() - t0 < a.seconds:
        n = int(torch.randint(1, 33, (1,), generator=g))
        cand = (plen <= n).nonzero().flatten()
        sel = cand[torch.randint(0, len(cand), (a.batch,), generator=g)]
        root = seqs[sel, n]
        f = feats[sel, :n]
        f = f + a.noise * torch.randn(f.shape, generator=g)
        lg = drafter_forward(P, E, W, f, root, n)
        tgt = chain(perm, root, M.BLOCK_SIZE - 1)
        loss = F.cross_entropy(lg.reshape(-1, M.VOCAB), tgt.reshape(-1))
        # step-only schedule (reproducible): 50 warm-up steps, then constant, or cosine with --cosine
        lr = a.lr * min(1.0, (step + 1) / 50)
        if a.cosine:
            lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        for grp in opt.param_groups:
            grp["lr"] = lr
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(P.values(), 1.0)
        opt.step()
        step += 1
        if a.ckpt_dir and step >= a.ckpt_from and step % a.ckpt_every == 0:
            ev = evaluate(P, E, W, perm, vseqs, vplen, vfeats)
            print(f"ckpt step {step} {ev}", flush=True)
            save(P, os.path.join(a.ckpt_dir, f"step{step:05d}.safetensors"), step, t0, ev)
        if step % 25 == 0:
            with torch.no_grad():
                acc = (lg.argmax(-1) == tgt).float().mean(0)
            print(f"step {step} t={time.time()-t0:.0f}s loss {loss.item():.3f} acc/depth "
                  + " ".join(f"{x:.2f}" for x in acc.tolist()), flush=True)
    ev = evaluate(P, E, W, perm, vseqs, vplen, vfeats)
    print("final eval (bf16 weights)", ev, flush=True)
    save(P, a.out, step, t0, ev)


def save(P, path, step, t0, ev):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    from safetensors.torch import save
    meta = {"format": "pt", "steps": str(step), "seconds": f"{time.time()-t0:.0f}",
            "eval": str(ev), "script": "bench/device/train_drafter.py", "seed": str(M.SEED),
            "block_size": str(M.BLOCK_SIZE)}
    blob = save({k: v.detach().to(torch.bfloat16).contiguous() for k, v in P.items()}, metadata=meta)
    if path.endswith(".xz"):
        M.compress_weights(blob, path)
    else:
        with open(path, "wb") as f:
            f.write(blob)
    print("saved", path, os.path.getsize(path), "bytes", flush=True)


if __name__ == "__main__":
    main()
