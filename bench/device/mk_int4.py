"""The test bed's MLA target with INT4 experts, as a Kimi-K2-style compressed-tensors W4A16 checkpoint.

usage: python bench/device/mk_int4.py OUT_DIR     (torch + safetensors + json only)

OUT_DIR/mlaint4_target     : DeepseekV3ForCausalLM, the permutation-chain MLA target of mk_models.py
                              (MLA kv_lora 512 + rope 64, sigmoid routing with e_score_correction_bias,
                              n_group 1, layer 0 dense) whose routed experts are stored INT4:
                              compressed-tensors "pack-quantized", one config group for Linear,
                              weights {num_bits 4, int, symmetric, strategy group, group_size 32}, no
                              input activations; everything else bf16 and listed in ``ignore``
                              (attention, shared experts, dense MLPs, lm_head), as the Kimi K2 / K2.6
                              checkpoints do. SGLang 0.5.16 then serves the experts through
                              CompressedTensorsWNA16MoE (Marlin; CompressedTensorsWNA16TritonMoE under
                              --moe-runner-backend triton).
OUT_DIR/mlaint4ref_target : the same model in bf16 with the experts' DEQUANTIZED weights (q * scale):
                              the function the INT4 server must compute (its reference).
Both get perm.json (the chain: the greedy output of both is perm^k of the last prompt token, with the
toy targets' ~200-logit margin) and the tokenizer; the drafter of mk_models serves them (same
embeddings, hidden size and chain).

Tensors per expert linear (``...mlp.experts.E.{gate,up,down}_proj``): ``weight_packed`` int32
[out, in / 8], ``weight_scale`` bf16 [out, in / 32], ``weight_shape`` int64 [2]. Values
q = clamp(round(W / s), -8, 7) with s = max|W| / 7.5 over each group of 32 inputs (compressed-tensors'
symmetric scale), stored as q + 8, eight per int32, first element in the low nibble.
Marlin's shape limits: hidden % 128 == 0 and expert intermediate % 64 == 0 (256 and 128 here).
"""
import argparse
import copy
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_mk_models():
    """A private copy of mk_models: the text pair's ``common.install()`` repoints the shared
    module's shapes (VOCAB, DRAFTER, ...) at the text pair, which must not change this target."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_mk_models_for_int4", os.path.join(HERE, "mk_models.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


M = _load_mk_models()

GROUP = 32
QMIN, QMAX = -8, 7

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP, "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    },
    # everything but the routed experts stays bf16 (Kimi K2 lists these modules in its ignore)
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}


def quantize(w):
    """W [out, in] (in % 32 == 0) -> (q int8 [out, in] in [-8, 7], scale bf16 [out, in / 32])."""
    out_f, in_f = w.shape
    if in_f % GROUP:
        raise ValueError(f"in_features {in_f} is not a multiple of the group size {GROUP}")
    g = w.float().reshape(out_f, in_f // GROUP, GROUP)
    scale = (g.abs().amax(-1) / ((QMAX - QMIN) / 2)).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp(QMIN, QMAX).to(torch.int8)
    return q.reshape(out_f, in_f), scale


def dequantize(q, scale):
    """(q int8 [out, in], scale [out, in / 32]) -> the bf16 weight a W4A16 kernel multiplies with."""
    out_f, in_f = q.shape
    w = q.float().reshape(out_f, in_f // GROUP, GROUP) * scale.float()[..., None]
    return w.reshape(out_f, in_f).to(torch.bfloat16)


def pack(q):
    """q int8 [out, in] in [-8, 7] (in % 8 == 0) -> int32 [out, in / 8]: q + 8, eight nibbles per word,
    element 0 in the low nibble."""
    out_f, in_f = q.shape
    if in_f % 8:
        raise ValueError(f"in_features {in_f} is not a multiple of 8")
    if int(q.min()) < QMIN or int(q.max()) > QMAX:
        raise ValueError("values outside [-8, 7]")
    u = (q.to(torch.int64) + 8).reshape(out_f, in_f // 8, 8)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (u << shifts).sum(-1)                      # 0 .. 2^32 - 1
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def unpack(packed, in_f):
    """int32 [out, in / 8] -> int8 [out, in] (the inverse of :func:`pack`)."""
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, dtype=torch.int64) * 4
    u = (w[..., None] >> shifts) & 0xF
    return (u.reshape(packed.shape[0], -1)[:, :in_f] - 8).to(torch.int8)


def expert_names(sd):
    return [k for k in sd if ".mlp.experts." in k and k.endswith("_proj.weight")]


def int4_states(sd):
    """The bf16 DeepSeek-V3 state dict -> (INT4 checkpoint tensors, bf16 reference tensors)."""
    q_sd, ref = {}, {}
    experts = set(expert_names(sd))
    for k, v in sd.items():
        if k in experts:
            q, s = quantize(v)
            base = k[: -len(".weight")]
            q_sd[base + ".weight_packed"] = pack(q)
            q_sd[base + ".weight_scale"] = s
            q_sd[base + ".weight_shape"] = torch.tensor(list(v.shape), dtype=torch.int64)
            ref[k] = dequantize(q, s)
        else:
            q_sd[k] = v
            ref[k] = v
    return q_sd, ref


def _save(d, cfg, sd, perm):
    from safetensors.torch import save_file
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": M.BOS, "eos_token_id": M.EOS, "do_sample": False}, f)
    out = {}
    for k, v in sd.items():
        if v.dtype in (torch.int32, torch.int64):
            out[k] = v.contiguous()
        elif k.endswith("e_score_correction_bias"):  # DeepSeek keeps the router bias in fp32
            out[k] = v.float().contiguous()
        else:
            out[k] = v.to(torch.bfloat16).contiguous()
    save_file(out, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "perm.json"), "w") as f:
        json.dump(perm.tolist(), f)
    M.write_tokenizer(d)


def make(out):
    sd, perm = M.dsv3_target_state()
    q_sd, ref = int4_states(sd)
    qcfg = copy.deepcopy(M.DSV3)
    qcfg["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
    tq, tr = os.path.join(out, "mlaint4_target"), os.path.join(out, "mlaint4ref_target")
    _save(tq, qcfg, q_sd, perm)
    _save(tr, copy.deepcopy(M.DSV3), ref, perm)
    err = max(float((ref[k].float() - sd[k].float()).abs().max()) for k in expert_names(sd))
    return {"int4": tq, "reference": tr, "experts_quantized": len(expert_names(sd)),
            "max_abs_quantization_error": err}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    a = ap.parse_args()
    print(json.dumps(make(a.out)))
