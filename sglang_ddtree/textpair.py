"""The text pair: a Qwen3 target and its DFlash drafter trained on the Python standard library.

Its weights and held-out prompts ship with the package (:mod:`sglang_ddtree.assets`); the
training scripts and the model card are in the checkout (``bench/textpair/``).  Shapes below are
the Hugging Face configs SGLang loads (``bench/textpair/materialize.py`` writes the folders).
"""
from __future__ import annotations

import json
import lzma
import os

from . import assets

SEED = 20261206
VOCAB = 2048
HIDDEN = 256
PAD, BOS, EOS, UNK, MASK = 0, 1, 2, 3, 4
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
BLOCK_SIZE = 8
N_TARGET_LAYERS = 4
TARGET_LAYER_IDS = [1, 2]                       # SGLang captures before layer k+1: k < last layer
HELDOUT_EVERY, HELDOUT_AT = 20, 10              # sorted file i is held out iff i % 20 == 10

TARGET = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
    intermediate_size=384, num_hidden_layers=N_TARGET_LAYERS, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, torch_dtype="bfloat16",
    initializer_range=0.02, use_cache=True,
)
DRAFTER = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
    intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
    hidden_act="silu", tie_word_embeddings=False, attention_bias=False, bos_token_id=BOS,
    eos_token_id=EOS, pad_token_id=PAD, torch_dtype="bfloat16", num_target_layers=N_TARGET_LAYERS,
    block_size=BLOCK_SIZE,
    dflash_config={"block_size": BLOCK_SIZE, "target_layer_ids": TARGET_LAYER_IDS,
                   "mask_token": "<mask>", "mask_token_id": MASK,
                   "num_target_layers": N_TARGET_LAYERS},
)


# how the weights are committed: LZMA2 with 2-byte alignment (bf16 values); bench/textpair/export.py
XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "lc": 0, "lp": 1, "pb": 1}]


def read_weights(path: str):
    """{name: tensor} of ``path`` (``x.safetensors``), or of ``x.safetensors.xz`` when only that is
    there: the checkout commits the weights xz-compressed, the wheel carries them plain
    (:mod:`sglang_ddtree._build`)."""
    from safetensors.torch import load, load_file

    if os.path.exists(path) or not os.path.exists(path + ".xz"):
        return load_file(path)
    with open(path + ".xz", "rb") as f:
        return load(lzma.decompress(f.read()))


def load_pair(weights_dir: str = assets.TEXTPAIR_DIR):
    """(target state dict incl. lm_head.weight, drafter state dict), bf16, from the shipped files.
    The target was trained with a tied head: the file stores the embedding once, lm_head is a copy."""
    target = read_weights(os.path.join(weights_dir, "target.safetensors"))
    target["lm_head.weight"] = target["model.embed_tokens.weight"].clone()
    drafter = read_weights(os.path.join(weights_dir, "drafter.safetensors"))
    return target, drafter


def load_drafter_run(run_dir: str):
    """(drafter state dict, its config) from a ``bench/textpair/train.py`` output folder
    (``drafter.pt`` + ``log.json``'s ``drafter_config``): a drafter trained against the shipped
    target, of any block size / depth."""
    import torch

    with open(os.path.join(run_dir, "log.json")) as f:
        cfg = json.load(f).get("drafter_config")
    if cfg is None:
        raise ValueError(f"{run_dir}/log.json has no drafter_config (a train.py run older than the shape flags)")
    return torch.load(os.path.join(run_dir, "drafter.pt"), map_location="cpu"), cfg


def heldout_prompts(path: str = assets.TEXTPAIR_PROMPTS):
    """The 32 held-out benchmark prompts: [{"ids": [...], ...}], from 32 different held-out files."""
    with open(path) as f:
        return json.load(f)
