"""bench/scale/exactness.py's reference rows (CPU, no SGLang): the text pair written at a scaled
shape by transform.write computes the small target's greedy tokens in fp32, and a damaged copy of
the written folder fails the bar (the check can fail)."""
import json
import os
import sys

import pytest
import torch

from helpers import load_bench

T = load_bench("scale/transform")
E = load_bench("scale/exactness")

# the shipped text target (hidden 256, 4 q / 2 kv x 64, 4 layers) at twice its width, two more
# (identity) layers and Qwen3's vocabulary: every mapping of the transform, small enough for CI
SMALL_SHAPE = dict(kind="dense", layers=6, hidden=512, heads=8, kv_heads=2, head_dim=128, intermediate=512,
                   vocab=151936, drafter_layers=2, drafter_intermediate=384)


def _run(monkeypatch, model, out, n_prompts):
    monkeypatch.setattr(sys, "argv", ["exactness.py", "--model-path", model, "--out", out, "--no-serve",
                                      "--max-prompts", str(n_prompts)])
    E.main()
    with open(out + ".json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("scaled")
    T.SHAPES["ci-small"] = SMALL_SHAPE
    try:
        return T.write(str(d), "ci-small")
    finally:
        del T.SHAPES["ci-small"]


def test_written_scaled_target_keeps_the_greedy_tokens(written, tmp_path, monkeypatch):
    doc = _run(monkeypatch, written["target"], str(tmp_path / "ex"), 3)
    r = doc["scaled_fp32ref_vs_small_fp32"]
    assert r["positions"] > 100
    assert r["errors"] == 0 and r["equal_fraction"] >= 0.995
    assert doc["passes"] and doc["passes_reference"] and doc["judged_on"] == "scaled_fp32ref_vs_small_fp32"
    md = open(tmp_path / "ex.md").read()
    assert "reference_model" in md and "Passes the bar" in md and ": yes" in md


def test_damaged_copy_fails_the_bar(written, tmp_path, monkeypatch):
    """Swap two real layers' attention output projections in a copy of the folder: the function
    changes, so positions differ beyond near ties and the verdict is NO."""
    from safetensors.torch import load_file, save_file
    src, dst = written["target"], str(tmp_path / "damaged")
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            sd = load_file(os.path.join(src, name))
            for k in list(sd):
                if k.endswith("self_attn.o_proj.weight") and k.startswith("model.layers.0."):
                    sd[k] = -3.0 * sd[k]
            save_file(sd, os.path.join(dst, name), metadata={"format": "pt"})
        else:
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    doc = _run(monkeypatch, dst, str(tmp_path / "ex"), 3)
    r = doc["scaled_fp32ref_vs_small_fp32"]
    assert r["errors"] > 0 and not doc["passes"] and not doc["passes_reference"]
    assert "NO" in open(tmp_path / "ex.md").read()


def test_float32_serving_is_refused_with_the_reason(monkeypatch, capsys, tmp_path):
    """SGLang 0.5.16 cannot serve Qwen3 in fp32 (measured on the H200): a clear error before any work."""
    monkeypatch.setattr(sys, "argv", ["exactness.py", "--model-path", str(tmp_path), "--out", str(tmp_path / "x"),
                                      "--dtype", "float32"])
    with pytest.raises(SystemExit) as e:
        E.main()
    assert e.value.code == 2 and "--no-serve" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
