"""Shapes of the code pair (issue 42) and how the text pair's trainer is pointed at them.

The code pair reuses bench/textpair's trainer pieces (common / pairlib / train) and the test bed's
reference forwards (sglang_ddtree.reference_model through bench/device/train_drafter.py).  Those
read the pair's shapes from module attributes (common.TARGET / DRAFTER / VOCAB / HIDDEN /
TARGET_LAYER_IDS / BLOCK_SIZE, mk_models.HIDDEN, pairlib.LAST); ``install(preset)`` repoints them
at a code-pair preset.  It mutates those modules for the whole process: call it only in a process
of its own (recipe.py; the tests run recipe.py as a subprocess).

Presets (``PRESETS``):
  full  - the GPU pair: Qwen3 target 12 layers x 512 (12 q / 4 kv heads x 64, SwiGLU 2048,
          vocab 8192, tied head written untied), 54.5M parameters (50.3M without the embedding);
          DFlash drafter of the z-lab shape: block 16, 5 layers at the target's width (512,
          SwiGLU 2048), target_layer_ids [1, 3, 5, 7, 9] (SGLang's build_target_layer_ids(12, 5)),
          fc 5 x 512 -> 512: 22.3M parameters.
          Hidden 512, not 768: bench/scale/transform.py duplicates the residual stream, so the
          production hidden (Qwen3-8B 4096, Qwen3-30B-A3B 2048) must be a multiple of it; 768 is not
          (4096 / 768 = 5.33).  Heads (12 q / 4 kv -> 32 / 8), head dim (64 -> 128), MLP (2048 ->
          12288), layers (12 -> 36) and vocab (8192 -> 151,936) already fit.  At a fixed training
          time the narrower target also sees ~1.4x the tokens (383.8 vs 547.4 MFLOP a token).
  smoke - the same recipe at CPU size (seconds): 6 layers x 64, vocab 512, drafter 2 layers, block 16.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TEXTPAIR = os.path.join(REPO, "bench", "textpair")
if TEXTPAIR not in sys.path:
    sys.path.insert(0, TEXTPAIR)

import common as C  # noqa: E402  (bench/textpair/common.py)

SEED = 20261213
SPECIALS = C.SPECIALS            # <pad> <s> </s> <unk> <mask> = ids 0..4, as the text pair
PAD, BOS, EOS, UNK, MASK = C.PAD, C.BOS, C.EOS, C.UNK, C.MASK
HELDOUT_EVERY, HELDOUT_AT = 20, 10   # a file is held out iff int(sha256(key)[:8], 16) % 20 == 10


def build_target_layer_ids(num_target_layers, num_draft_layers):
    """SGLang 0.5.16's sglang.srt.speculative.dflash_utils.build_target_layer_ids (z-lab's rule):
    num_draft_layers ids spread evenly over [1, num_target_layers - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"DFlash layer selection requires num_target_layers >= 4, got {num_target_layers}")
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


PRESETS = {
    "full": dict(vocab=8192, hidden=512, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2048,
                 rope_theta=1000000.0, max_pos=4096,
                 drafter_layers=5, drafter_intermediate=2048, block=16),
    "smoke": dict(vocab=512, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  rope_theta=1000000.0, max_pos=4096,
                  drafter_layers=2, drafter_intermediate=96, block=16),
}


def configs(p):
    """(target config, drafter config): the Hugging Face config.json dicts SGLang loads."""
    ids = build_target_layer_ids(p["layers"], p["drafter_layers"])
    common = dict(model_type="qwen3", vocab_size=p["vocab"], hidden_size=p["hidden"],
                  num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"],
                  max_position_embeddings=p["max_pos"], rms_norm_eps=1e-6, rope_theta=p["rope_theta"],
                  hidden_act="silu", tie_word_embeddings=False, attention_bias=False, bos_token_id=BOS,
                  eos_token_id=EOS, pad_token_id=PAD, torch_dtype="bfloat16")
    target = dict(architectures=["Qwen3ForCausalLM"], **common, intermediate_size=p["intermediate"],
                  num_hidden_layers=p["layers"], initializer_range=0.02, use_cache=True)
    drafter = dict(architectures=["DFlashDraftModel"], **common, intermediate_size=p["drafter_intermediate"],
                   num_hidden_layers=p["drafter_layers"], num_target_layers=p["layers"], block_size=p["block"],
                   dflash_config={"block_size": p["block"], "target_layer_ids": ids, "mask_token": "<mask>",
                                  "mask_token_id": MASK, "num_target_layers": p["layers"]})
    return target, drafter


def n_params(p):
    """(target params with one embedding (tied), target params without it, drafter params)."""
    H, V, I, L = p["hidden"], p["vocab"], p["intermediate"], p["layers"]
    q, kv = p["heads"] * p["head_dim"], p["kv_heads"] * p["head_dim"]

    def layer(inter):
        return H * q * 2 + H * kv * 2 + 3 * H * inter + 2 * H + 2 * p["head_dim"]
    body = L * layer(I) + H
    nid = len(build_target_layer_ids(L, p["drafter_layers"]))
    drafter = p["drafter_layers"] * layer(p["drafter_intermediate"]) + nid * H * H + 2 * H
    return body + V * H, body, drafter


def install(preset, tokenizer_dir=None):
    """Point bench/textpair's common / pairlib and the test bed's mk_models at the preset's shapes
    (this process only).  Returns (common, pairlib) ready for train.py's functions."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    target, drafter = configs(p)
    ids = drafter["dflash_config"]["target_layer_ids"]
    C.VOCAB, C.HIDDEN = p["vocab"], p["hidden"]
    C.TARGET, C.DRAFTER = target, drafter
    C.BLOCK_SIZE, C.N_TARGET_LAYERS, C.TARGET_LAYER_IDS = p["block"], p["layers"], list(ids)
    C.SEED = SEED
    if tokenizer_dir:
        C.TOKENIZER_DIR = tokenizer_dir
    if C.DEVICE_DIR not in sys.path:
        sys.path.insert(0, C.DEVICE_DIR)
    import mk_models as M
    M.HIDDEN = p["hidden"]          # mk_models._qwen3_layers reads it (the init's shapes)
    C.install()
    import pairlib as L
    L.LAST = p["layers"] - 1        # pairlib computed it at import from the text pair's depth
    return C, L
