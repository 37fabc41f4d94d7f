"""Training and evaluation pieces of the text pair (torch + stdlib only; CPU or CUDA).

Every forward is the test bed's reference (bench/device/train_drafter.py) with this pair's configs
installed (common.install()); call torch.set_default_device(dev) first so its internal tensors
(positions, masks, the draft block) land on the right device.
"""
import math

import torch
import torch.nn.functional as F

import common as C

M, TD = C.install()
LAST = C.N_TARGET_LAYERS - 1


def bf16_round(sd):
    return {k: v.detach().to(torch.bfloat16).float() for k, v in sd.items()}


def bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.exp2(e - 7)


def head(T, x):
    """Final norm + tied head on hidden states x (what target_logits does after the last layer)."""
    return TD.rms(x, T["model.norm.weight"]) @ T["model.embed_tokens.weight"].T


def logits(T, ids):
    return TD.target_logits(C.with_head(T), ids)


def lm_loss(T, x, y):
    lg = logits(T, x)
    return F.cross_entropy(lg.float().reshape(-1, C.VOCAB), y.reshape(-1))


def windows(stream, starts, T):
    idx = starts[:, None] + torch.arange(T + 1, device=starts.device)
    w = stream[idx]
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def heldout_eval(T, stream, seq=512, batch=32, max_windows=None):
    """Mean next-token loss over non-overlapping windows of the held-out stream, and the greedy
    stability numbers at every teacher-forced position: fraction whose top-1 / top-2 logit margin
    is below the bf16 spacing at the top-1 logit, plus the margin quantiles."""
    n = (stream.numel() - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    starts = torch.arange(n, device=stream.device) * seq
    tot, cnt, tie, margins = 0.0, 0, 0, []
    for i in range(0, n, batch):
        x, y = windows(stream, starts[i:i + batch], seq)
        lg = logits(T, x).float()
        tot += F.cross_entropy(lg.reshape(-1, C.VOCAB), y.reshape(-1), reduction="sum").item()
        cnt += y.numel()
        top2 = lg.topk(2, -1).values
        m = top2[..., 0] - top2[..., 1]
        tie += (m < bf16_ulp(top2[..., 0])).sum().item()
        margins.append(m.flatten()[::7].cpu())
    loss = tot / cnt
    mq = torch.cat(margins).quantile(torch.tensor([0.01, 0.1, 0.5], device="cpu")).tolist()
    return {"heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 3),
            "positions": cnt, "bf16_tie_frac_teacher_forced": round(tie / cnt, 5),
            "margin_q01_q10_q50": [round(v, 4) for v in mq]}


@torch.no_grad()
def greedy(T, prompts, G):
    """Greedy continuation of G tokens for same-length prompts [B, p] (full recompute per step).
    Returns (seqs [B, p+G], tie count, steps) where a tie is a top-2 margin below bf16 spacing."""
    seq = prompts
    tie = 0
    for _ in range(G):
        x = TD.target_features(C.with_head(T), seq, [LAST])[LAST][:, -1:]
        lg = head(T, x)[:, 0].float()
        top2 = lg.topk(2, -1)
        tie += (top2.values[:, 0] - top2.values[:, 1] < bf16_ulp(top2.values[:, 0])).sum().item()
        seq = torch.cat([seq, top2.indices[:, :1]], 1)
    return seq, tie, prompts.shape[0] * G


@torch.no_grad()
def greedy_cached(T, prompts, G):
    """greedy() with a KV cache: the prompt's forward once, then one token per step (the same
    layers, weights and rounding as target_features; only the per-step work differs, so at a near
    tie the argmax may differ from greedy()'s full recompute). Same returns as greedy()."""
    cfg = C.TARGET
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rep, nl = nq // nkv, cfg["num_hidden_layers"]
    B, P = prompts.shape
    dev = prompts.device
    cos, sin = TD.rope_cos_sin(torch.arange(P + G, device=dev), hd, cfg["rope_theta"])
    K, V = [None] * nl, [None] * nl

    def layers(x, t0):
        t1 = t0 + x.shape[1]
        c, s = cos[t0:t1], sin[t0:t1]
        for i in range(nl):
            p = f"model.layers.{i}."
            h = TD.rms(x, T[p + "input_layernorm.weight"])
            q = (h @ T[p + "self_attn.q_proj.weight"].T).view(B, t1 - t0, nq, hd)
            k = (h @ T[p + "self_attn.k_proj.weight"].T).view(B, t1 - t0, nkv, hd)
            v = (h @ T[p + "self_attn.v_proj.weight"].T).view(B, t1 - t0, nkv, hd)
            q = TD.apply_rope(TD.rms(q, T[p + "self_attn.q_norm.weight"]), c, s)
            k = TD.apply_rope(TD.rms(k, T[p + "self_attn.k_norm.weight"]), c, s)
            if K[i] is None:  # the cache, in the dtype the forward produces
                K[i] = torch.empty((B, P + G, nkv, hd), dtype=k.dtype, device=dev)
                V[i] = torch.empty((B, P + G, nkv, hd), dtype=v.dtype, device=dev)
            K[i][:, t0:t1], V[i][:, t0:t1] = k, v
            kk, vv = K[i][:, :t1].repeat_interleave(rep, 2), V[i][:, :t1].repeat_interleave(rep, 2)
            mask = None if t1 - t0 == 1 else torch.ones(t1 - t0, t1, dtype=torch.bool, device=dev).tril(t0)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                               attn_mask=mask)
            x = x + a.transpose(1, 2).reshape(B, t1 - t0, nq * hd) @ T[p + "self_attn.o_proj.weight"].T
            h = TD.rms(x, T[p + "post_attention_layernorm.weight"])
            x = x + TD.RM.swiglu(T, p + "mlp.", h)
        return x[:, -1:]

    E = T["model.embed_tokens.weight"]
    seq = torch.empty((B, P + G), dtype=prompts.dtype, device=dev)
    seq[:, :P] = prompts
    x, tie = layers(E[prompts], 0), torch.zeros((), dtype=torch.long, device=dev)
    for j in range(G):  # no host sync inside the loop: the tie count is read once at the end
        lg = head(T, x)[:, 0].float()
        top2 = lg.topk(2, -1)
        tie += (top2.values[:, 0] - top2.values[:, 1] < bf16_ulp(top2.values[:, 0])).sum()
        seq[:, P + j] = top2.indices[:, 0]
        if j + 1 < G:
            x = layers(E[seq[:, P + j:P + j + 1]], P + j)
    return seq, int(tie), B * G


@torch.no_grad()
def features(T, seqs, batch=256, dtype=None):
    """Context features as SGLang's DFLASH captures them: hidden after target layers
    TARGET_LAYER_IDS, concatenated -> [B, L, 2H]. dtype (e.g. bf16): each batch is converted into
    one preallocated tensor of that dtype (the same values as converting the concatenation, without
    the whole set at the forward's precision: 4 bytes a value at fp32)."""
    out, buf = [], None
    for i in range(0, seqs.shape[0], batch):
        f = TD.target_features(C.with_head(T), seqs[i:i + batch], C.TARGET_LAYER_IDS)
        x = torch.cat([f[k] for k in C.TARGET_LAYER_IDS], -1)
        if dtype is None:
            out.append(x)
            continue
        if buf is None:
            buf = torch.empty((seqs.shape[0],) + tuple(x.shape[1:]), dtype=dtype, device=x.device)
        buf[i:i + x.shape[0]] = x
    return torch.cat(out) if dtype is None else buf


def drafter_logits(D, T, feats, root, n):
    E = T["model.embed_tokens.weight"]
    return TD.drafter_forward(D, E, E, feats, root, n)


def decay_weights(n, gamma, device=None):
    """Per in-block label weights [n] for block positions k = 1..n: exp(-(k - 1) / gamma) (the
    DFlash recipe's: early positions decide acceptance)."""
    return torch.exp(-torch.arange(n, dtype=torch.float32, device=device) / gamma)


def block_ce(lg, tgt, gamma=None):
    """Mean CE of logits lg [..., B-1, V] on labels tgt [..., B-1]; gamma: each label weighted by
    decay_weights over its in-block position (weighted mean). gamma None: the plain mean."""
    ce = F.cross_entropy(lg.float().reshape(-1, C.VOCAB), tgt.reshape(-1), reduction="none" if gamma else "mean")
    if not gamma:
        return ce
    w = decay_weights(tgt.shape[-1], gamma, tgt.device).expand(tgt.shape).reshape(-1)
    return (ce * w).sum() / w.sum()


def drafter_loss(D, T, seqs, feats, n, gamma=None):
    """One block per sequence at anchor n (seqs [b, S], feats [b, S', F] with S' >= n): (loss,
    ok [b, B-1] bool: argmax == label). gamma: block_ce's per-position weights."""
    lg = drafter_logits(D, T, feats[:, :n].float(), seqs[:, n], n)
    tgt = seqs[:, n + 1:n + C.BLOCK_SIZE]
    ce = block_ce(lg, tgt, gamma)
    return ce, (lg.argmax(-1) == tgt)


def drafter_logits_blocks(D, T, feats, roots, anchors):
    E = T["model.embed_tokens.weight"]
    return TD.drafter_forward_blocks(D, E, E, feats, roots, anchors)


def drafter_loss_multi(D, T, seqs, feats, anchors, gamma=None):
    """N blocks per sequence in one forward: seqs [b, S] greedy sequences, feats [b, S, F] their
    target features, anchors [b, N] long (a block at anchor a: root seqs[a], context features
    0..a-1, labels seqs[a+1 .. a+B-1], so a <= S - B). Only the context up to the largest anchor
    (rounded up to 16) is projected. Returns (loss, ok [b, N, B-1] bool: argmax == label); with
    gamma None the loss is the mean CE over all b x N x (B-1) labels = the mean of drafter_loss over
    the same blocks; gamma: block_ce's per-position weights."""
    B = C.BLOCK_SIZE
    # the context up to the largest anchor, rounded up to 16 keys (the kernels' alignment; the extra
    # positions are masked for every block)
    n_ctx = min(seqs.shape[1], -(-int(anchors.max()) // 16) * 16)
    roots = torch.gather(seqs, 1, anchors)
    lg = drafter_logits_blocks(D, T, feats[:, :n_ctx].float(), roots, anchors)
    idx = anchors.unsqueeze(-1) + torch.arange(1, B, device=anchors.device)
    tgt = torch.gather(seqs, 1, idx.view(seqs.shape[0], -1)).view(idx.shape)
    return block_ce(lg, tgt, gamma), (lg.argmax(-1) == tgt)


def _walk_rounds(acc, p, L, flag=None):
    """The server's rounds over per-anchor accepted lengths acc [S, L] (host): first root at position
    p, a round commits acc[s, n] drafts + the bonus, rounds while the whole block fits. Returns
    (rounds, tokens, rounds whose anchor is set in flag [S, L] bool (0 without one), tokens per
    round of each sequence)."""
    B = C.BLOCK_SIZE
    rounds = toks = flagged = 0
    per_seq = []
    for s in range(acc.shape[0]):
        n, r0, t0 = p, rounds, toks
        while n <= L - B:
            a = int(acc[s, n])
            rounds += 1
            toks += a + 1
            flagged += 0 if flag is None else int(flag[s, n])
            n += a + 1
        per_seq.append((toks - t0) / max(1, rounds - r0))
    return rounds, toks, flagged, per_seq


@torch.no_grad()
def dflash_sim(D, T, seqs, feats, p, batch=256):
    """Offline DFLASH on greedy sequences seqs [S, p+G] (prompt length p): for every anchor n in
    [p, p+G-B] the drafter's block at root seqs[:, n] is compared with the target's greedy tokens.
    Returns per-depth top-1 accuracy over all anchors, the mean accepted+1 per anchor, and the chain
    simulation SGLang runs (first root = the token prefill emits at position p; a round commits the
    accepted drafts + the bonus token; rounds while the whole block fits): mean tokens per round."""
    S, L = seqs.shape
    B = C.BLOCK_SIZE
    anchors = list(range(p, L - B + 1))
    acc = torch.zeros(S, L, dtype=torch.long, device="cpu")
    depth_ok = torch.zeros(B - 1, device="cpu")
    for n in anchors:
        ok_all = []
        for i in range(0, S, batch):
            _, ok = drafter_loss(D, T, seqs[i:i + batch], feats[i:i + batch], n)
            ok_all.append(ok.cpu())
        ok = torch.cat(ok_all)
        depth_ok += ok.float().sum(0)
        acc[:, n] = ok.long().cumprod(1).sum(1)
    rounds, toks, _, per_seq = _walk_rounds(acc, p, L)
    anchor_mean = acc[:, p:L - B + 1].float().mean().item() + 1
    return {"depth_top1": [round(v, 3) for v in (depth_ok / (S * len(anchors))).tolist()],
            "accept_per_anchor": round(anchor_mean, 3),
            "dflash_tokens_per_round": round(toks / rounds, 3), "rounds": rounds,
            "per_seq_min_max": [round(min(per_seq), 2), round(max(per_seq), 2)]}


@torch.no_grad()
def tree_sim(D, T, seqs, feats, p, budgets, batch=256):
    """Offline DDTree on greedy sequences seqs [S, p+G] (prompt length p), beside dflash_sim's chain:
    at every anchor n the drafter's block at root seqs[:, n] gives per-depth top-b log-probs, the
    project's best-first tree of b nodes is built (sglang_ddtree.ddtree, the server's kernels on CUDA,
    the reference on the CPU) and walked against the target's greedy tokens (a node is accepted when
    its token is the greedy token at its depth and its parent was accepted). The rounds then run as
    the server's: first root = the token prefill emits at position p, a round commits the accepted
    path + the bonus, rounds while the whole block fits. Per budget: tokens per round, the mean
    accepted length per anchor, and the share of rounds whose accepted path holds a node that is not
    its parent's first child (a non-first-rank sibling won: what the tree adds over a chain)."""
    from sglang_ddtree import ddtree
    S, L = seqs.shape
    B = C.BLOCK_SIZE
    backend = "triton" if seqs.is_cuda else "reference"
    anchors = list(range(p, L - B + 1))
    acc = {b: torch.zeros(S, L, dtype=torch.long) for b in budgets}
    sib = {b: torch.zeros(S, L, dtype=torch.bool) for b in budgets}
    for n in anchors:
        for i in range(0, S, batch):
            sq = seqs[i:i + batch]
            lg = drafter_logits(D, T, feats[i:i + batch, :n].float(), sq[:, n], n).float()
            for b in budgets:
                lp, ids = ddtree.topk_logprobs(lg, min(b, lg.shape[-1]), backend=backend)
                tree = ddtree.build_tree(lp, ids, b, root_tokens=sq[:, n], backend=backend)
                # the target's greedy token after each slot (its depth): what the verify would emit there
                pos = (n + 1 + tree.depth.long()).clamp(max=L - 1)
                tgt = torch.gather(sq, 1, pos)
                a = ddtree.accept_greedy(tree, tgt, backend=backend)
                par = tree.parent.long()
                k = torch.arange(par.shape[1], device=par.device)
                # slot j has an earlier sibling: some slot k < j with the same (valid) parent
                later = (par.unsqueeze(2) == par.unsqueeze(1)) & (k.view(1, 1, -1) < k.view(1, -1, 1))
                not_first = (later.any(2) & (par >= 0))
                path = a.path.long()
                on_path = (path >= 0) & (torch.arange(path.shape[1], device=path.device).view(1, -1)
                                         <= a.accept_len.long().view(-1, 1))
                hit = torch.gather(not_first, 1, path.clamp(min=0)) & on_path
                hit[:, 0] = False   # the root
                acc[b][i:i + batch, n] = a.accept_len.long().cpu()
                sib[b][i:i + batch, n] = hit.any(1).cpu()
    out = {}
    for b in budgets:
        rounds, toks, sib_rounds, _ = _walk_rounds(acc[b], p, L, sib[b])
        out[str(b)] = {"tokens_per_round": round(toks / max(1, rounds), 3), "rounds": rounds,
                       "accept_per_anchor": round(acc[b][:, p:L - B + 1].float().mean().item() + 1, 3),
                       "sibling_win_round_frac": round(sib_rounds / max(1, rounds), 4)}
    return out


def cosine_lr(step, steps, peak, warm, floor=0.1):
    if step < warm:
        return peak * (step + 1) / warm
    f = (step - warm) / max(1, steps - warm)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, f))))


def adamw(params, lr, wd, fused):
    decay = [p for p in params if p.ndim == 2]
    keep = [p for p in params if p.ndim != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": keep, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=fused)
