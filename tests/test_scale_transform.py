"""bench/scale/transform.py: a scaled pair computes what the small pair computes (fp32, CPU).

Random small pairs are drawn fresh each run; the scaled target's logits and the scaled drafter's
logits are compared with the small ones through the plain-torch reference forwards
(sglang_ddtree.reference_model), for a dense and an MoE shape, and for the shipped text pair.
"""
import math

import pytest
import torch

from helpers import load_bench
from sglang_ddtree import reference_model as RM

T = load_bench("scale/transform")


def small_pair(gen, d=32, nq=4, nkv=2, hd=8, inter=48, layers=3, vocab=64, dlayers=2, dinter=40,
               ids=(0, 1), block=4):
    def w(*shape, s=0.3):
        return torch.randn(*shape, generator=gen) * s

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=gen)

    def layer(p, sd, inter_):
        sd[p + "input_layernorm.weight"] = norm(d)
        sd[p + "post_attention_layernorm.weight"] = norm(d)
        sd[p + "self_attn.q_proj.weight"] = w(nq * hd, d)
        sd[p + "self_attn.k_proj.weight"] = w(nkv * hd, d)
        sd[p + "self_attn.v_proj.weight"] = w(nkv * hd, d)
        sd[p + "self_attn.o_proj.weight"] = w(d, nq * hd)
        sd[p + "self_attn.q_norm.weight"] = norm(hd)
        sd[p + "self_attn.k_norm.weight"] = norm(hd)
        sd[p + "mlp.gate_proj.weight"] = w(inter_, d)
        sd[p + "mlp.up_proj.weight"] = w(inter_, d)
        sd[p + "mlp.down_proj.weight"] = w(d, inter_)

    tsd = {"model.embed_tokens.weight": w(vocab, d, s=1.0), "model.norm.weight": norm(d),
           "lm_head.weight": w(vocab, d)}
    for i in range(layers):
        layer(f"model.layers.{i}.", tsd, inter)
    tcfg = dict(hidden_size=d, num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd,
                intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab, rope_theta=10000.0,
                rms_norm_eps=1e-6)
    dsd = {"fc.weight": w(d, len(ids) * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for i in range(dlayers):
        layer(f"layers.{i}.", dsd, dinter)
    dcfg = dict(tcfg, intermediate_size=dinter, num_hidden_layers=dlayers, block_size=block,
                dflash_config={"block_size": block, "target_layer_ids": list(ids), "mask_token_id": 4,
                               "num_target_layers": layers})
    return tsd, tcfg, dsd, dcfg


DENSE = dict(kind="dense", layers=7, hidden=128, heads=16, kv_heads=4, head_dim=16, intermediate=96,
             vocab=100, drafter_layers=3, drafter_intermediate=64)
MOE = dict(kind="moe", layers=5, hidden=96, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2,
           moe_intermediate=64, vocab=80, drafter_layers=2, drafter_intermediate=48)


def _drafter_logits(tsd, tcfg, dsd, dcfg, ids, root, n):
    layers = dcfg["dflash_config"]["target_layer_ids"]
    f = RM.target_features(tsd, tcfg, ids[:, :n], layers)
    feats = torch.cat([f[t] for t in layers], -1)
    return RM.drafter_forward(dsd, dcfg, dcfg["block_size"], 4, tsd["model.embed_tokens.weight"],
                              tsd["lm_head.weight"], feats, root, n)


def _close(a, b, what):
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= 1e-4 * max(1.0, scale), f"{what}: max |diff| {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense", "moe"])
def test_scaled_pair_computes_the_small_pair(shape):
    gen = torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    tsd, tcfg, dsd, dcfg = small_pair(gen)
    direction = torch.randn(tcfg["hidden_size"], generator=gen)
    ext = T.extend_vocab(tsd, shape["vocab"], direction, seed=7)
    assert torch.equal(ext["lm_head.weight"][:64], tsd["lm_head.weight"])
    ecfg = dict(tcfg, vocab_size=shape["vocab"])
    bsd, bcfg = T.scale_target(ext, ecfg, shape, seed=3)
    assert bcfg["hidden_size"] == shape["hidden"] and bcfg["num_hidden_layers"] == shape["layers"]
    assert bsd["model.layers.0.self_attn.q_proj.weight"].shape == (shape["heads"] * shape["head_dim"], shape["hidden"])
    ids = torch.randint(5, 64, (2, 13), generator=gen)
    _close(RM.target_logits(bsd, bcfg, ids), RM.target_logits(ext, ecfg, ids), "target logits")
    # the drafter: same proposals from the same context
    bdsd, bdcfg = T.scale_drafter(dsd, dcfg, ecfg, shape)
    assert bdcfg["dflash_config"]["target_layer_ids"] == [0, shape["layers"] // 3]
    root = ids[:, 9]
    _close(_drafter_logits(bsd, bcfg, bdsd, bdcfg, ids, root, 9),
           _drafter_logits(ext, ecfg, dsd, dcfg, ids, root, 9), "drafter logits")


def test_moe_router_spreads_tokens_but_output_is_the_mlp():
    """Every expert is the small MLP, so the output cannot depend on the routing: check that the
    random router does pick many different experts on random hidden states."""
    gen = torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    tsd, tcfg, _, _ = small_pair(gen)
    ext = T.extend_vocab(tsd, MOE["vocab"], torch.zeros(32), seed=1)
    bsd, bcfg = T.scale_target(ext, dict(tcfg, vocab_size=MOE["vocab"]), MOE, seed=5)
    h = torch.randn(256, MOE["hidden"], generator=gen)
    top = (h @ bsd["model.layers.0.mlp.gate.weight"].T).topk(MOE["top_k"], -1).indices
    assert len(set(top.flatten().tolist())) == MOE["experts"]


def test_text_pair_scaled_keeps_its_greedy_tokens():
    """The shipped trained pair, scaled (hidden 256 -> 512, 4 q / 2 kv -> 8 / 2 heads, head dim 64 ->
    128, 4 -> 6 layers): same logits on a held-out prompt in fp32."""
    from sglang_ddtree import textpair as TP
    tsd, dsd = TP.load_pair()
    tsd = {k: v.float() for k, v in tsd.items()}
    shape = dict(kind="dense", layers=6, hidden=512, heads=8, kv_heads=2, head_dim=128,
                 intermediate=512, vocab=2100, drafter_layers=3, drafter_intermediate=384)
    ext = T.extend_vocab(tsd, shape["vocab"], torch.zeros(256) - 0.05, seed=2)
    ecfg = dict(TP.TARGET, vocab_size=shape["vocab"])
    bsd, bcfg = T.scale_target(ext, ecfg, shape)
    ids = torch.tensor([TP.heldout_prompts()[3]["ids"][:64]])
    a, b = RM.target_logits(bsd, bcfg, ids), RM.target_logits(ext, ecfg, ids)
    _close(a, b, "text target logits")
    assert torch.equal(a.argmax(-1), b.argmax(-1)) or (a.argmax(-1) != b.argmax(-1)).sum() <= 1
    assert int(b.argmax(-1).max()) < TP.VOCAB  # no junk id wins on real text
    bdsd, bdcfg = T.scale_drafter({k: v.float() for k, v in dsd.items()}, dict(TP.DRAFTER), ecfg, shape)
    _close(_drafter_logits(bsd, bcfg, bdsd, bdcfg, ids, ids[:, 40], 40),
           _drafter_logits(ext, ecfg, {k: v.float() for k, v in dsd.items()}, dict(TP.DRAFTER), ids, ids[:, 40], 40),
           "text drafter logits")


@pytest.mark.parametrize("bad,match", [
    (dict(hidden=100), "hidden size"), (dict(head_dim=12), "head dim"),
    (dict(heads=8, kv_heads=8), "cannot hold"), (dict(layers=2), "layers"),
])
def test_shapes_that_cannot_hold_the_pair_are_refused(bad, match):
    gen = torch.Generator().manual_seed(0)
    tsd, tcfg, _, _ = small_pair(gen)
    shape = dict(DENSE, **bad)
    ext = T.extend_vocab(tsd, shape["vocab"], torch.zeros(32), seed=1)
    with pytest.raises(ValueError, match=match):
        T.scale_target(ext, dict(tcfg, vocab_size=shape["vocab"]), shape)


def test_junk_rows_are_deterministic_and_keep_real_rows():
    a = T.junk_rows(50, 16, torch.ones(16), seed=11)
    b = T.junk_rows(50, 16, torch.ones(16), seed=11)
    assert torch.equal(a, b) and not torch.equal(a, T.junk_rows(50, 16, torch.ones(16), seed=12))
    assert abs(a.mean().item() - 1.0) < 0.01 and abs(a.std().item() - 0.02) < 0.005
    with pytest.raises(ValueError, match="vocab"):
        T.extend_vocab({"model.embed_tokens.weight": torch.zeros(8, 4), "lm_head.weight": torch.zeros(8, 4)},
                       4, torch.zeros(4), seed=0)
    assert math.isfinite(a.sum().item())


def test_production_shapes_carry_qwen3_positions():
    """The production shapes' configs (target and drafter) allow Qwen3's 40,960 positions, so a
    long-context arm needs no --context-length override beyond the model's own."""
    gen = torch.Generator().manual_seed(1)
    tsd, tcfg, dsd, dcfg = small_pair(gen)
    for name in ("qwen3-8b", "qwen3-30b-a3b"):
        shape = T.SHAPES[name]
        assert T.scaled_target_config(tcfg, shape)["max_position_embeddings"] == 40960
        assert T.scaled_target_config(tcfg, dict(shape, max_position_embeddings=None)).get(
            "max_position_embeddings") == tcfg.get("max_position_embeddings")
