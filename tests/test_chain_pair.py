"""bench/scale/chain_pair.py: the chain GQA pair at a production Qwen3 shape (here reduced widths, the
same construction) keeps the chain with its margin, its drafter proposes what the toy drafter proposes,
and the extra vocabulary stays out of the drafter's top-K.  fp32 reference forwards on the CPU."""
import importlib.util
import json
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("_chain_pair_test", os.path.join(REPO, "bench", "scale", "chain_pair.py"))
CP = importlib.util.module_from_spec(spec)
spec.loader.exec_module(CP)
from sglang_ddtree import reference_model as RM  # noqa: E402

# the reduced shapes: production construction (duplicated stream, wider heads, identity layers, the
# chain head over an extended vocabulary; MoE: every expert the toy MLP, random router, top-2 of 8)
DENSE = dict(kind="dense", layers=6, hidden=512, heads=8, kv_heads=4, head_dim=128, intermediate=1024,
             vocab=4096, drafter_layers=3, drafter_intermediate=2048)
MOE = dict(kind="moe", layers=6, hidden=512, heads=8, kv_heads=4, head_dim=128, experts=8, top_k=2,
           moe_intermediate=512, vocab=4096, drafter_layers=3, drafter_intermediate=2048)
MARGIN_FLOOR = 120.0  # mk_kimi_cost.py's floor for the same chain


def _f32(sd):
    return {k: v.float() for k, v in sd.items()}


def _prompts(gen, n, vocab):
    return [torch.randint(3, 1000, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def small():
    if not os.path.exists(CP.DEFAULT_DRAFTER):
        pytest.fail(f"{CP.DEFAULT_DRAFTER} (the committed block-16 toy drafter) is missing")
    return CP.small_pair()


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense", "moe"])
def test_scaled_chain_target_and_drafter(shape, small, rng):
    tsd, tcfg, P, dcfg, perm = small
    big, cfg, dsd, dcfg_big, perm2 = CP.build_state(shape)
    assert torch.equal(perm, perm2) and cfg["vocab_size"] == shape["vocab"]
    assert dcfg_big["block_size"] == dcfg_big["dflash_config"]["block_size"] == CP.DEFAULT_BLOCK
    big, dsd = _f32(big), _f32(dsd)
    gen = rng
    # target: greedy over 12 steps from random chain prompts (some holding ids >= 1024: id % 1024)
    margins = []
    for ids in _prompts(gen, 6, shape["vocab"]):
        if len(margins) % 2:
            ids[0] += 1024  # an extended id embeds as its chain token
        seq = list(ids)
        for _ in range(12):
            with torch.no_grad():
                lg = RM.target_logits(big, cfg, torch.tensor([seq]))[0, -1]
            top2 = lg.topk(2)
            assert int(top2.indices[0]) == int(perm[seq[-1] % 1024]), (ids, seq)
            margins.append(float(top2.values[0] - top2.values[1]))
            seq.append(int(top2.indices[0]))
    assert min(margins) >= MARGIN_FLOOR, min(margins)
    # drafter: the big drafter on the big target's features = the toy drafter on the toy's (real ids),
    # and the extra ids hold a tiny share of its probability and almost never a top-16 slot
    n, B = 10, CP.DEFAULT_BLOCK
    seqs = torch.empty(8, n + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(3, 1000, (8,), generator=gen)
    for j in range(1, n + 1):
        seqs[:, j] = perm[seqs[:, j - 1]]
    ids_small = CP.M.TARGET_LAYER_IDS
    with torch.no_grad():
        fs = RM.target_features(tsd, tcfg, seqs[:, :n], ids_small)
        fb = RM.target_features(big, cfg, seqs[:, :n], dcfg_big["dflash_config"]["target_layer_ids"])
        small_lg = RM.drafter_forward(P, dcfg, B, CP.M.MASK_ID, tsd["model.embed_tokens.weight"],
                                      tsd["lm_head.weight"], torch.cat([fs[i] for i in ids_small], -1),
                                      seqs[:, n], n)
        big_lg = RM.drafter_forward(dsd, dcfg_big, B, CP.M.MASK_ID, big["model.embed_tokens.weight"],
                                    big["lm_head.weight"],
                                    torch.cat([fb[i] for i in dcfg_big["dflash_config"]["target_layer_ids"]], -1),
                                    seqs[:, n], n)
    assert big_lg.shape[-1] == shape["vocab"] and big_lg.shape[1] == B - 1
    scale = small_lg.abs().max()
    assert (big_lg[..., :1024] - small_lg).abs().max() <= 1e-3 * scale
    p = big_lg.softmax(-1)
    assert float(p[..., 1024:].sum(-1).mean()) < 0.005
    top16 = big_lg.topk(16, -1).indices
    assert float((top16 >= 1024).float().mean()) < 0.002


def test_learned_junk_row_keeps_the_real_vocabulary_out_of_the_trees():
    """At Qwen3's 151,936 ids the 150,912 junk ids (one shared logit) hold a negligible share of the
    block-16 drafter's probability on held-out chain contexts and never beat its 16th real logit
    (mk_kimi_cost's mean-direction row: ~2.4 % of positions, up to 99 % of the mass there)."""
    w, st = CP.junk_row(vocab=151936)
    assert w.shape == (CP.M.HIDDEN,) and st["positions"] > 10000
    assert st["junk_share_mean"] < 0.005 and st["junk_share_p99"] < 0.02, st
    assert st["junk_above_16th_real"] == 0.0, st


def test_write_and_reuse(tmp_path, monkeypatch):
    """write() makes loadable folders (config, shards, perm, tokenizer, chain.json) and reuses them."""
    monkeypatch.setitem(CP.T.SHAPES, "tiny", dict(DENSE, layers=5))
    r = CP.write(str(tmp_path), "tiny", log=lambda *a, **k: None)
    assert not r["reused"] and r["target_layer_ids"]
    cfg = json.load(open(os.path.join(r["target"], "config.json")))
    dcfg = json.load(open(os.path.join(r["drafter"], "config.json")))
    assert cfg["num_hidden_layers"] == 5 and cfg["vocab_size"] == 4096
    assert dcfg["dflash_config"]["block_size"] == 16 and dcfg["dflash_config"]["mask_token_id"] == 1023
    assert dcfg["dflash_config"]["target_layer_ids"] == r["target_layer_ids"]
    assert len(json.load(open(os.path.join(r["target"], "perm.json")))) == 1024
    idx = json.load(open(os.path.join(r["target"], "model.safetensors.index.json")))
    assert "lm_head.weight" in idx["weight_map"] and "model.layers.4.mlp.down_proj.weight" in idx["weight_map"]
    assert CP.write(str(tmp_path), "tiny", log=lambda *a, **k: None)["reused"]


def test_check_outputs(tmp_path):
    perm = list(range(1, 1024)) + [0]
    doc = {"prompt_ids": [[1, 5], [1, 1030]],
           "output_ids": {"base": {"1": [[6, 7, 8], [7, 8]], "16": [[6, 7, 9], None]}}}
    (tmp_path / "ab.json").write_text(json.dumps(doc))
    (tmp_path / "perm.json").write_text(json.dumps(perm))
    r = CP.check_outputs(str(tmp_path / "ab.json"), str(tmp_path / "perm.json"))
    assert r["checked"] == 3 and r["wrong"] == [("16", 0, 2)]
    assert CP.check_outputs(doc, perm) == r          # loaded content: the same verdict
    with pytest.raises(SystemExit, match="ab.json: no prompt_ids"):
        CP.check_outputs(str(tmp_path / "ab.json"), str(tmp_path / "perm.json"), arm="dflash")
    with pytest.raises(SystemExit, match="the A/B JSON: no prompt_ids"):
        CP.check_outputs(doc, perm, arm="dflash")


def test_check_outputs_every_arm(tmp_path):
    """--arm all: every arm with saved outputs is checked (runs without a base arm, e.g. pinned arms)."""
    import subprocess
    import sys
    perm = list(range(1, 1024)) + [0]
    doc = {"prompt_ids": [[1, 5]], "output_ids": {"ddtree_auto": {"1": [[6, 7]]}, "ddtree_auto_pin7": {"1": [[6, 8]]}}}
    (tmp_path / "ab.json").write_text(json.dumps(doc))
    (tmp_path / "perm.json").write_text(json.dumps(perm))
    script = os.path.join(os.path.dirname(CP.__file__), "chain_pair.py")
    r = subprocess.run([sys.executable, script, "check-outputs", str(tmp_path / "ab.json"), str(tmp_path / "perm.json"),
                        "--arm", "all"], capture_output=True, text=True, timeout=300)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 1 and [x["arm"] for x in lines] == ["ddtree_auto", "ddtree_auto_pin7"]
    assert [x["n_wrong"] for x in lines] == [0, 1]


def test_identity_record_fills_a_run_without_a_reference_arm():
    """The chain identity (the A/B's identity_check format) becomes the run's identity when no base arm
    ran (the report then says 'identical vs chain (n)' / 'k of n differ vs chain', not '-'), and sits
    beside a measured base identity otherwise; a failed request is an error, as against base."""
    from sglang_ddtree.ab.report import _identity_cell, _lossless
    perm = list(range(1, 1024)) + [0]
    doc = {"prompt_ids": [[1, 5], [2, 9]],
           "output_ids": {"ddtree_auto": {"1": [[6, 7], [10, 11]], "4": [[6, 7], [10, 11]]},
                          "ddtree_auto_pin7": {"1": [[6, 8], [10, 11]], "4": [[6, 7], None]}},
           "identity": {"reference": "base", "arms": {}, "note": "reference arm 'base' was not measured"}}
    got = CP.identity_record(json.loads(json.dumps(doc)), perm, ["ddtree_auto", "ddtree_auto_pin7"])
    idn = got["identity"]
    assert idn["reference"] == "chain" and set(idn["arms"]) == {"ddtree_auto", "ddtree_auto_pin7"}
    assert idn["arms"]["ddtree_auto"] == {"compared": 4, "mismatched": 0, "errors": 0,
                                          "by_concurrency": {"1": 0, "4": 0}, "examples": [], "identical": True}
    pin = idn["arms"]["ddtree_auto_pin7"]
    assert (pin["compared"], pin["mismatched"], pin["by_concurrency"]) == (3, 1, {"1": 1, "4": 0})
    assert pin["errors"] == 1                       # the failed request at c=4
    assert pin["examples"] == [{"concurrency": "1", "prompt": 0, "first_diff": 1, "len_arm": 2, "len_ref": 2}]
    assert not pin["identical"]
    assert _identity_cell(got, "ddtree_auto") == "identical vs chain (4)" and _lossless(got, "ddtree_auto")
    assert _identity_cell(got, "ddtree_auto_pin7") == "1 of 3 differ vs chain" and not _lossless(got, "ddtree_auto_pin7")
    # a run with a measured reference arm keeps its identity; the chain verdicts go beside it
    base_idn = {"reference": "base", "arms": {"ddtree_auto": {"compared": 2, "mismatched": 0, "errors": 0,
                                                              "by_concurrency": {"1": 0}, "examples": [],
                                                              "identical": True}}}
    doc2 = CP.identity_record(dict(doc, identity=json.loads(json.dumps(base_idn))), perm, ["ddtree_auto"])
    assert doc2["identity"]["reference"] == "base" and doc2["identity"]["arms"] == base_idn["arms"]
    assert doc2["identity"]["chain"]["arms"]["ddtree_auto"]["compared"] == 4


RUN7 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "bench", "results", "raw", "scalechain_ab_qwen3-8b_h200_s23.json.gz")


@pytest.mark.skipif(not os.path.exists(RUN7), reason="the committed H200 run 7 is not in this checkout")
def test_record_on_a_committed_run_without_base(tmp_path):
    """check-outputs --record on a copy of a committed H200 run of the adaptive server only (no base arm):
    every arm's saved outputs are the chain (the toy target's perm, rebuilt here), and the rewritten
    report says so instead of '-'."""
    import subprocess
    import sys
    doc = CP._loaded(RUN7)
    doc["identity"] = {"reference": "base", "arms": {}, "note": "reference arm 'base' was not measured"}
    (tmp_path / "ab.json").write_text(json.dumps(doc))
    _, perm = CP.M.qwen3_target_state()
    (tmp_path / "perm.json").write_text(json.dumps(perm.tolist()))
    script = os.path.join(os.path.dirname(CP.__file__), "chain_pair.py")
    r = subprocess.run([sys.executable, script, "check-outputs", str(tmp_path / "ab.json"), str(tmp_path / "perm.json"),
                        "--arm", "all", "--record"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    idn = json.loads((tmp_path / "ab.json").read_text())["identity"]
    assert idn["reference"] == "chain" and len(idn["arms"]) == 5
    assert all(d["identical"] and d["compared"] == 472 for d in idn["arms"].values())
    md = (tmp_path / "ab.md").read_text()
    assert "Token identity against `chain`" in md and "| ddtree_auto_b7-15-31-63 | 472 | 0 | 0 |" in md
