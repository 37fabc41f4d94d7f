"""bench/device/mk_kimi_cost.py: the production-cost INT4 MLA pair (Kimi K2 widths) on the CPU.

The full-size checkpoint is ~30 GB, so the weights are checked on the REDUCED copy (mk_kimi_cost.REDUCED:
hidden 512 = 2 toy copies, 24 heads, 36 experts, top-8, 10 layers, vocab 4096) that the same code writes;
the full-size configs are written without weights and checked field by field.  The reference forward is
Hugging Face transformers' DeepseekV3ForCausalLM (fp32) on the checkpoint's dequantized weights
(mk_int4.unpack / dequantize), independent of the writer; the toy MLA target (mk_int4's, experts
dequantized) runs through the same HF class; the drafters through sglang_ddtree.reference_model.
"""
import glob
import json
import math
import os

import pytest
import torch

from helpers import load_bench, assert_sglang_reads_int4

K = load_bench("device/mk_kimi_cost")
HF = load_bench("hf_reference")
Q, M = K.Q, K.M


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 2-core machine, maybe with a CI job on it: one thread is faster than two contended ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def full_configs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("kimicost_full"))
    return K.make(out, K.K2, "cpu", configs_only=True, log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("kimicost_reduced"))
    return K.make(out, K.REDUCED, "cpu", log=lambda *a, **k: None)


def _load_raw(d):
    from safetensors.torch import load_file
    sd = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        sd.update(load_file(f))
    return sd


def _dequantized(raw):
    out = {}
    for k, v in raw.items():
        if k.endswith(".weight_packed"):
            b = k[: -len(".weight_packed")]
            in_f = int(raw[b + ".weight_shape"][1])
            out[b + ".weight"] = Q.dequantize(Q.unpack(v, in_f), raw[b + ".weight_scale"])
        elif not k.endswith((".weight_scale", ".weight_shape")):
            out[k] = v
    return out


def _hf(cfg, sd):
    """HF DeepseekV3ForCausalLM (fp32, eager attention) holding state dict sd (per-expert names)."""
    return HF.build_deepseek_v3(cfg, sd)


def _chain(perm, t, n):
    out = []
    for _ in range(n):
        t = perm[t % M.VOCAB]
        out.append(t)
    return out


PROMPTS = [[1, 5, 17, 300, 42, 7, 99, 123], [1, 77], [1, 400, 401, 402, 403], [1, 1000, 11, 111],
           [1, 640, 641], [1, 250, 251, 252, 253, 254], [1, 2049, 3000], [1, 9, 8, 7, 6]]  # 3000: id >= 1024
STEPS = 40


@pytest.fixture(scope="module")
def runs(reduced):
    """One fp32 forward of the reduced big target and of the toy over PROMPTS + their chains (STEPS
    tokens), with the hidden states after layers 1 and 2 (the drafter's features)."""
    raw = _load_raw(reduced["target"])
    cfg = json.load(open(os.path.join(reduced["target"], "config.json")))
    perm = json.load(open(os.path.join(reduced["target"], "perm.json")))
    big_sd = _dequantized(raw)
    _, _, toy_ref, toy_perm = K.toy_parts()
    assert perm == toy_perm.tolist()
    big, toy = _hf(cfg, big_sd), _hf(M.DSV3, toy_ref)
    T = max(len(p) for p in PROMPTS) + STEPS
    seqs = torch.zeros(len(PROMPTS), T, dtype=torch.long)
    for b, p in enumerate(PROMPTS):  # left-aligned; the tail past the chain is never looked at
        s = p + _chain(perm, p[-1], STEPS)
        seqs[b, : len(s)] = torch.tensor(s)
        seqs[b, len(s):] = torch.tensor(_chain(perm, s[-1], T - len(s)))
    feats, hooks = {}, []
    for name, m in (("big", big), ("toy", toy)):
        for i in M.TARGET_LAYER_IDS:
            hooks.append(m.model.layers[i].register_forward_hook(
                lambda mod, inp, out, key=(name, i): feats.__setitem__(key, out[0] if isinstance(out, tuple) else out)))
    toy_seqs = seqs % M.VOCAB  # the toy has 1024 ids; ids >= 1024 of the big one embed as id % 1024
    with torch.no_grad():
        big_logits = big(seqs).logits
        toy_logits = toy(toy_seqs).logits
    for h in hooks:
        h.remove()
    return dict(big=big, toy=toy, big_sd=big_sd, toy_ref=toy_ref, raw=raw, cfg=cfg, perm=perm, seqs=seqs,
                big_logits=big_logits, toy_logits=toy_logits, feats=feats)


# --- configs -----------------------------------------------------------------------------------------------
def test_full_size_config_is_k2s(full_configs):
    cfg = json.load(open(os.path.join(full_configs["target"], "config.json")))
    k2 = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
              qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=2048,
              intermediate_size=18432, num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=2.827,
              scoring_func="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1, first_k_dense_replace=1,
              moe_layer_freq=1, norm_topk_prob=True, vocab_size=163840, hidden_act="silu",
              architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    assert {k: cfg[k] for k in k2} == k2
    assert (cfg["num_hidden_layers"], cfg["n_routed_experts"]) == (10, 96)
    assert cfg["quantization_config"] == Q.QUANTIZATION_CONFIG
    assert cfg["quantization_config"]["ignore"] == ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                                    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
    assert cfg["hidden_size"] % 128 == 0 and cfg["moe_intermediate_size"] % 64 == 0  # Marlin
    assert full_configs["target_bytes"] <= 30e9 and full_configs["target_bytes"] == K.sizes(K.K2)["target"]
    assert abs(full_configs["target_bytes"] - 29.72e9) < 0.01e9  # the default bench/device/README.md states
    d = json.load(open(os.path.join(full_configs["drafter"], "config.json")))
    assert d["architectures"] == ["DFlashDraftModel"]
    assert (d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"],
            d["intermediate_size"], d["num_hidden_layers"], d["vocab_size"]) == (7168, 64, 8, 128, 18432, 2, 163840)
    assert d["dflash_config"] == {"block_size": 8, "target_layer_ids": [1, 2], "mask_token_id": 1023,
                                  "num_target_layers": 10}
    assert not glob.glob(os.path.join(full_configs["target"], "*.safetensors"))  # configs only
    with pytest.raises(ValueError, match="experts >= 32"):
        K.check_shape(dict(K.K2, experts=16))
    with pytest.raises(ValueError, match="heads >= 16"):
        K.check_shape(dict(K.K2, heads=8))


def test_reduced_checkpoint_inventory(reduced, runs):
    s, raw = K.REDUCED, runs["raw"]
    want = {n: (shape, dt) for n, shape, dt in K.head_specs(s)}
    for i in range(s["layers"]):
        want.update({n: (shape, dt) for n, shape, dt in K.layer_specs(s, i)})
    assert {k: (tuple(v.shape), v.dtype) for k, v in raw.items()} == want
    idx = json.load(open(os.path.join(reduced["target"], "model.safetensors.index.json")))
    assert set(idx["weight_map"]) == set(raw)
    assert idx["metadata"]["total_size"] == reduced["target_bytes"] == sum(v.numel() * v.element_size() for v in raw.values())
    assert runs["cfg"] == K.target_config(s)
    # the widened drafter: scale_drafter's config is the one drafter_config() states
    dcfg = json.load(open(os.path.join(reduced["drafter"], "config.json")))
    assert dcfg == K.drafter_config(s) and dcfg["dflash_config"]["target_layer_ids"] == [1, 2]


# --- INT4 -------------------------------------------------------------------------------------------------
def test_int4_tensors_round_trip(runs):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    s, raw = K.REDUCED, runs["raw"]
    _, packed_toy, toy_ref, _ = K.toy_parts()
    toy_fp32, _ = M.dsv3_target_state()  # what mk_int4 quantizes
    bases = sorted(k[: -len(".weight_packed")] for k in raw if k.endswith(".weight_packed"))
    assert len(bases) == (s["layers"] - 1) * s["experts"] * 3
    cpe, d, fix = K.copies_per_expert(s), M.HIDDEN, M.DSV3["routed_scaling_factor"] / s["rsf"]
    for n_checked, b in enumerate(bases):
        out_f, in_f = raw[b + ".weight_shape"].tolist()
        q = Q.unpack(raw[b + ".weight_packed"], in_f)
        assert q.shape == (out_f, in_f) and int(q.min()) >= -8 and int(q.max()) <= 7
        assert torch.equal(Q.pack(q), raw[b + ".weight_packed"])  # pack / unpack round trip
        if n_checked % 7 == 0:  # compressed-tensors' own unpacker agrees (a sample: it is slow)
            assert torch.equal(unpack_from_int32(raw[b + ".weight_packed"], 4, torch.Size([out_f, in_f])), q)
        layer, e, proj = int(b.split(".")[2]), int(b.split(".")[5]), b.split(".")[6]
        if layer < K.TOY_LAYERS and e < cpe * M.DSV3["n_routed_experts"]:  # a copy of toy expert e // cpe
            tb = f"model.layers.{layer}.mlp.experts.{e // cpe}.{proj}"
            w_toy = toy_ref[tb + ".weight"].float()                      # the toy's dequantized weight
            if proj == "down_proj":  # writes every copy; the toy's nibbles, scale x 2.5 / 2.827
                tp, ts, _ = packed_toy[tb]
                want = Q.dequantize(Q.unpack(tp, tp.shape[1] * 8), (ts.float() * fix).to(torch.bfloat16))
                big = torch.zeros(out_f, in_f, dtype=torch.bfloat16)
                for r in range(out_f // d):
                    big[r * d:(r + 1) * d, : want.shape[1]] = want
                assert torch.equal(Q.dequantize(q, raw[b + ".weight_scale"]), big)
                assert torch.allclose(want.float(), w_toy * fix, rtol=2 ** -6, atol=1e-6)  # 3 bf16 roundings
            else:  # reads copy 0: exactly what mk_int4.quantize makes of the zero-padded toy weight
                W = torch.zeros(out_f, in_f)
                W[: w_toy.shape[0], :d] = toy_fp32[tb + ".weight"]
                q2, s2 = Q.quantize(W)
                assert torch.equal(q, q2) and torch.equal(raw[b + ".weight_scale"], s2)
                W[: w_toy.shape[0], :d] = w_toy
                assert torch.equal(Q.dequantize(q, raw[b + ".weight_scale"]).float(), W)
        else:  # random nibbles: symmetric in [-7, 7], one scale per matrix
            assert int(q.min()) >= -7 and abs(float(q.float().mean())) < 0.08
            fan = in_f
            std = (K.ALPHA if proj == "down_proj" else 1.0) / math.sqrt(fan)
            sc = raw[b + ".weight_scale"]
            assert torch.equal(sc, torch.full_like(sc, std / K.Q_RMS))
            assert abs(float(q.float().pow(2).mean().sqrt()) - K.Q_RMS) < 0.05
    # routing of the toy layers: copies carry the toy's bias, the rest can never be picked
    for layer in (1, 2):
        bias = raw[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        tb = toy_ref[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32
        assert torch.equal(bias[: 8 * cpe], tb.repeat_interleave(cpe)) and bool((bias[8 * cpe:] == -1).all())


# --- SGLang on the CPU ---------------------------------------------------------------------------------------
def test_sglang_accepts_the_pair(full_configs, reduced):
    pytest.importorskip("sglang")
    from sglang.srt.server_args import prepare_server_args

    for d in (full_configs["target"], reduced["target"]):
        assert_sglang_reads_int4(d, attn_layer=3, dense_layer=0, shared_layer=5, moe_layers=(4, 1))
    # the server arguments the stages use (stage.py: DFLASH with the pair's drafter) resolve on the CPU
    sa = prepare_server_args(["--device", "cuda", "--model-path", full_configs["target"], "--speculative-algorithm",
                              "DFLASH", "--speculative-draft-model-path", full_configs["drafter"],
                              "--skip-tokenizer-init", "--attention-backend", "triton"])
    assert sa.speculative_algorithm == "DFLASH" and sa.speculative_num_draft_tokens == 8  # the drafter's block


# --- the chain ------------------------------------------------------------------------------------------------
def test_greedy_output_is_the_chain_with_a_wide_margin(runs):
    lg, perm = runs["big_logits"], runs["perm"]
    margins = []
    for b, p in enumerate(PROMPTS):
        rows = lg[b, len(p) - 1: len(p) - 1 + STEPS]                      # predicting chain steps 1..STEPS
        top = rows.topk(2, -1)
        assert top.indices[:, 0].tolist() == _chain(perm, p[-1], STEPS), p
        margins.append(top.values[:, 0] - top.values[:, 1])
    m = torch.cat(margins)
    print(f"margin over {m.numel()} steps: min {float(m.min()):.1f} median {float(m.median()):.1f}")
    assert float(m.min()) >= K.MARGIN_FLOOR
    assert float(lg[..., M.VOCAB:].abs().max()) == 0.0  # ids >= 1024: logit exactly 0 in the target
    # literal greedy decoding (HF generate, KV cache) from two prompts, 32 steps
    with torch.no_grad():
        for p in (PROMPTS[0], PROMPTS[6]):
            out = runs["big"].generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                       eos_token_id=None, pad_token_id=0)
            assert out[0, len(p):].tolist() == _chain(perm, p[-1], 32)


def test_toy_layers_are_the_toy_target(runs):
    """The big target's hidden states after layers 1 and 2 are the toy mlaint4 target's, in every copy
    (the only difference: the down_proj scales x 2.5 / 2.827 rounded to bf16)."""
    f, c = runs["feats"], K.REDUCED["hidden"] // M.HIDDEN
    for i in M.TARGET_LAYER_IDS:
        big, toy = f[("big", i)], f[("toy", i)]
        assert big.shape[-1] == c * M.HIDDEN
        for k in range(c):
            assert float((big[..., k * M.HIDDEN:(k + 1) * M.HIDDEN] - toy).abs().max()) < 2e-3, (i, k)
        assert float((toy - runs["toy"].model.embed_tokens(runs["seqs"] % M.VOCAB)).pow(2).mean().sqrt()) > 0.1


def test_widened_drafter_proposes_what_the_toy_drafter_proposes(reduced, runs):
    from safetensors.torch import load_file
    RM = K._reference_model()
    Pt = {k: v.float() for k, v in load_file(M.DEFAULT_DRAFTER).items()}
    Pb = {k: v.float() for k, v in load_file(os.path.join(reduced["drafter"], "model.safetensors")).items()}
    dcfg = json.load(open(os.path.join(reduced["drafter"], "config.json")))
    f, seqs = runs["feats"], runs["seqs"]
    Ft = torch.cat([f[("toy", i)] for i in M.TARGET_LAYER_IDS], -1)
    Fb = torch.cat([f[("big", i)] for i in M.TARGET_LAYER_IDS], -1)
    Et, Wt = runs["toy_ref"]["model.embed_tokens.weight"].float(), runs["toy_ref"]["lm_head.weight"].float()
    Eb, Wb = runs["big_sd"]["model.embed_tokens.weight"].float(), runs["big_sd"]["lm_head.weight"].float()
    agree = total = junk_top = 0
    junk_mass, toy_ok = [], 0
    with torch.no_grad():
        for n in (8, 12, 17, 23, 30, 36):
            root = seqs[:, n]
            a = RM.drafter_forward(Pt, M.DRAFTER, M.BLOCK_SIZE, M.MASK_ID, Et, Wt, Ft[:, :n], root % M.VOCAB, n)
            b = RM.drafter_forward(Pb, dcfg, M.BLOCK_SIZE, M.MASK_ID, Eb, Wb, Fb[:, :n], root, n)
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0] * a.shape[1]
            assert float((a - b[..., : M.VOCAB]).abs().max()) < 0.05
            junk_top += int((b.topk(16, -1).indices >= M.VOCAB).sum())
            junk_mass.append(torch.softmax(b, -1)[..., M.VOCAB:].sum(-1).flatten())
            toy_ok += int((a.argmax(-1) == seqs[:, n + 1:n + M.BLOCK_SIZE] % M.VOCAB).sum())
    jm = torch.cat(junk_mass)
    print(f"top-1 agreement {agree}/{total}; toy drafter top-1 right {toy_ok}/{total}; junk in top-16 "
          f"{junk_top}/{total * 16}; junk probability mean {float(jm.mean()):.4f} max {float(jm.max()):.3f}")
    assert agree / total >= 0.99
    assert 0.2 < toy_ok / total < 1.0  # the toy drafter: right often, not always (what DDTree needs)
    assert float(jm.mean()) < 0.02 and junk_top / (total * 16) < 0.01


def test_sglang_server_args_for_ddtree(full_configs):
    """kimicost_ddtree_graph_b16's arguments: DDTREE-GPU (the project's plugin) resolves budget 16 against
    the drafter's block 8 and the target's vocabulary 163840 on the CPU."""
    pytest.importorskip("sglang")
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    load_plugins()
    sa = prepare_server_args(["--device", "cuda", "--model-path", full_configs["target"], "--speculative-algorithm",
                              "DDTREE-GPU", "--speculative-draft-model-path", full_configs["drafter"],
                              "--speculative-num-draft-tokens", "17", "--skip-tokenizer-init",
                              "--attention-backend", "triton", "--mem-fraction-static", "0.8"])
    assert sa.speculative_algorithm == "DDTREE-GPU" and sa.speculative_num_draft_tokens == 17
    from sglang_ddtree import config as C
    rec = getattr(sa, C.SETTINGS_ATTR)
    assert rec["budget"] == 16 and rec["vocab_size"] == 163840
