"""Make the test bed's tiny model pairs (seeded, seconds, no downloads, plain torch).

usage: python bench/device/mk_models.py OUT_DIR [--drafter PATH.safetensors] [--configs-only]

OUT_DIR/gqa_target : Qwen3ForCausalLM, dense GQA (4 layers, hidden 256, 4 q / 2 kv heads, head_dim 64)
OUT_DIR/mla_target : DeepseekV3ForCausalLM, MLA + MoE in the DeepSeek-V3 / Kimi-K2 layout (4 layers,
                     hidden 256, 16 heads, q_lora 128, kv_lora 512, rope 64, nope 128, v 128;
                     layer 0 dense, layers 1-3 MoE: 8 routed experts, top-2, 1 shared, sigmoid
                     scoring with noaux_tc / e_score_correction_bias, n_group 1)
OUT_DIR/drafter    : DFlashDraftModel (2 layers, hidden 256, block_size 8, target_layer_ids [1, 2],
                     mask_token_id 1023).  One drafter serves both targets: they share vocab (1024),
                     hidden size, embeddings and lm_head.  Weights: --drafter file (trained by
                     train_drafter.py; default the committed bench/device/weights/drafter.safetensors.xz,
                     see committed_weights), else random.

Both targets are deterministic "permutation chains": embeddings E ~ N(0, 1), lm_head row perm[t] =
E[t], all other weights small (std 0.02).  The residual stream stays close to E[last token], so the
greedy next token is perm[last token] with a logit margin of ~200 (top ~250 vs runner-up < 60):
bf16 noise cannot flip it, and every correct decoding path must emit exactly perm^k(last prompt
token).  perm.json is saved next to each target.
"""
import argparse
import hashlib
import json
import lzma
import os
import random
import shutil
import tempfile

import torch

VOCAB = 1024
HIDDEN = 256
N_TARGET_LAYERS = 4
BLOCK_SIZE = 8
TARGET_LAYER_IDS = [1, 2]
MASK_ID = VOCAB - 1
BOS, EOS, PAD = 1, 2, 0
STD = 0.02
SEED = 20261130

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS_DIR = os.path.join(HERE, "weights")
# how the committed drafters are compressed: LZMA2 with 2-byte alignment (bf16 values), 5.0 -> 3.4 MB
XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "lc": 0, "lp": 1, "pb": 1}]


def committed_weights(name: str) -> str:
    """A plain ``.safetensors`` file of the committed drafter ``weights/NAME.safetensors.xz``.

    The trained drafters are committed xz-compressed (the same bf16 file byte for byte, 5.0 -> 3.4
    MB each: what a device call carries is bounded, issue 40).  Every reader wants a file
    (safetensors' ``load_file``, a copy into a model folder SGLang loads), so the first call on a
    machine decompresses it to ``<tempdir>/sglang-ddtree-weights/<sha256 of the .xz>/NAME.safetensors``
    and later calls reuse it (the file name stays the committed one: records that name the drafter
    by its base name are unchanged).  Without the ``.xz`` (a drafter just trained into
    ``weights/NAME.safetensors``, not compressed yet): that plain path."""
    plain = os.path.join(WEIGHTS_DIR, name + ".safetensors")
    if not os.path.exists(plain + ".xz"):
        return plain
    with open(plain + ".xz", "rb") as f:
        blob = f.read()
    d = os.path.join(tempfile.gettempdir(), "sglang-ddtree-weights", hashlib.sha256(blob).hexdigest()[:16])
    out = os.path.join(d, name + ".safetensors")
    if not os.path.exists(out):
        os.makedirs(d, exist_ok=True)
        tmp = f"{out}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(lzma.decompress(blob))
        os.replace(tmp, out)   # atomic: concurrent callers see a whole file or none
    return out


def compress_weights(safetensors_bytes: bytes, path: str) -> None:
    """Write a drafter as it is committed (``path`` ends in ``.safetensors.xz``)."""
    with open(path, "wb") as f:
        f.write(lzma.compress(safetensors_bytes, format=lzma.FORMAT_XZ, filters=XZ_FILTERS))


DEFAULT_DRAFTER = committed_weights("drafter")

QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
    intermediate_size=512, num_hidden_layers=N_TARGET_LAYERS, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_theta=1000000.0, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, torch_dtype="bfloat16",
    initializer_range=STD, use_cache=True,
)
DSV3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB,
    hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=N_TARGET_LAYERS, num_attention_heads=16, num_key_value_heads=16,
    n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    topk_method="noaux_tc", n_group=1, topk_group=1, first_k_dense_replace=1, moe_layer_freq=1,
    norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu", max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
    attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS,
    pad_token_id=PAD, torch_dtype="bfloat16", initializer_range=STD, num_nextn_predict_layers=0,
    use_cache=True,
)
DRAFTER = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
    intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
    hidden_act="silu", tie_word_embeddings=False, attention_bias=False, bos_token_id=BOS,
    eos_token_id=EOS, pad_token_id=PAD, torch_dtype="bfloat16", num_target_layers=N_TARGET_LAYERS,
    block_size=BLOCK_SIZE,
    dflash_config={"block_size": BLOCK_SIZE, "target_layer_ids": TARGET_LAYER_IDS,
                   "mask_token_id": MASK_ID, "num_target_layers": N_TARGET_LAYERS},
)


def drafter_config(block_size=BLOCK_SIZE):
    """The toy drafter's config at block size B (DRAFTER is B = BLOCK_SIZE)."""
    return dict(DRAFTER, block_size=block_size, dflash_config=dict(DRAFTER["dflash_config"], block_size=block_size))


def shared_head():
    """Embeddings, lm_head and the permutation shared by both targets (seeded)."""
    g = torch.Generator().manual_seed(SEED)
    perm = torch.randperm(VOCAB, generator=g)
    E = torch.randn(VOCAB, HIDDEN, generator=g)
    W = torch.empty_like(E)
    W[perm] = E  # logit[perm[t]] = E[t] . norm(h) is the max when h ~ E[t]
    return E, W, perm


def _lin(g, out_f, in_f):
    return torch.randn(out_f, in_f, generator=g) * STD


def _qwen3_layers(sd, g, c, prefix):
    """Add the Qwen3 decoder layers of config c to sd (norms ones, linears N(0, STD^2) from g,
    drawn in a fixed order so the seeded weights never change)."""
    hd, nq, nkv, inter = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        sd[p + "self_attn.q_proj.weight"] = _lin(g, nq * hd, HIDDEN)
        sd[p + "self_attn.k_proj.weight"] = _lin(g, nkv * hd, HIDDEN)
        sd[p + "self_attn.v_proj.weight"] = _lin(g, nkv * hd, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = _lin(g, HIDDEN, nq * hd)
        sd[p + "self_attn.q_norm.weight"] = torch.ones(hd)
        sd[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        sd[p + "mlp.gate_proj.weight"] = _lin(g, inter, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = _lin(g, inter, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = _lin(g, HIDDEN, inter)


def qwen3_target_state():
    E, W, perm = shared_head()
    g = torch.Generator().manual_seed(SEED + 1)
    sd = {"model.embed_tokens.weight": E.clone(), "lm_head.weight": W.clone(),
          "model.norm.weight": torch.ones(HIDDEN)}
    _qwen3_layers(sd, g, QWEN3, "model.layers.")
    return sd, perm


def dsv3_target_state():
    E, W, perm = shared_head()
    g = torch.Generator().manual_seed(SEED + 2)
    c = DSV3
    nh, ql, kl = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    rope, nope, vd = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    sd = {"model.embed_tokens.weight": E.clone(), "lm_head.weight": W.clone(),
          "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        a = p + "self_attn."
        sd[a + "q_a_proj.weight"] = _lin(g, ql, HIDDEN)
        sd[a + "q_a_layernorm.weight"] = torch.ones(ql)
        sd[a + "q_b_proj.weight"] = _lin(g, nh * (nope + rope), ql)
        sd[a + "kv_a_proj_with_mqa.weight"] = _lin(g, kl + rope, HIDDEN)
        sd[a + "kv_a_layernorm.weight"] = torch.ones(kl)
        sd[a + "kv_b_proj.weight"] = _lin(g, nh * (nope + vd), kl)
        sd[a + "o_proj.weight"] = _lin(g, HIDDEN, nh * vd)
        m = p + "mlp."
        if i < c["first_k_dense_replace"]:
            it = c["intermediate_size"]
            sd[m + "gate_proj.weight"] = _lin(g, it, HIDDEN)
            sd[m + "up_proj.weight"] = _lin(g, it, HIDDEN)
            sd[m + "down_proj.weight"] = _lin(g, HIDDEN, it)
        else:
            it, ne = c["moe_intermediate_size"], c["n_routed_experts"]
            sd[m + "gate.weight"] = _lin(g, ne, HIDDEN)
            # distinct per-expert biases: routing ties are unlikely, so expert choice is stable
            sd[m + "gate.e_score_correction_bias"] = torch.linspace(0.0, 0.07, ne)
            for e in range(ne):
                sd[m + f"experts.{e}.gate_proj.weight"] = _lin(g, it, HIDDEN)
                sd[m + f"experts.{e}.up_proj.weight"] = _lin(g, it, HIDDEN)
                sd[m + f"experts.{e}.down_proj.weight"] = _lin(g, HIDDEN, it)
            sit = it * c["n_shared_experts"]
            sd[m + "shared_experts.gate_proj.weight"] = _lin(g, sit, HIDDEN)
            sd[m + "shared_experts.up_proj.weight"] = _lin(g, sit, HIDDEN)
            sd[m + "shared_experts.down_proj.weight"] = _lin(g, HIDDEN, sit)
    return sd, perm


def random_drafter_state():
    g = torch.Generator().manual_seed(SEED + 3)
    sd = {"norm.weight": torch.ones(HIDDEN), "hidden_norm.weight": torch.ones(HIDDEN),
          "fc.weight": _lin(g, HIDDEN, len(TARGET_LAYER_IDS) * HIDDEN)}
    _qwen3_layers(sd, g, DRAFTER, "layers.")
    return sd


def write_tokenizer(d):
    """Byte-level BPE trained offline on a few KB, padded with added tokens up to VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    words = ("the quick brown fox jumps over the lazy dog speculative decoding drafts "
             "tokens that a target model verifies in one forward pass sglang serves large "
             "language models with radix attention and cuda graphs on an h200 gpu ").split()
    rng = random.Random(0)
    text = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    n = tok.get_vocab_size()
    tok.add_tokens([f"<x{i}>" for i in range(n, VOCAB - 1)])
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken("<mask>", special=True)])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    assert tok.token_to_id("<mask>") == MASK_ID
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>",
                   "model_max_length": 4096, "add_bos_token": False, "clean_up_tokenization_spaces": False}, f, indent=1)
    with open(os.path.join(d, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
                   "mask_token": "<mask>"}, f, indent=1)


def _save(d, cfg, sd=None, perm=None):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}, f)
    if sd is not None:
        from safetensors.torch import save_file
        sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
        for k in sd:  # DeepSeek checkpoints keep the router bias in fp32
            if k.endswith("e_score_correction_bias"):
                sd[k] = sd[k].float()
        save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    if perm is not None:
        with open(os.path.join(d, "perm.json"), "w") as f:
            json.dump(perm.tolist(), f)


def make_all(out, drafter=None, configs_only=False):
    gq, ml, dr = (os.path.join(out, n) for n in ("gqa_target", "mla_target", "drafter"))
    if configs_only:
        for d, c in ((gq, QWEN3), (ml, DSV3), (dr, DRAFTER)):
            _save(d, c)
        write_tokenizer(gq)
        write_tokenizer(ml)
        return {"gqa": (gq, dr), "mla": (ml, dr)}
    sd, perm = qwen3_target_state()
    _save(gq, QWEN3, sd, perm)
    write_tokenizer(gq)
    sd, perm2 = dsv3_target_state()
    assert torch.equal(perm, perm2)
    _save(ml, DSV3, sd, perm)
    write_tokenizer(ml)
    if drafter is None and os.path.exists(DEFAULT_DRAFTER):
        drafter = DEFAULT_DRAFTER
    _save(dr, DRAFTER)
    if drafter:
        shutil.copy(drafter, os.path.join(dr, "model.safetensors"))
        info = drafter
    else:
        _save(dr, DRAFTER, random_drafter_state())
        info = "random"
    with open(os.path.join(dr, "drafter_source.txt"), "w") as f:
        f.write(str(info) + "\n")
    return {"gqa": (gq, dr), "mla": (ml, dr), "drafter_weights": info}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--drafter", default=None, help="trained drafter safetensors (default: weights/ if present)")
    ap.add_argument("--random-drafter", action="store_true")
    ap.add_argument("--configs-only", action="store_true", help="config.json + tokenizer only (CPU config checks)")
    a = ap.parse_args()
    if a.random_drafter:
        DEFAULT_DRAFTER = ""
    print(json.dumps(make_all(a.out, a.drafter, a.configs_only)))
