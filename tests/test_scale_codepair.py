"""bench/scale on the code pair (issue 42 item 3), CPU, fp32, tiny scale.

A pair of the code pair's architecture (bench/codepair/codeconfig.py: 12 target layers, 12 q / 4 kv
heads, a 5-layer block-16 DFlash drafter reading SGLang's target_layer_ids(12, 5), mask id 4), with
random weights and narrower widths, is scaled by the ratios Qwen3-8B has to the GPU pair (hidden x8,
head dim x2, 32 q / 8 kv heads, MLP x6, 36 layers): the scaled target must compute the same greedy
tokens and the scaled drafter the same proposals.  Then the whole code path of the
``scalecode_<shape>`` stage: the pair as Hugging Face folders with its own tokenizer file, its junk
rows learned by ``vocab.py``'s ``learn``, ``transform.write(pair="code")``, and ``exactness.py --pair
code --no-serve`` (the fp32 reference rows) must pass the bar.
"""
import json
import os
import sys

import pytest
import torch

from helpers import REPO, load_bench
from sglang_ddtree import reference_model as RM
from test_scale_transform import _close, _drafter_logits, small_pair

T = load_bench("scale/transform")
E = load_bench("scale/exactness")
sys.path.insert(0, os.path.join(REPO, "bench", "codepair"))
import codeconfig as K  # noqa: E402

FULL = K.PRESETS["full"]
IDS = K.build_target_layer_ids(FULL["layers"], FULL["drafter_layers"])        # [1, 3, 5, 7, 9]
Q8 = T.SHAPES["qwen3-8b"]
# the tiny code-shaped pair: the GPU pair's layer / head / drafter structure, widths / 32 (head dim / 8)
TINY = dict(d=FULL["hidden"] // 32, nq=FULL["heads"], nkv=FULL["kv_heads"], hd=FULL["head_dim"] // 8,
            inter=FULL["intermediate"] // 32, layers=FULL["layers"], vocab=96, dlayers=FULL["drafter_layers"],
            dinter=FULL["drafter_intermediate"] // 32, ids=tuple(IDS), block=FULL["block"])
# Qwen3-8B's ratios to the GPU pair, applied to the tiny pair
TINY_8B = dict(kind="dense", layers=Q8["layers"], hidden=TINY["d"] * Q8["hidden"] // FULL["hidden"],
               heads=Q8["heads"], kv_heads=Q8["kv_heads"], head_dim=TINY["hd"] * Q8["head_dim"] // FULL["head_dim"],
               intermediate=TINY["inter"] * Q8["intermediate"] // FULL["intermediate"], vocab=400,
               drafter_layers=Q8["drafter_layers"],
               drafter_intermediate=TINY["dinter"] * Q8["drafter_intermediate"] // FULL["drafter_intermediate"])


def _tiny(gen):
    tsd, tcfg, dsd, dcfg = small_pair(gen, **TINY)
    return tsd, dict(tcfg, rope_theta=FULL["rope_theta"]), dsd, dict(dcfg, rope_theta=FULL["rope_theta"])


def test_gpu_code_pair_fits_qwen3_8b_and_not_the_moe_shape():
    """The committed preset divides into Qwen3-8B (hidden 512 -> 4096: x8); 768 would not; the MoE
    shape's 768-wide experts cannot hold the 2048-wide MLP."""
    tc, dc = K.configs(FULL)
    T.check_fit(tc, dc, Q8)
    assert [T.plan(tc, Q8)["layer_pos"][t] for t in IDS] == [3, 9, 15, 21, 27]
    with pytest.raises(T.ShapeError, match="hidden size: 4096 is not a multiple of 768"):
        T.check_fit(*K.configs(dict(FULL, hidden=768)), Q8)
    with pytest.raises(T.ShapeError, match="intermediate 768 < 2048"):
        T.check_fit(tc, dc, T.SHAPES["qwen3-30b-a3b"])


def test_code_shaped_pair_scaled_keeps_greedy_tokens_and_proposals():
    gen = torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    tsd, tcfg, dsd, dcfg = _tiny(gen)
    T.check_fit(tcfg, dcfg, TINY_8B)
    ext = T.extend_vocab(tsd, TINY_8B["vocab"], torch.randn(TINY["d"], generator=gen) - 3.0, seed=5)
    ecfg = dict(tcfg, vocab_size=TINY_8B["vocab"])
    bsd, bcfg = T.scale_target(ext, ecfg, TINY_8B, seed=1)
    ids = torch.randint(5, TINY["vocab"], (2, 40), generator=gen)
    a, b = RM.target_logits(bsd, bcfg, ids), RM.target_logits(ext, ecfg, ids)
    _close(a, b, "code target logits")
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    bdsd, bdcfg = T.scale_drafter(dsd, dcfg, ecfg, TINY_8B)
    assert bdcfg["dflash_config"]["target_layer_ids"] == [3, 9, 15, 21, 27]
    assert bdcfg["block_size"] == 16 and bdcfg["num_hidden_layers"] == 5
    n = 20
    da = _drafter_logits(bsd, bcfg, bdsd, bdcfg, ids, ids[:, n], n)
    db = _drafter_logits(ext, ecfg, dsd, dcfg, ids, ids[:, n], n)
    _close(da, db, "code drafter logits")
    assert torch.equal(da.argmax(-1), db.argmax(-1))


def _write_folder(path, sd, cfg, tokenizer_text=None):
    w = T._FolderWriter(str(path), 1)
    w.shard(sd)
    extra = []
    if tokenizer_text is not None:
        tok = path.parent / "tok_src"
        tok.mkdir(exist_ok=True)
        (tok / "tokenizer.json").write_text(tokenizer_text)
        extra = [str(tok / "tokenizer.json")]
    w.close(cfg, extra, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False})
    return str(path)


def test_code_pair_folders_through_the_stage_path(tmp_path, monkeypatch):
    """HF folders (bf16) -> vocab.learn's junk rows -> transform.write(pair="code") -> the written
    folders carry the code pair's tokenizer; exactness.py --pair code --no-serve passes the bar."""
    V = load_bench("scale/vocab")
    gen = torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    tsd, tcfg, dsd, dcfg = _tiny(gen)
    tcfg = dict(tcfg, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False)
    dcfg = dict(dcfg, architectures=["DFlashDraftModel"], model_type="qwen3")
    tgt = _write_folder(tmp_path / "code_target", tsd, tcfg, '{"code pair tokenizer": 1}')
    drf = _write_folder(tmp_path / "code_drafter", dsd, dcfg)
    # the junk rows, learned for this pair the way the stage does (vocab.py --pair code), fewer steps
    monkeypatch.setattr(V, "STEPS", 300)
    monkeypatch.setattr(V, "WARMUP", 20)
    Tf, tc = T.load_folder(tgt)
    Pf, dc = T.load_folder(drf)
    pair = V.pair_spec(tc, dc)
    assert pair["block"] == 16 and pair["ids"] == IDS and pair["vocab"] == TINY["vocab"]
    stream = torch.randint(5, TINY["vocab"], (4000,), generator=gen).to(torch.int16)
    win = V.stream_windows(stream, 6, 40, gen)
    prompts = [{"input_ids": torch.randint(5, TINY["vocab"], (k,), generator=gen).tolist()} for k in (30, 36, 44)]
    doc = V.learn(Tf, Pf, win, 40 - 16 - 1, [p["input_ids"] for p in prompts], pair)
    assert doc["real_vocab"] == TINY["vocab"] and len(doc["direction"]) == TINY["d"]
    junk = tmp_path / "code_junk_head.json"
    junk.write_text(json.dumps(doc))
    pj = tmp_path / "code_heldout_prompts.json"
    pj.write_text(json.dumps(prompts))

    T.SHAPES["ci-code"] = TINY_8B
    try:
        res = T.write(str(tmp_path / "models"), "ci-code", pair="code", target_dir=tgt, drafter_dir=drf,
                      junk=str(junk))
    finally:
        del T.SHAPES["ci-code"]
    assert res["target"].endswith("ci-codecode_target") and res["drafter"].endswith("ci-codecode_drafter")
    assert res["target_layer_ids"] == [3, 9, 15, 21, 27]
    for d in (res["target"], res["drafter"]):
        assert open(os.path.join(d, "tokenizer.json")).read() == '{"code pair tokenizer": 1}'
    # the scaled drafter folder: SGLang's DFlash config at the 8B-ratio shape
    bdc = json.load(open(os.path.join(res["drafter"], "config.json")))
    assert bdc["hidden_size"] == TINY_8B["hidden"] and bdc["dflash_config"]["num_target_layers"] == 36

    out = str(tmp_path / "ex")
    monkeypatch.setattr(sys, "argv", ["exactness.py", "--model-path", res["target"], "--out", out, "--no-serve",
                                      "--pair", "code", "--small-target", tgt, "--junk", str(junk),
                                      "--prompts", str(pj)])
    E.main()
    rep = json.load(open(out + ".json"))
    r = rep["scaled_fp32ref_vs_small_fp32"]
    assert rep["pair"] == "code" and rep["prompts"] == 3 and r["positions"] == 30 + 36 + 44
    # no real mismatch; a difference may only be an fp32 near tie of the tiny random model (1 of these
    # 110 positions in a CI run of 2026-12-05, which the report's 99.5 % bar, meant for the
    # production-shape pair's thousands of positions, then calls a fail): at most 3 of them
    assert r["errors"] == 0 and r["equal"] >= r["positions"] - 3 and r["near_ties"] == r["positions"] - r["equal"]

    # and the check can fail: a junk file learned for another width is refused
    bad = tmp_path / "bad_junk.json"
    bad.write_text(json.dumps(dict(doc, direction=doc["direction"] + [0.0])))
    with pytest.raises(T.ShapeError, match="was learned for"):
        T.extended_folder_target(tgt, str(bad))
