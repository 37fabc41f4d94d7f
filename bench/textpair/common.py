"""Shared constants of the text pair (torch + stdlib only: the device trainer imports this).

The reference forwards are the test bed's (bench/device/train_drafter.py: target_features,
target_logits, drafter_forward). They read their shapes from module attributes of mk_models
(QWEN3, DRAFTER, BLOCK_SIZE, MASK_ID); install() points those attributes at this pair's configs,
so the very same code runs the text pair.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEVICE_DIR = os.path.join(REPO, "bench", "device")
CACHE = os.path.join(HERE, "cache")            # git-ignored: tokenized corpus, checkpoints
TOKENIZER_DIR = os.path.join(HERE, "tokenizer")
WEIGHTS_DIR = os.path.join(HERE, "weights")
MANIFEST = os.path.join(HERE, "corpus_manifest.tsv")
PROMPTS = os.path.join(HERE, "heldout_prompts.json")

SEED = 20261206
VOCAB = 2048
HIDDEN = 256                                    # = mk_models.HIDDEN (its layer builder uses it)
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


def install():
    """Import the test bed's mk_models / train_drafter with this pair's configs installed."""
    if DEVICE_DIR not in sys.path:
        sys.path.insert(0, DEVICE_DIR)
    import mk_models as M
    import train_drafter as TD
    assert M.HIDDEN == HIDDEN
    M.QWEN3, M.DRAFTER, M.BLOCK_SIZE, M.MASK_ID, M.VOCAB = TARGET, DRAFTER, BLOCK_SIZE, MASK, VOCAB
    M.TARGET_LAYER_IDS = TARGET_LAYER_IDS
    return M, TD


def target_init(seed=SEED):
    """Seeded initial target state, tied head (lm_head is the embedding; materialize writes a copy)."""
    import torch
    M, _ = install()
    g = torch.Generator(device="cpu").manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.02,
          "model.norm.weight": torch.ones(HIDDEN)}
    M._qwen3_layers(sd, g, TARGET, "model.layers.")
    return sd


def drafter_init(seed=SEED + 1):
    import torch
    M, _ = install()
    g = torch.Generator(device="cpu").manual_seed(seed)
    sd = {"norm.weight": torch.ones(HIDDEN), "hidden_norm.weight": torch.ones(HIDDEN),
          "fc.weight": torch.randn(HIDDEN, len(TARGET_LAYER_IDS) * HIDDEN, generator=g) * 0.02}
    M._qwen3_layers(sd, g, DRAFTER, "layers.")
    return sd


def with_head(sd):
    """The target state dict as the reference forward reads it (lm_head = embeddings)."""
    d = dict(sd)
    d["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return d


def n_params(sd):
    return sum(v.numel() for v in sd.values())


def read_safetensors(path):
    """{name: tensor} from a .safetensors file with torch + stdlib only (the device may lack the
    safetensors package): 8-byte little-endian header length, JSON header, raw little-endian data."""
    import json
    import struct
    import torch
    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
          "I32": torch.int32, "I16": torch.int16, "U8": torch.uint8}
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8:8 + n])
    body = bytearray(raw[8 + n:])
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        t = torch.frombuffer(body, dtype=dt[v["dtype"]], count=(b - a) // torch.empty((), dtype=dt[v["dtype"]]).element_size(),
                             offset=a) if b > a else torch.empty(0, dtype=dt[v["dtype"]])
        out[k] = t.reshape(v["shape"]).clone()
    return out
