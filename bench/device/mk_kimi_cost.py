"""The production-cost INT4 MLA pair ``kimicost``: Kimi K2's shapes on one H200, a permutation chain.

usage: python bench/device/mk_kimi_cost.py OUT_DIR [--layers 10] [--experts 96] [--drafter-layers 2]
                                           [--device cuda] [--configs-only] [--force]

OUT_DIR/kimicost_target  : DeepseekV3ForCausalLM at Kimi K2's widths -- hidden 7168, 64 heads, q_lora 1536,
                           kv_lora 512, rope 64, nope 128, v 128, dense layer 0 with intermediate 18432,
                           MoE layers with moe_intermediate 2048, top-8 of ``--experts`` routed experts
                           (sigmoid scores, noaux_tc with e_score_correction_bias, n_group 1, topk_group 1,
                           norm_topk_prob, routed_scaling_factor 2.827), 1 shared expert, vocab 163840 --
                           but ``--layers`` layers (K2: 61) and ``--experts`` experts (K2: 384), so it fits
                           one GPU host (default 10 x 96: 29.7 GB on disk).  Routed experts INT4 exactly as
                           mk_int4.py writes them (compressed-tensors W4A16 pack-quantized, group 32,
                           symmetric; its QUANTIZATION_CONFIG with Kimi's ``ignore`` list: attention, shared
                           experts, dense MLP and lm_head stay bf16).  Sharded safetensors, one shard per
                           layer.  No bf16 twin: its dequantized experts alone would be ~76 GB, more than the
                           host's 64 GB disk (the reduced copy of tests/test_kimi_cost.py, same code at
                           hidden 512, is the dequantized reference instead).
                           Deviations from K2's config, all needed for the exact chain: rope_theta 10000 and
                           no YaRN rope_scaling (the toy's rope), rms_norm_eps 1e-6, BOS / EOS / PAD 1 / 2 / 0,
                           max_position_embeddings 4096.
OUT_DIR/kimicost_drafter : DFlashDraftModel at Kimi-K2.5-DFlash's widths (hidden 7168, 64 q / 8 kv heads x 128,
                           intermediate 18432, block 8, mask id 1023) computing the toy drafter of
                           mk_models.py (bench/device/weights/drafter.safetensors.xz), widened with
                           bench/scale/transform.py's scale_drafter; ``--drafter-layers`` (default 2, the
                           toy's; more are identity layers at full cost; z-lab's K2.5 drafter has 6 for 61
                           target layers); target_layer_ids [1, 2] as the toy's.

**Layout.**  The toy MLA target (mk_models.dsv3_target_state, experts quantized by mk_int4) lives in the
big one.  Its residual stream x (256) is stored as 28 copies [x, ..., x] (7168 = 28 x 256): RMSNorm keeps
its (repeated) weights, a weight that reads the stream reads copy 0 (other columns zero), one that writes
it writes every copy.  Big layers 0..2 ARE toy layers 0..2:
  * attention: q_a_proj writes 12 copies of the toy's q latent (1536 = 12 x 128) so q_a_layernorm is
    unchanged, q_b_proj reads copy 0 of it; toy heads 0..15 are big heads 0..15, heads 16..63 have zero
    q_b / kv_b rows and zero o_proj columns (they cost the same and add nothing); kv_a_proj_with_mqa
    (512 + 64 rows, as the toy's) reads copy 0;
  * layer 0's dense MLP: the toy's 512 units, the other 17920 zero;
  * layers 1, 2: toy expert e is big experts 4e..4e+3 (router rows and correction bias copied); the
    other experts get correction bias -1, so top-8 picks the 4 copies of each of the toy's top-2 (the
    sigmoid scores lie in (0, 1)) and the normalised weights of the copies add up to the toy's weight;
    expert units beyond the toy's 128 are zero (INT4 q = 0, scale bf16(1e-8): what mk_int4.quantize
    gives an all-zero group); the down_proj scales are multiplied by 2.5 / 2.827 (the toy's
    routed_scaling_factor over K2's; the nibbles are the toy's).  The shared expert likewise.
So the hidden states after layers 1 and 2 -- the drafter's features -- are the toy mlaint4 target's,
copied 28 times, and the widened drafter proposes what the toy drafter proposes.
Layers 3.. are **cost layers**: every weight random, full width, all 64 heads, routed over all experts
(router N(0, 1/7168): tokens spread over the experts as under a trained router).  Layers 1 and 2 use only
the 32 copy experts, so at large batches their expert weight traffic is 32 / N of a cost layer's.
SGLang picks its top-k kernel by expert count (384, K2's, has its own fused gate; 96 takes the generic
noaux_tc path; 128 = a power of two would take flashinfer's): a router-cost difference, not a GEMM one.

**Scales (std per fan-in n).**  Weights that read unit-RMS activations: std 1 / sqrt(n) (outputs ~ N(0, 1));
the two that write the residual stream (o_proj, experts' and shared expert's down_proj): std
ALPHA / sqrt(n), ALPHA = 0.05.  A cost layer then adds about 0.05 per element to the stream whatever the
width (attention output RMS <= 1; SwiGLU of N(0, 1) inputs has RMS 0.6, eight experts normalised and
scaled by 2.827 give ~0.6 ALPHA, plus the shared expert), so 7 cost layers add RMS <= 0.15 on top of
x = E[last token] + the toy layers' part (RMS ~0.25).  Cost-layer experts are random nibbles, q symmetric in [-7, 7]
(RMS sqrt(17.5), drawn as packed words) with one scale per matrix; they are INT4 by construction, nothing is
quantized, so INT4 costs the chain nothing.
**Vocabulary.**  Ids 0..1023 are the toy's chain tokens: embedding = the toy's E[t] in every copy, lm_head
row perm[t] = E[t] on copy 0.  Ids 1024..163839: embedding = that of id % 1024 (a prompt holding one
continues the chain from id % 1024); lm_head row = junk_row() on copy 1 ("learned-negative"), and the
target's final norm weight is zero outside copy 0, so in the TARGET these ids have logit exactly 0 (the
greedy token's is ~+240: they never win).  The drafter applies its own final norm (every copy), so its
logit for them is junk_row . h: junk_row = -40 x the unit mean of the toy drafter's normed hidden state,
negative on ~98 % of positions.  Zero rows would not do: the toy drafter's logits are soft (top ~11),
and 162,816 ids at logit 0 would hold ~58 % of its probability, distorting DDTree's path scores; with
junk_row they hold ~0.01 % on average (tests/test_kimi_cost.py: mean < 2 %, < 1 % of top-16 slots).
**The chain.**  Greedy next token = perm[last token % 1024], exactly, with a margin (top-1 minus top-2
logit) >= MARGIN_FLOOR = 120 asserted on every position checked (tests/test_kimi_cost.py: the reduced
copy, same depth and per-element statistics, HF transformers' DeepseekV3ForCausalLM in fp32 on the
dequantized weights, 40 greedy steps from 8 prompts: measured min 146, median 196).  bf16 and kernel order
move logits by < 1; the INT4 experts are the weights, nothing is quantized at serve time.  perm.json (the
toy's permutation) is saved with the target.

Written on the GPU with torch (``--device cuda``; random nibbles drawn as packed int32 words there),
shard by shard, then copied to the host; seeded (per device type).  ``OUT_DIR/kimicost_target/
kimicost.json`` records the build; a later call with the same arguments returns at once.
"""
import argparse
import copy
import functools
import importlib.util
import json
import math
import os
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, path):
    """A private copy of a bench script as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


Q = _load("_mk_int4_for_kimicost", os.path.join(HERE, "mk_int4.py"))          # quantize/pack/unpack/config
M = Q.M                                                                         # its private mk_models
T = _load("_scale_transform_for_kimicost", os.path.join(os.path.dirname(HERE), "scale", "transform.py"))

SEED = 20261202
ALPHA = 0.05            # writers of the residual stream: std ALPHA / sqrt(fan_in)
TOY_LAYERS = 3          # big layers 0..2 are toy layers 0..2 (the drafter reads 1 and 2)
Q_RMS = math.sqrt(17.5)   # RMS of the random nibbles' q (see _Ctx.rand_int4)
MARGIN_FLOOR = 120.0    # asserted by tests/test_kimi_cost.py on the reduced copy
JUNK_SCALE = 40.0       # |lm_head row| of the ids >= 1024 (see junk_row)

# Kimi K2 (moonshotai/Kimi-K2-Instruct config.json) where stated; layers / experts reduced
K2 = dict(hidden=7168, heads=64, q_lora=1536, kv_lora=512, rope=64, nope=128, v=128, dense_inter=18432,
          moe_inter=2048, top_k=8, shared=1, rsf=2.827, vocab=163840, layers=10, experts=96,
          # the drafter at z-lab/Kimi-K2.5-DFlash's widths (6 layers there)
          drafter_heads=64, drafter_kv_heads=8, drafter_head_dim=128, drafter_inter=18432, drafter_layers=2)
# the reduced-width copy the CPU tests build (same construction, same depth)
REDUCED = dict(K2, hidden=512, heads=24, q_lora=256, dense_inter=1024, moe_inter=256, vocab=4096, experts=36,
               drafter_heads=16, drafter_kv_heads=4, drafter_inter=2048, drafter_layers=3)


def check_shape(s):
    """Raise ValueError unless shape s can hold the toy MLA target (mk_models.DSV3)."""
    c = M.DSV3
    need = [(s["hidden"] % M.HIDDEN == 0, "hidden a multiple of 256"),
            (s["q_lora"] % c["q_lora_rank"] == 0, "q_lora a multiple of 128"),
            (s["heads"] >= c["num_attention_heads"], "heads >= 16"),
            ((s["kv_lora"], s["rope"], s["nope"], s["v"]) == (c["kv_lora_rank"], c["qk_rope_head_dim"],
                                                               c["qk_nope_head_dim"], c["v_head_dim"]),
             "kv_lora / rope / nope / v = 512 / 64 / 128 / 128"),
            (s["dense_inter"] >= c["intermediate_size"], "dense intermediate >= 512"),
            (s["moe_inter"] >= c["moe_intermediate_size"] and s["moe_inter"] % 64 == 0,
             "moe intermediate >= 128, % 64 (Marlin)"),
            (s["hidden"] % 128 == 0, "hidden % 128 (Marlin)"),
            (s["top_k"] % c["num_experts_per_tok"] == 0, "top_k a multiple of the toy's 2"),
            (s["experts"] >= copies_per_expert(s) * c["n_routed_experts"], "experts >= 32"),
            (s["layers"] > TOY_LAYERS, "layers >= 4"),
            (s["vocab"] >= M.VOCAB, "vocab >= 1024"),
            (s["shared"] == c["n_shared_experts"], "1 shared expert")]
    bad = [why for ok, why in need if not ok]
    if bad:
        raise ValueError("shape cannot hold the toy target: " + ", ".join(bad))


def copies_per_expert(s):
    return s["top_k"] // M.DSV3["num_experts_per_tok"]


def target_config(s):
    """The HF config.json dict of the target (with the INT4 quantization_config)."""
    cfg = copy.deepcopy(M.DSV3)
    cfg.update(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["dense_inter"],
               moe_intermediate_size=s["moe_inter"], num_hidden_layers=s["layers"],
               num_attention_heads=s["heads"], num_key_value_heads=s["heads"], n_shared_experts=s["shared"],
               n_routed_experts=s["experts"], num_experts_per_tok=s["top_k"], routed_scaling_factor=s["rsf"],
               kv_lora_rank=s["kv_lora"], q_lora_rank=s["q_lora"], qk_rope_head_dim=s["rope"],
               qk_nope_head_dim=s["nope"], v_head_dim=s["v"])
    cfg["quantization_config"] = copy.deepcopy(Q.QUANTIZATION_CONFIG)
    return cfg


def _drafter_shape(s):
    """bench/scale/transform.py's shape dict for scale_drafter."""
    return dict(kind="dense", hidden=s["hidden"], heads=s["drafter_heads"], kv_heads=s["drafter_kv_heads"],
                head_dim=s["drafter_head_dim"], drafter_layers=s["drafter_layers"],
                drafter_intermediate=s["drafter_inter"], vocab=s["vocab"], layers=s["layers"])


def _drafter_target_stand_in(s):
    """The 'small target' scale_drafter maps target_layer_ids through: same layer count as the big
    target, so the ids stay [1, 2] (big layers 1, 2 are toy layers 1, 2)."""
    return dict(M.DRAFTER, num_hidden_layers=s["layers"])


def drafter_config(s):
    """The drafter's config.json dict (what scale_drafter returns, without building weights)."""
    cfg = copy.deepcopy(M.DRAFTER)
    cfg.update(hidden_size=s["hidden"], num_hidden_layers=s["drafter_layers"], num_attention_heads=s["drafter_heads"],
               num_key_value_heads=s["drafter_kv_heads"], head_dim=s["drafter_head_dim"],
               intermediate_size=s["drafter_inter"], vocab_size=s["vocab"], num_target_layers=s["layers"])
    cfg["dflash_config"] = dict(cfg["dflash_config"], target_layer_ids=list(M.TARGET_LAYER_IDS),
                                num_target_layers=s["layers"])
    return cfg


# --- tensor inventory ------------------------------------------------------------------------------------
def layer_specs(s, i):
    """[(name, shape, dtype)] of target layer i."""
    D, H, N, I = s["hidden"], s["heads"], s["experts"], s["moe_inter"]
    p, bf = f"model.layers.{i}.", torch.bfloat16
    out = [(p + "input_layernorm.weight", (D,), bf), (p + "post_attention_layernorm.weight", (D,), bf)]
    a = p + "self_attn."
    out += [(a + "q_a_proj.weight", (s["q_lora"], D), bf), (a + "q_a_layernorm.weight", (s["q_lora"],), bf),
            (a + "q_b_proj.weight", (H * (s["nope"] + s["rope"]), s["q_lora"]), bf),
            (a + "kv_a_proj_with_mqa.weight", (s["kv_lora"] + s["rope"], D), bf),
            (a + "kv_a_layernorm.weight", (s["kv_lora"],), bf),
            (a + "kv_b_proj.weight", (H * (s["nope"] + s["v"]), s["kv_lora"]), bf),
            (a + "o_proj.weight", (D, H * s["v"]), bf)]
    m = p + "mlp."
    if i == 0:
        it = s["dense_inter"]
        return out + [(m + "gate_proj.weight", (it, D), bf), (m + "up_proj.weight", (it, D), bf),
                      (m + "down_proj.weight", (D, it), bf)]
    out += [(m + "gate.weight", (N, D), bf), (m + "gate.e_score_correction_bias", (N,), torch.float32)]
    for e in range(N):
        for n, (o, k) in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            b = m + f"experts.{e}.{n}."
            out += [(b + "weight_packed", (o, k // 8), torch.int32), (b + "weight_scale", (o, k // Q.GROUP), bf),
                    (b + "weight_shape", (2,), torch.int64)]
    si = I * s["shared"]
    return out + [(m + "shared_experts.gate_proj.weight", (si, D), bf), (m + "shared_experts.up_proj.weight", (si, D), bf),
                  (m + "shared_experts.down_proj.weight", (D, si), bf)]


def head_specs(s):
    bf = torch.bfloat16
    return [("model.embed_tokens.weight", (s["vocab"], s["hidden"]), bf), ("model.norm.weight", (s["hidden"],), bf),
            ("lm_head.weight", (s["vocab"], s["hidden"]), bf)]


def _nbytes(specs):
    return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, shape, dt in specs)


def sizes(s):
    """Bytes of tensor data: {'target': ..., 'drafter': ...} (safetensors headers add < 1 MB)."""
    tgt = _nbytes(head_specs(s)) + sum(_nbytes(layer_specs(s, i)) for i in range(s["layers"]))
    D, hd = s["hidden"], s["drafter_head_dim"]
    nq, nkv, it = s["drafter_heads"], s["drafter_kv_heads"], s["drafter_inter"]
    per_layer = D * hd * (2 * nq + 2 * nkv) + 3 * D * it + 2 * D + 2 * hd
    n_feat = len(M.TARGET_LAYER_IDS)
    dr = 2 * (s["drafter_layers"] * per_layer + n_feat * D * D + 2 * D)
    return {"target": tgt, "drafter": dr}


# --- the toy ------------------------------------------------------------------------------------------------
def toy_parts():
    """The toy MLA target as mk_int4 writes it (CPU): (bf16 state dict of the non-expert tensors,
    {expert base name: (packed int32, scale bf16, in_features)}, bf16 reference state dict (= the
    mlaint4ref checkpoint: experts dequantized), perm)."""
    sd, perm = M.dsv3_target_state()
    q_sd, ref = Q.int4_states(sd)
    plain = {k: v.to(torch.bfloat16) for k, v in q_sd.items() if ".mlp.experts." not in k}
    for k in plain:
        if k.endswith("e_score_correction_bias"):
            plain[k] = q_sd[k].float()
    packed = {}
    for k in Q.expert_names(sd):
        b = k[: -len(".weight")]
        packed[b] = (q_sd[b + ".weight_packed"], q_sd[b + ".weight_scale"], int(q_sd[b + ".weight_shape"][1]))
    ref = {k: (v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)) for k, v in ref.items()}
    return plain, packed, ref, perm


def _fill_word():
    """The int32 word of eight zero nibbles' q (q + 8 = 8 in every nibble), via mk_int4.pack."""
    return int(Q.pack(torch.zeros(1, 8, dtype=torch.int8))[0, 0])


def _zero_scale():
    """The scale mk_int4.quantize gives an all-zero group (bf16(1e-8))."""
    return Q.quantize(torch.zeros(1, Q.GROUP))[1][0, 0]


class _Ctx:
    """What the per-layer builders share: shape, device, generator, toy tensors (on the device)."""

    def __init__(self, s, dev, seed=SEED):
        check_shape(s)
        self.s, self.dev = s, torch.device(dev)
        self.copies, self.d = s["hidden"] // M.HIDDEN, M.HIDDEN
        self.qcopies = s["q_lora"] // M.DSV3["q_lora_rank"]
        self.cpe = copies_per_expert(s)
        plain, packed, _, perm = toy_parts()
        self.toy = {k: v.to(self.dev) for k, v in plain.items()}
        self.packed = {k: (p.to(self.dev), sc.to(self.dev), n) for k, (p, sc, n) in packed.items()}
        self.perm = perm
        self.fill, self.zscale = _fill_word(), _zero_scale().to(self.dev)
        self.gen = torch.Generator(device=self.dev).manual_seed(seed)

    # random pieces
    def randn(self, shape, std):
        return (torch.randn(shape, generator=self.gen, device=self.dev) * std).to(torch.bfloat16)

    def rand_int4(self, out_f, in_f, std):
        """A random INT4 linear with weight std ``std``: (packed int32 [out, in / 8], scale bf16
        [out, in / 32]).  Nibbles drawn packed: uniform 0..15 per nibble, nibble 0 (q = -8) turned
        into 8 (q = 0), so q is symmetric in [-7, 7] (P(0) = 2/16, E[q^2] = 17.5) and W has mean 0."""
        w = torch.randint(-2 ** 31, 2 ** 31, (out_f, in_f // 8), generator=self.gen, device=self.dev,
                          dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
        zero = ~(w | (w >> 1) | (w >> 2) | (w >> 3)) & 0x11111111   # bit 4k set iff nibble k == 0
        w = w | (zero << 3)
        packed = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
        scale = torch.full((out_f, in_f // Q.GROUP), std / Q_RMS, dtype=torch.bfloat16, device=self.dev)
        return packed, scale

    # toy embedding
    def reader(self, w, cols):
        """Toy [out, d_small] -> [out, cols] reading the first d_small columns (copy 0)."""
        out = torch.zeros(w.shape[0], cols, dtype=w.dtype, device=self.dev)
        out[:, : w.shape[1]] = w
        return out


def _ones(n, dev):
    return torch.ones(n, dtype=torch.bfloat16, device=dev)


def toy_layer(c, i):
    """Big layer i (< TOY_LAYERS) = toy layer i: {name: tensor}."""
    s, t, D, d = c.s, c.toy, c.s["hidden"], c.d
    p = tp = f"model.layers.{i}."  # the toy's tensor names are the big ones'
    H, Hs = s["heads"], M.DSV3["num_attention_heads"]
    qk, kv = s["nope"] + s["rope"], s["nope"] + s["v"]
    out = {p + n: t[tp + n].repeat(c.copies) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    a = "self_attn."
    out[p + a + "q_a_proj.weight"] = c.reader(t[tp + a + "q_a_proj.weight"], D).repeat(c.qcopies, 1)
    out[p + a + "q_a_layernorm.weight"] = t[tp + a + "q_a_layernorm.weight"].repeat(c.qcopies)
    qb = torch.zeros(H * qk, s["q_lora"], dtype=torch.bfloat16, device=c.dev)
    qb[: Hs * qk, : M.DSV3["q_lora_rank"]] = t[tp + a + "q_b_proj.weight"]
    out[p + a + "q_b_proj.weight"] = qb
    out[p + a + "kv_a_proj_with_mqa.weight"] = c.reader(t[tp + a + "kv_a_proj_with_mqa.weight"], D)
    out[p + a + "kv_a_layernorm.weight"] = t[tp + a + "kv_a_layernorm.weight"].clone()
    kvb = torch.zeros(H * kv, s["kv_lora"], dtype=torch.bfloat16, device=c.dev)
    kvb[: Hs * kv] = t[tp + a + "kv_b_proj.weight"]
    out[p + a + "kv_b_proj.weight"] = kvb
    o = torch.zeros(d, H * s["v"], dtype=torch.bfloat16, device=c.dev)
    o[:, : Hs * s["v"]] = t[tp + a + "o_proj.weight"]
    out[p + a + "o_proj.weight"] = o.repeat(c.copies, 1)

    def mlp(prefix, big_inter):
        g, u, dn = (t[tp + prefix + f"{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
        G = torch.zeros(big_inter, D, dtype=torch.bfloat16, device=c.dev)
        G[: g.shape[0], :d] = g
        U = torch.zeros_like(G)
        U[: u.shape[0], :d] = u
        Dn = torch.zeros(d, big_inter, dtype=torch.bfloat16, device=c.dev)
        Dn[:, : dn.shape[1]] = dn
        return {p + prefix + "gate_proj.weight": G, p + prefix + "up_proj.weight": U,
                p + prefix + "down_proj.weight": Dn.repeat(c.copies, 1)}

    if i == 0:
        out.update(mlp("mlp.", s["dense_inter"]))
        return out
    N, I, ne = s["experts"], s["moe_inter"], M.DSV3["n_routed_experts"]
    gw = torch.zeros(N, D, dtype=torch.bfloat16, device=c.dev)
    bias = torch.full((N,), -1.0, dtype=torch.float32, device=c.dev)
    tg, tb = t[tp + "mlp.gate.weight"], t[tp + "mlp.gate.e_score_correction_bias"]
    rsf_fix = M.DSV3["routed_scaling_factor"] / s["rsf"]
    for e in range(ne):
        for k in range(c.cpe):
            gw[e * c.cpe + k, :d] = tg[e]
            bias[e * c.cpe + k] = tb[e]
    out[p + "mlp.gate.weight"], out[p + "mlp.gate.e_score_correction_bias"] = gw, bias
    for e in range(ne):
        parts = {}
        for n, (o_f, i_f) in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            tpk, tsc, tin = c.packed[tp + f"mlp.experts.{e}.{n}"]
            P = torch.full((o_f, i_f // 8), c.fill, dtype=torch.int32, device=c.dev)
            S = c.zscale.expand(o_f, i_f // Q.GROUP).clone()
            if n == "down_proj":  # writes every copy; the toy's nibbles, scales x 2.5 / 2.827
                tsc = (tsc.float() * rsf_fix).to(torch.bfloat16)
                for r in range(c.copies):
                    P[r * d:(r + 1) * d, : tpk.shape[1]] = tpk
                    S[r * d:(r + 1) * d, : tsc.shape[1]] = tsc
            else:  # reads copy 0
                P[: tpk.shape[0], : tpk.shape[1]] = tpk
                S[: tsc.shape[0], : tsc.shape[1]] = tsc
            parts[n] = (P, S, (o_f, i_f))
        for k in range(c.cpe):
            _put_expert(out, p, e * c.cpe + k, parts, clone=k > 0)
    for x in range(ne * c.cpe, N):  # never routed to (bias -1): random nibbles, cost in memory only
        _put_expert(out, p, x, _random_expert(c))
    out.update(mlp("mlp.shared_experts.", I * s["shared"]))
    return out


def _random_expert(c):
    D, I = c.s["hidden"], c.s["moe_inter"]
    return {"gate_proj": (*c.rand_int4(I, D, 1 / math.sqrt(D)), (I, D)),
            "up_proj": (*c.rand_int4(I, D, 1 / math.sqrt(D)), (I, D)),
            "down_proj": (*c.rand_int4(D, I, ALPHA / math.sqrt(I)), (D, I))}


def _put_expert(out, p, e, parts, clone=False):
    for n, (P, S, shape) in parts.items():
        b = p + f"mlp.experts.{e}.{n}."
        out[b + "weight_packed"] = P.clone() if clone else P   # safetensors refuses shared storage
        out[b + "weight_scale"] = S.clone() if clone else S
        out[b + "weight_shape"] = torch.tensor(list(shape), dtype=torch.int64)


def cost_layer(c, i):
    """Big layer i >= TOY_LAYERS: random at full width (std 1/sqrt(fan_in); writers ALPHA/sqrt(fan_in))."""
    s, D, H = c.s, c.s["hidden"], c.s["heads"]
    p, a, dev = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", c.dev
    ql, kl = s["q_lora"], s["kv_lora"]
    out = {p + "input_layernorm.weight": _ones(D, dev), p + "post_attention_layernorm.weight": _ones(D, dev),
           a + "q_a_proj.weight": c.randn((ql, D), 1 / math.sqrt(D)), a + "q_a_layernorm.weight": _ones(ql, dev),
           a + "q_b_proj.weight": c.randn((H * (s["nope"] + s["rope"]), ql), 1 / math.sqrt(ql)),
           a + "kv_a_proj_with_mqa.weight": c.randn((kl + s["rope"], D), 1 / math.sqrt(D)),
           a + "kv_a_layernorm.weight": _ones(kl, dev),
           a + "kv_b_proj.weight": c.randn((H * (s["nope"] + s["v"]), kl), 1 / math.sqrt(kl)),
           a + "o_proj.weight": c.randn((D, H * s["v"]), ALPHA / math.sqrt(H * s["v"]))}
    m, N, I = p + "mlp.", s["experts"], s["moe_inter"]
    out[m + "gate.weight"] = c.randn((N, D), 1 / math.sqrt(D))
    out[m + "gate.e_score_correction_bias"] = torch.zeros(N, dtype=torch.float32, device=dev)
    for e in range(N):
        _put_expert(out, p, e, _random_expert(c))
    si = I * s["shared"]
    out[m + "shared_experts.gate_proj.weight"] = c.randn((si, D), 1 / math.sqrt(D))
    out[m + "shared_experts.up_proj.weight"] = c.randn((si, D), 1 / math.sqrt(D))
    out[m + "shared_experts.down_proj.weight"] = c.randn((D, si), ALPHA / math.sqrt(si))
    return out


def drafter_normed_hidden(n_seq=128, length=40, seed=SEED + 7, drafter_path=None, block_size=None):
    """The toy drafter's final normed hidden states [positions, 256] (block positions 1..B-1) on chain
    contexts of the toy GQA target (as train_drafter.py trains it), roots at positions 2, 5, 8, ...
    ``drafter_path`` / ``block_size``: another toy drafter (default the committed block-8 one;
    bench/scale/chain_pair.py passes its block-16 drafter)."""
    from safetensors.torch import load_file
    RM = _reference_model()
    B = M.BLOCK_SIZE if block_size is None else block_size
    dcfg = M.drafter_config(B)
    tsd, perm = M.qwen3_target_state()
    g = torch.Generator().manual_seed(seed)
    seqs = torch.empty(n_seq, length, dtype=torch.long)
    seqs[:, 0] = torch.randint(3, M.VOCAB - 1, (n_seq,), generator=g)
    for j in range(1, length):
        seqs[:, j] = perm[seqs[:, j - 1]]
    with torch.no_grad():
        f = RM.target_features(tsd, M.QWEN3, seqs, M.TARGET_LAYER_IDS)
        feats = torch.cat([f[i] for i in M.TARGET_LAYER_IDS], -1)
        P = {k: v.float() for k, v in load_file(drafter_path or M.DEFAULT_DRAFTER).items()}
        eye = torch.eye(M.HIDDEN)  # lm_head = identity: the drafter's normed hidden states
        hs = [RM.drafter_forward(P, dcfg, B, M.MASK_ID, tsd["model.embed_tokens.weight"], eye,
                                 feats[:, :n], seqs[:, n], n).reshape(-1, M.HIDDEN) for n in range(2, length - 1, 3)]
    return torch.cat(hs)


@functools.lru_cache(maxsize=None)
def junk_row(n_seq=128, length=40, seed=SEED + 7):
    """The lm_head row [256] of every id >= 1024 (read from copy 1 of the stream), "learned-negative":
    -JUNK_SCALE x the unit mean of the toy drafter's final normed hidden state on chain contexts
    (:func:`drafter_normed_hidden`; the MLA target's features give the same direction:
    tests/test_kimi_cost.py measures the junk share of the drafter's probability there)."""
    mu = drafter_normed_hidden(n_seq, length, seed).mean(0)
    return (-JUNK_SCALE * mu / mu.norm()).clone()


def _reference_model():
    try:
        from sglang_ddtree import reference_model as RM
    except ImportError:  # a bare checkout: the package's pure-torch module
        sys.path.append(os.path.dirname(os.path.dirname(HERE)))
        from sglang_ddtree import reference_model as RM
    return RM


def head(c):
    """Embedding (toy E of id % 1024 in every copy); final norm = the toy's on copy 0, ZERO on the other
    copies; lm_head row perm[t] = E[t] on copy 0 (t < 1024), rows >= 1024 = junk_row() on copy 1.
    The target's normed stream is zero on copy 1, so its junk logits are exactly 0; the drafter's
    own final norm keeps every copy, so its junk logits are junk_row . h (negative: see the docstring)."""
    s, t, d = c.s, c.toy, c.d
    E, W = t["model.embed_tokens.weight"], t["lm_head.weight"]
    ids = torch.arange(s["vocab"], device=c.dev) % M.VOCAB
    lm = torch.zeros(s["vocab"], s["hidden"], dtype=torch.bfloat16, device=c.dev)
    lm[: M.VOCAB, :d] = W
    lm[M.VOCAB:, d:2 * d] = junk_row().to(device=c.dev, dtype=torch.bfloat16)
    norm = torch.zeros(s["hidden"], dtype=torch.bfloat16, device=c.dev)
    norm[:d] = t["model.norm.weight"]
    return {"model.embed_tokens.weight": E[ids].repeat(1, c.copies), "model.norm.weight": norm, "lm_head.weight": lm}


def target_part(c, part):
    """One shard's tensors: part = layer index or 'head'."""
    if part == "head":
        return head(c)
    return toy_layer(c, part) if part < TOY_LAYERS else cost_layer(c, part)


def drafter_state(s, dev="cpu"):
    """The widened toy drafter: (state dict on dev, config dict)."""
    P = {k: v.to(dev) for k, v in _toy_drafter().items()}
    with torch.device(dev):
        sd, cfg = T.scale_drafter(P, M.DRAFTER, _drafter_target_stand_in(s), _drafter_shape(s))
    if cfg["dflash_config"]["target_layer_ids"] != list(M.TARGET_LAYER_IDS) or cfg != drafter_config(s):
        raise RuntimeError("scale_drafter's config differs from drafter_config()")
    return sd, cfg


def _toy_drafter():
    from safetensors.torch import load_file
    if not os.path.exists(M.DEFAULT_DRAFTER):
        raise FileNotFoundError(f"{M.DEFAULT_DRAFTER}: the trained toy drafter (committed) is needed")
    return load_file(M.DEFAULT_DRAFTER)


# --- writing --------------------------------------------------------------------------------------------------
def _save_shard(d, name, tensors):
    from safetensors.torch import save_file
    host = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(host, os.path.join(d, name), metadata={"format": "pt"})
    return sum(v.numel() * v.element_size() for v in host.values())


def _write_common(d, cfg):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": M.BOS, "eos_token_id": M.EOS, "do_sample": False}, f)


def built_before(marker, build):
    """The build record in ``marker`` (a JSON file a writer leaves beside its model) when it holds
    every key of ``build`` with the same value, else None: a warm machine reuses the model."""
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        old = json.load(f)
    return old if {k: old.get(k) for k in build} == build else None


def make(out, s=None, device="cpu", configs_only=False, force=False, log=print):
    """Write OUT/kimicost_target and OUT/kimicost_drafter for shape s (default K2).  Returns a summary."""
    s = dict(K2 if s is None else s)
    check_shape(s)
    tgt, dr = os.path.join(out, "kimicost_target"), os.path.join(out, "kimicost_drafter")
    size = sizes(s)
    build = {"shape": s, "seed": SEED, "alpha": ALPHA, "device_type": torch.device(device).type,
             "target_bytes": size["target"], "drafter_bytes": size["drafter"], "configs_only": configs_only}
    marker = os.path.join(tgt, "kimicost.json")
    old = None if force else built_before(marker, build)
    if old is not None:
        return dict(old, reused=True, target=tgt, drafter=dr)
    log(f"kimicost: target {size['target'] / 1e9:.2f} GB ({s['layers']} layers x {s['experts']} experts), "
        f"drafter {size['drafter'] / 1e9:.2f} GB ({s['drafter_layers']} layers)", flush=True)
    for d in (tgt, dr):
        if os.path.exists(d):
            shutil.rmtree(d)
    os.makedirs(out, exist_ok=True)
    if not configs_only:
        free = shutil.disk_usage(out).free
        if free < size["target"] + size["drafter"] + 2e9:
            raise SystemExit(f"kimicost: {free / 1e9:.1f} GB free in {out}, need "
                             f"{(size['target'] + size['drafter']) / 1e9 + 2:.1f} GB (use --layers / --experts)")
    _write_common(tgt, target_config(s))
    _write_common(dr, drafter_config(s))
    M.write_tokenizer(tgt)
    t0 = time.time()
    if not configs_only:
        c = _Ctx(s, device)
        with open(os.path.join(tgt, "perm.json"), "w") as f:
            json.dump(c.perm.tolist(), f)
        parts = list(range(s["layers"])) + ["head"]
        weight_map, total = {}, 0
        for j, part in enumerate(parts):
            tensors = target_part(c, part)
            want = head_specs(s) if part == "head" else layer_specs(s, part)
            got = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
            if sorted(got, key=str) != sorted(want, key=str):
                raise RuntimeError(f"part {part}: tensors differ from layer_specs / head_specs")
            name = f"model-{j + 1:05d}-of-{len(parts):05d}.safetensors"
            total += _save_shard(tgt, name, tensors)
            weight_map.update({k: name for k in tensors})
            del tensors
            log(f"kimicost: shard {j + 1}/{len(parts)} ({part}) at {time.time() - t0:.0f}s", flush=True)
        with open(os.path.join(tgt, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        del c
        dsd, _ = drafter_state(s, device)
        dbytes = _save_shard(dr, "model.safetensors", dsd)
        del dsd
        if (total, dbytes) != (size["target"], size["drafter"]):
            raise RuntimeError(f"wrote {total} / {dbytes} bytes, sizes() said {size}")
    build["write_s"] = round(time.time() - t0, 1)
    with open(marker, "w") as f:
        json.dump(build, f, indent=1)
    return dict(build, reused=False, target=tgt, drafter=dr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=K2["layers"], help="target layers (K2: 61; >= 4)")
    ap.add_argument("--experts", type=int, default=K2["experts"], help="routed experts (K2: 384; >= 32)")
    ap.add_argument("--drafter-layers", type=int, default=K2["drafter_layers"], help=">= 2 (extra: identity layers)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--configs-only", action="store_true", help="config.json files + tokenizer (CPU config checks)")
    ap.add_argument("--force", action="store_true", help="rewrite even if kimicost.json says it is there")
    a = ap.parse_args(argv)
    s = dict(K2, layers=a.layers, experts=a.experts, drafter_layers=a.drafter_layers)
    res = make(a.out, s, a.device, a.configs_only, a.force)
    print(json.dumps({k: v for k, v in res.items() if k != "shape"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
