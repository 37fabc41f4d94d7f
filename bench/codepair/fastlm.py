"""The target's training forward: the reference Qwen3 forward (sglang_ddtree.reference_model.
target_features) with the causal attention asked for as such (``is_causal=True``, so SDPA may take
its flash kernel on the GPU) and grouped K/V heads passed as they are (``enable_gqa``) instead of a
[T, T] boolean mask and repeated heads.  Same weights, same order of operations, same fp32 norms:
in fp32 it equals the reference to rounding (tests/test_codepair.py checks it on the CPU).

``install(pairlib)`` makes pairlib.logits (and so pairlib.lm_loss / heldout_eval, which
bench/textpair/train.py's train_target calls) use it; everything else (greedy data, features, the
drafter, the offline DFLASH simulation) keeps the reference forwards.
"""
import torch
import torch.nn.functional as F

from sglang_ddtree import reference_model as RM

_GQA = None   # does this torch's SDPA take enable_gqa (torch >= 2.5)?


def _sdpa(q, k, v):
    global _GQA
    if _GQA is not False:
        try:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            _GQA = True
            return out
        except TypeError:
            _GQA = False
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=True)


def causal_logits(sd, cfg, ids):
    """Logits [B, T, V] of ids [B, T] (tied head: lm_head = sd's "lm_head.weight" if present, else
    the embedding)."""
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    B, T = ids.shape
    E = sd["model.embed_tokens.weight"]
    x = E[ids]
    cos, sin = RM.rope_cos_sin(torch.arange(T, device=ids.device), hd, cfg["rope_theta"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = RM.rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, nq, hd)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, hd)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, hd)
        q = RM.apply_rope(RM.rms(q, sd[p + "self_attn.q_norm.weight"]), cos, sin)
        k = RM.apply_rope(RM.rms(k, sd[p + "self_attn.k_norm.weight"]), cos, sin)
        a = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + a.transpose(1, 2).reshape(B, T, nq * hd) @ sd[p + "self_attn.o_proj.weight"].T
        h = RM.rms(x, sd[p + "post_attention_layernorm.weight"])
        x = x + RM.swiglu(sd, p + "mlp.", h)
    return RM.rms(x, sd["model.norm.weight"]) @ sd.get("lm_head.weight", E).T


def install(L, C, compile_=False):
    """pairlib.logits -> causal_logits with the installed target config (C.TARGET)."""
    fn = causal_logits
    if compile_:
        fn = torch.compile(causal_logits, dynamic=False)

    def logits(T, ids):
        return fn(T, C.TARGET, ids)
    L.logits = logits
    return logits


def train_flops_per_token(cfg, seq):
    """Training FLOPs per token (forward + backward = 3 x forward): 6 x the matmul weights
    (embedding lookup free, the tied head counted) + causal attention 3 x 2 x 2 x seq/2 x q width per layer."""
    H, I, Lr = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    w = Lr * (2 * H * q + 2 * H * kv + 3 * H * I) + cfg["vocab_size"] * H
    attn = Lr * 3 * 2 * 2 * (seq / 2) * q
    return 6 * w + attn
