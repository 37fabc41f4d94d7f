"""bench/device/mk_int4.py: the INT4 (compressed-tensors W4A16) MLA target the Kimi K2.6 path runs.

Checks the writer against compressed-tensors' own pack/unpack (an independent implementation, a
hard dependency of SGLang 0.5.16), the quantizer's error bound, the checkpoint's tensors and config,
and that SGLang 0.5.16 reads it as the INT4 Marlin MoE on a machine without a GPU.
"""
import json
import os

import pytest
import torch

from helpers import load_bench, assert_sglang_reads_int4

Q = load_bench("device/mk_int4")


def _fresh_q(gen, rows=24, cols=64):
    return torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int64).to(torch.int8)


def test_pack_matches_compressed_tensors_and_round_trips():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    gen = torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    q = _fresh_q(gen)
    q[0, :8] = torch.tensor([-8, 7, 0, -1, 1, -8, 7, 3], dtype=torch.int8)  # the extremes, both nibbles
    ours = Q.pack(q)
    assert ours.dtype == torch.int32 and ours.shape == (24, 8)
    assert torch.equal(ours, pack_to_int32(q, 4))
    assert torch.equal(unpack_from_int32(ours, 4, q.shape), q)
    assert torch.equal(Q.unpack(ours, 64), q)
    # first element in the low nibble, stored as q + 8
    assert int(ours[0, 0]) & 0xF == 0 and (int(ours[0, 0]) >> 4) & 0xF == 15
    with pytest.raises(ValueError, match="outside"):
        Q.pack(torch.full((2, 8), 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 8"):
        Q.pack(torch.zeros(2, 12, dtype=torch.int8))


def test_quantize_error_is_within_half_a_step():
    gen = torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    w = torch.randn(16, 96, generator=gen) * 0.02
    q, s = Q.quantize(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (16, 3)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    deq = Q.dequantize(q, s).float()
    step = s.float().repeat_interleave(32, dim=1)
    # round to nearest: at most half a step; max|W| / s = 7.5 clamps to 7, and s is rounded to bf16
    # (relative 2^-8), so up to 7.5 * (1 + 2^-8) - 7 = 0.53 step there; plus the bf16 rounding of
    # the dequantized weight
    err = (deq - w).abs()
    assert bool((err <= 0.53 * step + deq.abs() * 2 ** -8 + 1e-7).all()), float((err / step).max())
    assert float((err / step).median()) < 0.3  # not a constant offset: most errors are small
    with pytest.raises(ValueError, match="group size"):
        Q.quantize(torch.zeros(4, 40))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("int4")
    return Q.make(str(out))


def test_checkpoint_tensors_and_config(written):
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(written["int4"], "config.json")))
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["kv_lora_rank"] == 512
    assert cfg["hidden_size"] % 128 == 0 and cfg["moe_intermediate_size"] % 64 == 0  # Marlin's limits
    sd = load_file(os.path.join(written["int4"], "model.safetensors"))
    ref = load_file(os.path.join(written["reference"], "model.safetensors"))
    experts = sorted(k[: -len(".weight_packed")] for k in sd if k.endswith(".weight_packed"))
    assert len(experts) == written["experts_quantized"] == 3 * 8 * 3  # 3 MoE layers x 8 experts x 3
    for base in experts:
        assert ".mlp.experts." in base
        shape = sd[base + ".weight_shape"]
        assert shape.dtype == torch.int64 and base + ".weight" not in sd
        out_f, in_f = shape.tolist()
        assert sd[base + ".weight_packed"].dtype == torch.int32
        assert sd[base + ".weight_packed"].shape == (out_f, in_f // 8)
        assert sd[base + ".weight_scale"].dtype == torch.bfloat16
        assert sd[base + ".weight_scale"].shape == (out_f, in_f // 32)
        deq = Q.dequantize(Q.unpack(sd[base + ".weight_packed"], in_f), sd[base + ".weight_scale"])
        assert torch.equal(deq, ref[base + ".weight"])  # the reference holds exactly these weights
    # everything that is not a routed expert is identical, bf16, in both
    for k, v in sd.items():
        if ".mlp.experts." not in k:
            assert torch.equal(v, ref[k]), k
    assert json.load(open(os.path.join(written["int4"], "perm.json"))) == \
        json.load(open(os.path.join(written["reference"], "perm.json")))


def test_sglang_reads_it_as_the_int4_marlin_moe(written):
    """SGLang 0.5.16 without a GPU: the model config detects compressed-tensors, the experts get the
    W4A16 MoE scheme (Marlin under the default runner, Triton's under --moe-runner-backend triton),
    every other linear of SGLang's DeepseekV2 module names stays unquantized."""
    pytest.importorskip("sglang")
    from sglang.srt.configs.model_config import ModelConfig

    assert_sglang_reads_int4(written["int4"], attn_layer=1, dense_layer=0, shared_layer=1, moe_layers=(1, 2))
    assert ModelConfig(written["reference"]).quantization is None


def test_logits_check_reference_and_verdicts(written):
    """bench/int4_logits_check.py's CPU parts: the fp32 reference (HF DeepseekV3 on the dequantized twin)
    follows the chain with its margin, and the distance / top-5 / verdict rules on crafted inputs."""
    import math
    HF = load_bench("hf_reference")
    L = load_bench("int4_logits_check")
    perm = json.load(open(os.path.join(written["reference"], "perm.json")))
    model = HF.load_deepseek_v3(written["reference"])
    prompt = [1, 5, 17, 300]
    toks, t = [], prompt[-1]
    for _ in range(6):
        t = perm[t]
        toks.append(t)
    rows = HF.output_logprobs(model, prompt, toks)
    assert rows.shape == (6, len(perm)) or rows.shape[0] == 6
    assert rows.argmax(-1).tolist() == toks
    top2 = rows.topk(2, -1).values
    assert bool(((top2[:, 0] - top2[:, 1]) > 20).all())        # the chain's wide margin
    with pytest.raises(ValueError):
        HF.load_deepseek_v3(written["int4"])                   # a quantized folder is not a reference
    # distances and top-5 sets
    row = torch.full((10,), -50.0)
    row[3], row[7], row[1] = 0.0, -10.0, -12.0
    served = [[(3, -0.01), (7, -10.5), (1, -12.0)]]
    d = L.distances(served, [row])
    assert [round(x, 4) for x in d] == [0.01, 0.5, 0.0]
    assert L.topset_mismatches(served, [row], floor=0.1) == 0
    assert L.topset_mismatches([[(3, 0.0), (7, -10.0), (2, -50.0)]], [row], floor=0.1) == 1
    assert L.topset_mismatches([[(3, 0.0), (7, -10.0), (2, -50.0)]], [row], floor=100.0) == 0  # within noise: skip
    s = {k: L.stat(v) for k, v in {"ref_base": [0.2, 0.4], "int4_base": [0.3, 0.6], "int4_ddtree": [0.3, 0.6]}.items()}
    ok = L.verdicts(s, {"ref_base": 0, "int4_base": 0, "int4_ddtree": 0}, True)
    assert all(ok.values())
    s["int4_base"] = L.stat([0.3, 2.0])
    bad = L.verdicts(s, {"ref_base": 0, "int4_base": 0, "int4_ddtree": 0}, True)
    assert not bad["int4_at_the_twin_floor"]
    assert not L.verdicts(s, {"ref_base": 0, "int4_base": 1, "int4_ddtree": 0}, True)["top5_sets_agree"]
    assert not math.isnan(L.stat([1.0])["p99"])
