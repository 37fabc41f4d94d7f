"""Check and evaluate the committed text pair on the CPU (here; needs transformers for the layout
check, the tokenized cache for the held-out slice).

    python bench/textpair/evaluate.py [--windows 64] [--gen 128] [--out bench/textpair/eval_cpu.json]

1. layout: materialize into a temp dir; the target loads in transformers' Qwen3ForCausalLM with no
   missing / unexpected keys and its logits match the reference forward; its tensor names equal
   those mk_models writes for gqa_target; the drafter's names equal
   bench/device/weights/drafter.safetensors.xz' and every shape follows the configs;
   AutoConfig / AutoTokenizer load both folders.
2. held-out loss / perplexity on the first --windows windows of 512 held-out tokens and the fraction
   of those positions whose top-2 logit margin is below bf16 spacing (bf16 weights, fp32 forward).
3. for each of the 32 held-out prompts (heldout_prompts.json): --gen greedy tokens (fraction of
   greedy steps with a margin below bf16 spacing) and the offline DFLASH simulation (pairlib.dflash_sim).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import materialize as MAT  # noqa: E402
import pairlib as L  # noqa: E402


def layout_check(tmp):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    res = {}
    paths = MAT.materialize(tmp)
    # reference names: what the test bed writes (its own process: mk_models' configs untouched)
    ref = os.path.join(tmp, "mk")
    subprocess.run([sys.executable, os.path.join(C.DEVICE_DIR, "mk_models.py"), ref], check=True,
                   stdout=subprocess.DEVNULL)
    ref_t = load_file(os.path.join(ref, "gqa_target", "model.safetensors"))
    spec = importlib.util.spec_from_file_location("_mk_models_ref", os.path.join(C.DEVICE_DIR, "mk_models.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    ref_d = load_file(mk.committed_weights("drafter"))   # committed xz-compressed
    T = load_file(os.path.join(paths["target"], "model.safetensors"))
    D = load_file(os.path.join(paths["drafter"], "model.safetensors"))
    res["target_names_equal_gqa_target"] = sorted(T) == sorted(ref_t)
    res["drafter_names_equal_testbed_drafter"] = sorted(D) == sorted(ref_d)
    res["dtypes_bf16"] = all(v.dtype == torch.bfloat16 for v in list(T.values()) + list(D.values()))
    # shapes from the configs
    def want(c, prefix):
        hd, nq, nkv, it, H = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"], c["hidden_size"]
        w = {}
        for i in range(c["num_hidden_layers"]):
            p = f"{prefix}{i}."
            w.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                      p + "self_attn.q_proj.weight": (nq * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                      p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nq * hd),
                      p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                      p + "mlp.gate_proj.weight": (it, H), p + "mlp.up_proj.weight": (it, H),
                      p + "mlp.down_proj.weight": (H, it)})
        return w
    wt = want(C.TARGET, "model.layers.")
    wt.update({"model.embed_tokens.weight": (C.VOCAB, C.HIDDEN), "lm_head.weight": (C.VOCAB, C.HIDDEN),
               "model.norm.weight": (C.HIDDEN,)})
    wd = want(C.DRAFTER, "layers.")
    wd.update({"norm.weight": (C.HIDDEN,), "hidden_norm.weight": (C.HIDDEN,),
               "fc.weight": (C.HIDDEN, len(C.TARGET_LAYER_IDS) * C.HIDDEN)})
    res["target_shapes_follow_config"] = {k: tuple(v.shape) for k, v in T.items()} == wt
    res["drafter_shapes_follow_config"] = {k: tuple(v.shape) for k, v in D.items()} == wd
    for name in ("target", "drafter"):
        cfg = AutoConfig.from_pretrained(paths[name])
        tok = AutoTokenizer.from_pretrained(paths[name])
        res[f"{name}_autoconfig"] = type(cfg).__name__
        res[f"{name}_tokenizer"] = [len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id,
                                    tok.mask_token_id]
    dcfg = json.load(open(os.path.join(paths["drafter"], "config.json")))["dflash_config"]
    res["mask_token_id_matches_tokenizer"] = tok.convert_tokens_to_ids(dcfg["mask_token"]) == dcfg["mask_token_id"]
    # transformers' Qwen3 on the materialized target vs the reference forward
    model, info = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32,
                                                       output_loading_info=True)
    res["hf_missing_unexpected"] = [list(info["missing_keys"]), list(info["unexpected_keys"])]
    prompts = json.load(open(C.PROMPTS))
    ids = torch.tensor([prompts[0]["ids"][:16]])
    with torch.no_grad():
        hf = model(ids).logits
        ref_lg = L.logits({k: v.float() for k, v in T.items() if k != "lm_head.weight"}, ids)
    res["hf_vs_reference_max_abs_logit_diff"] = float((hf - ref_lg).abs().max())
    res["hf_vs_reference_same_argmax"] = bool((hf.argmax(-1) == ref_lg.argmax(-1)).all())
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=C.WEIGHTS_DIR)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(C.HERE, "eval_cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    res = {"torch": torch.__version__}
    if a.weights == C.WEIGHTS_DIR:
        with tempfile.TemporaryDirectory() as tmp:
            res["layout"] = layout_check(tmp)
        print("layout", json.dumps(res["layout"]), flush=True)
    T, D = MAT.load_pair(a.weights)
    T = {k: v.float() for k, v in T.items() if k != "lm_head.weight"}
    D = {k: v.float() for k, v in D.items()}
    held = torch.load(os.path.join(C.CACHE, "heldout.pt")).long()
    res["heldout"] = L.heldout_eval(T, held, 512, 8, a.windows)
    res["heldout"]["windows"] = a.windows
    print("heldout", res["heldout"], f"{time.time()-t0:.0f}s", flush=True)
    prompts = json.load(open(C.PROMPTS))[:a.prompts]
    ties = steps = rounds = toks = 0
    depth = torch.zeros(C.BLOCK_SIZE - 1)
    anchor_sum = anchors = 0
    per = []
    for i, pr in enumerate(prompts):
        p = len(pr["ids"])
        seq, t, n = L.greedy(T, torch.tensor([pr["ids"]]), a.gen)
        ties, steps = ties + t, steps + n
        sim = L.dflash_sim(D, T, seq, L.features(T, seq), p)
        rounds += sim["rounds"]
        toks += sim["dflash_tokens_per_round"] * sim["rounds"]
        na = a.gen - C.BLOCK_SIZE + 1
        depth += torch.tensor(sim["depth_top1"]) * na
        anchor_sum += sim["accept_per_anchor"] * na
        anchors += na
        per.append(round(sim["dflash_tokens_per_round"], 2))
        print(f"prompt {i} len {p}: tokens/round {sim['dflash_tokens_per_round']} per-anchor "
              f"{sim['accept_per_anchor']} ({time.time()-t0:.0f}s)", flush=True)
    res["greedy_heldout_prompts"] = {"prompts": len(prompts), "gen": a.gen, "greedy_steps": steps,
                                     "bf16_tie_frac_greedy": round(ties / steps, 5)}
    res["dflash_sim_heldout_prompts"] = {
        "block_size": C.BLOCK_SIZE, "dflash_tokens_per_round": round(toks / rounds, 3), "rounds": rounds,
        "accept_per_anchor": round(anchor_sum / anchors, 3),
        "depth_top1": [round(v, 3) for v in (depth / anchors).tolist()], "per_prompt_tokens_per_round": per}
    res["seconds"] = round(time.time() - t0, 1)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "layout"}, indent=1))


if __name__ == "__main__":
    main()
