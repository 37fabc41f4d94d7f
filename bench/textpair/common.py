"""Shared constants of the text pair (torch + stdlib only: the device trainer imports this); the
shapes, weights and prompts themselves are the package's (sglang_ddtree.textpair / .assets).

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
MANIFEST = os.path.join(HERE, "corpus_manifest.tsv")

# The pair's shapes, weights and prompts live in the package (the wheel's main job runs it):
# sglang_ddtree.textpair / sglang_ddtree.assets.  A bare checkout (the device trainer's own call)
# imports the package's pure modules from the repo root, appended last so nothing is shadowed.
try:
    from sglang_ddtree import assets as _assets, textpair as _tp
except ImportError:
    sys.path.append(REPO)
    from sglang_ddtree import assets as _assets, textpair as _tp

WEIGHTS_DIR = _assets.TEXTPAIR_DIR              # target.safetensors, drafter.safetensors
PROMPTS = _assets.TEXTPAIR_PROMPTS
SEED, VOCAB, HIDDEN = _tp.SEED, _tp.VOCAB, _tp.HIDDEN   # HIDDEN = mk_models.HIDDEN (its layer builder)
PAD, BOS, EOS, UNK, MASK = _tp.PAD, _tp.BOS, _tp.EOS, _tp.UNK, _tp.MASK
SPECIALS = _tp.SPECIALS
BLOCK_SIZE, N_TARGET_LAYERS, TARGET_LAYER_IDS = _tp.BLOCK_SIZE, _tp.N_TARGET_LAYERS, _tp.TARGET_LAYER_IDS
HELDOUT_EVERY, HELDOUT_AT = _tp.HELDOUT_EVERY, _tp.HELDOUT_AT
TARGET, DRAFTER = _tp.TARGET, _tp.DRAFTER


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
    safetensors package): 8-byte little-endian header length, JSON header, raw little-endian data.
    A missing ``x.safetensors`` whose ``x.safetensors.xz`` is there (the committed text pair) is read
    from the ``.xz``."""
    import json
    import lzma
    import struct
    import torch
    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
          "I32": torch.int32, "I16": torch.int16, "U8": torch.uint8}
    if not os.path.exists(path) and os.path.exists(path + ".xz"):
        with open(path + ".xz", "rb") as f:
            raw = lzma.decompress(f.read())
    else:
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
