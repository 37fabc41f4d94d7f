"""Plain-torch (fp32) forwards of a Qwen3 target and a DFlash drafter, as SGLang 0.5.16 runs them.

The main job (:mod:`sglang_ddtree.demo`) runs its model pairs with these, and the GPU test bed
(``bench/device/train_drafter.py``) trains and checks its drafters with the same code.  The
drafter forward follows ``sglang/srt/models/dflash.py`` and ``DFlashWorkerV2``:
  * context: for each committed token j < n, the target's hidden states after the layers
    ``target_layer_ids`` (SGLang captures "before layer k+1"), concatenated; ``ctx =
    hidden_norm(fc(.))``; per draft layer K/V of the context = ``k_norm(k_proj(ctx))`` with RoPE at
    position j, ``v_proj(ctx)`` (no input norm);
  * block: ``[root, mask x (L - 1)]`` at positions n..n+L-1, input = the target's embeddings; each
    draft layer is a pre-norm Qwen3 layer (per-head q/k RMSNorm, neox RoPE), attention NON-causal
    over ``[context ; block]``;
  * logits at block positions 1..L-1 = the target's lm_head(norm(h)).
Configs are the Hugging Face ``config.json`` dicts (``head_dim``, ``num_attention_heads``, ...).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * w


def rope_cos_sin(pos, hd, theta):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=pos.device) / hd))
    f = pos.float()[..., None] * inv  # [..., hd/2]
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):  # x [B, T, H, hd]; cos [B?, T, hd]
    x1, x2 = x.chunk(2, -1)
    rot = torch.cat([-x2, x1], -1)
    return x * cos[..., None, :] + rot * sin[..., None, :]


def swiglu(sd, p, h):
    g = h @ sd[p + "gate_proj.weight"].T
    u = h @ sd[p + "up_proj.weight"].T
    return (F.silu(g) * u) @ sd[p + "down_proj.weight"].T


def moe_mlp(sd, p, cfg, h):
    """Qwen3-MoE sparse block: softmax router, top-k experts, weights renormalised when
    ``norm_topk_prob`` (every layer sparse: decoder_sparse_step 1, no mlp_only_layers)."""
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise NotImplementedError("only all-sparse Qwen3-MoE configs")
    probs = torch.softmax((h @ sd[p + "gate.weight"].T).float(), -1)
    topw, topi = probs.topk(cfg["num_experts_per_tok"], -1)
    if cfg.get("norm_topk_prob"):
        topw = topw / topw.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(cfg["num_experts"]):
        w = (topw * (topi == e)).sum(-1, keepdim=True)
        if bool((w != 0).any()):
            out = out + w * swiglu(sd, p + f"experts.{e}.", h)
    return out


def target_features(sd, cfg, ids, upto_layers, pos=None, mask=None):
    """Qwen3 forward of ids [B, T]; returns {layer_id: hidden [B, T, H] after that layer} for
    layer_id in upto_layers.  pos [T] / mask [T, T] bool default to 0..T-1 and causal (a tree
    verify passes its own: positions start + depth, the ancestor-only mask)."""
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    B, T = ids.shape
    x = sd["model.embed_tokens.weight"][ids]
    cos, sin = rope_cos_sin(torch.arange(T, device=ids.device) if pos is None else pos, hd, cfg["rope_theta"])
    out = {}
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    for i in range(max(upto_layers) + 1):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, nq, hd)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, hd)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, hd)
        q = apply_rope(rms(q, sd[p + "self_attn.q_norm.weight"]), cos, sin)
        k = apply_rope(rms(k, sd[p + "self_attn.k_norm.weight"]), cos, sin)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask)
        x = x + a.transpose(1, 2).reshape(B, T, nq * hd) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        if cfg.get("num_experts"):
            x = x + moe_mlp(sd, p + "mlp.", cfg, h)
        else:
            x = x + swiglu(sd, p + "mlp.", h)
        if i in upto_layers:
            out[i] = x
    return out


def target_logits(sd, cfg, ids, pos=None, mask=None):
    """Full Qwen3 forward -> logits [B, T, V] (same arguments as target_features)."""
    last = cfg["num_hidden_layers"] - 1
    x = target_features(sd, cfg, ids, [last], pos, mask)[last]
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def drafter_forward(P, cfg, block_size, mask_id, E, W, feats, root, n):
    """DFlash block forward.  P: drafter state dict; E / W: the target's embeddings / lm_head;
    feats [B, n, len(target_layer_ids) * H]: target features of the context; root [B]: the block's
    first token; the block sits at positions n..n+L-1 (L = block_size).
    Returns logits [B, L-1, V] for block positions 1..L-1."""
    L, hd = block_size, cfg["head_dim"]
    B = root.shape[0]
    ctx = rms(feats @ P["fc.weight"].T, P["hidden_norm.weight"])  # [B, n, H]
    block = torch.full((B, L), mask_id, dtype=torch.long, device=root.device)
    block[:, 0] = root
    x = E[block]
    cos_c, sin_c = rope_cos_sin(torch.arange(n, device=root.device), hd, cfg["rope_theta"])
    cos_b, sin_b = rope_cos_sin(torch.arange(n, n + L, device=root.device), hd, cfg["rope_theta"])
    x = _drafter_layers(P, cfg, x, ctx, (cos_b, sin_b), (cos_c, sin_c))
    hN = rms(x, P["norm.weight"])[:, 1:]
    return hN @ W.T


def _drafter_layers(P, cfg, x, ctx, rope_q, rope_c, mask=None):
    """The DFlash drafter's decoder layers: queries x [b, T, H] (the block tokens), keys and values
    of the projected context ctx [b, n, H] followed by the block's own; rope_q / rope_c: the
    (cos, sin) of the block's and the context's positions; mask: SDPA's boolean attn_mask
    [b, 1, T, n + T] (None: every query sees every key).  Returns x [b, T, H] before the final norm."""
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    b, T, n = x.shape[0], x.shape[1], ctx.shape[1]
    rep = nq // nkv
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, P[p + "input_layernorm.weight"])
        Wq, Wk, Wv = P[p + "self_attn.q_proj.weight"], P[p + "self_attn.k_proj.weight"], P[p + "self_attn.v_proj.weight"]
        qn, kn = P[p + "self_attn.q_norm.weight"], P[p + "self_attn.k_norm.weight"]
        q = apply_rope(rms((h @ Wq.T).view(b, T, nq, hd), qn), *rope_q)
        kb = apply_rope(rms((h @ Wk.T).view(b, T, nkv, hd), kn), *rope_q)
        vb = (h @ Wv.T).view(b, T, nkv, hd)
        kc = apply_rope(rms((ctx @ Wk.T).view(b, n, nkv, hd), kn), *rope_c)
        vc = (ctx @ Wv.T).view(b, n, nkv, hd)
        k = torch.cat([kc, kb], 1).repeat_interleave(rep, 2)
        v = torch.cat([vc, vb], 1).repeat_interleave(rep, 2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask)
        x = x + a.transpose(1, 2).reshape(b, T, nq * hd) @ P[p + "self_attn.o_proj.weight"].T
        h = rms(x, P[p + "post_attention_layernorm.weight"])
        g = h @ P[p + "mlp.gate_proj.weight"].T
        u = h @ P[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ P[p + "mlp.down_proj.weight"].T
    return x


def dflash_blocks_mask(anchors, n_ctx, block_size):
    """The multi-block training mask: bool [b, 1, N*L, n_ctx + N*L] (True = attend) for anchors
    [b, N] long.  Query block j (rows j*L .. j*L+L-1) sees the context positions kv < anchors[:, j]
    (what drafter_forward's context of n = anchor holds) and its own L block positions, all of
    them (non-causal), nothing of the other blocks."""
    b, N = anchors.shape
    L = block_size
    qb = torch.arange(N * L, device=anchors.device) // L                  # query row -> block
    kv = torch.arange(n_ctx, device=anchors.device)
    ctx = kv.view(1, 1, -1) < anchors.repeat_interleave(L, 1).unsqueeze(-1)  # [b, N*L, n_ctx]
    own = (qb.view(-1, 1) == qb.view(1, -1)).expand(b, -1, -1)             # [b, N*L, N*L]
    return torch.cat([ctx, own], -1).unsqueeze(1)


def drafter_forward_blocks(P, cfg, block_size, mask_id, E, W, feats, roots, anchors, mask=None):
    """N DFlash blocks per sequence in one forward (training): the same logits as drafter_forward
    run once per block, with the context projected once.  feats [b, n_ctx, len(target_layer_ids) * H]
    (n_ctx >= every anchor): target features of positions 0..n_ctx-1; roots [b, N]: each block's
    first token; anchors [b, N] long: block j sits at positions anchors[:, j] .. + L-1 and sees the
    context positions < anchors[:, j] (dflash_blocks_mask; ``mask`` [b, 1, N*L, n_ctx + N*L] bool
    replaces it, for tests).  Context K/V use RoPE positions 0..n_ctx-1.
    Returns logits [b, N, L-1, V] for block positions 1..L-1."""
    L, hd = block_size, cfg["head_dim"]
    b, N = anchors.shape
    n_ctx = feats.shape[1]
    dev = roots.device
    ctx = rms(feats @ P["fc.weight"].T, P["hidden_norm.weight"])  # [b, n_ctx, H]
    block = torch.full((b, N, L), mask_id, dtype=torch.long, device=dev)
    block[:, :, 0] = roots
    x = E[block.view(b, N * L)]                                    # [b, N*L, H]
    cos_c, sin_c = rope_cos_sin(torch.arange(n_ctx, device=dev), hd, cfg["rope_theta"])
    pos_b = (anchors.unsqueeze(-1) + torch.arange(L, device=dev)).view(b, N * L)
    cos_b, sin_b = rope_cos_sin(pos_b, hd, cfg["rope_theta"])       # [b, N*L, hd]
    if mask is None:
        mask = dflash_blocks_mask(anchors, n_ctx, L)
    x = _drafter_layers(P, cfg, x, ctx, (cos_b, sin_b), (cos_c, sin_c), mask)
    hN = rms(x, P["norm.weight"]).view(b, N, L, -1)[:, :, 1:]
    return hN @ W.T
