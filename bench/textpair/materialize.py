"""Write the text pair as two Hugging Face model folders SGLang 0.5.16 loads (torch + safetensors +
json only; runs on the GPU host from the carried checkout).

    python bench/textpair/materialize.py OUT_DIR [--weights DIR]

OUT_DIR/text_target : Qwen3ForCausalLM (config.json, generation_config.json, model.safetensors,
                      tokenizer.json, tokenizer_config.json, special_tokens_map.json)
OUT_DIR/text_drafter: DFlashDraftModel (same files; dflash_config: block_size 8,
                      target_layer_ids [1, 2], mask_token <mask> = id 4, num_target_layers 4)
OUT_DIR/heldout_prompts.json: a copy of the 32 held-out benchmark prompts (token ids).

The target was trained with a tied head. The committed file stores the embedding once; this
writes lm_head.weight as an exact copy and config tie_word_embeddings=false, i.e. the same untied
Qwen3 layout as the test bed's gqa_target (same weights, same logits), so the drafter borrows an
ordinary lm_head.
"""
import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_pair(weights=C.WEIGHTS_DIR):
    """(target state dict incl. lm_head.weight, drafter state dict), bf16, from the committed files."""
    return C._tp.load_pair(weights)


def _write(d, cfg, sd):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": C.BOS, "eos_token_id": C.EOS, "pad_token_id": C.PAD,
                   "do_sample": False}, f)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()},
              os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    for n in TOKENIZER_FILES:
        shutil.copy(os.path.join(C.TOKENIZER_DIR, n), os.path.join(d, n))


def materialize(out, weights=C.WEIGHTS_DIR, drafter_run=None):
    """The shipped pair; with ``drafter_run`` (a train.py output) also OUT/text_drafter_b<B> for
    that drafter (the shipped text_drafter stays as it is)."""
    T, D = load_pair(weights)
    tgt, dr = os.path.join(out, "text_target"), os.path.join(out, "text_drafter")
    _write(tgt, C.TARGET, T)
    _write(dr, C.DRAFTER, D)
    shutil.copy(C.PROMPTS, os.path.join(out, "heldout_prompts.json"))
    res = {"target": tgt, "drafter": dr, "prompts": os.path.join(out, "heldout_prompts.json")}
    if drafter_run:
        sd, cfg = C._tp.load_drafter_run(drafter_run)
        d2 = os.path.join(out, f"text_drafter_b{cfg['block_size']}")
        _write(d2, cfg, sd)
        res["trained_drafter"] = d2
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--weights", default=C.WEIGHTS_DIR)
    ap.add_argument("--drafter-run", default=None, help="a train.py output folder: also write its drafter")
    a = ap.parse_args()
    print(json.dumps(materialize(a.out, a.weights, a.drafter_run)))
