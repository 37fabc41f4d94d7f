"""bench/verify_attention.py's harness on the CPU (``--smoke``, Triton interpreter, fp32): our
tree-verify attention and SGLang 0.5.16's own TARGET_VERIFY kernel (``extend_attention_fwd`` called
as its TritonAttnBackend calls it: prefix through kv_indices, the tree's K/V as the extend part, the
FULL custom mask) both match the dense reference on the same trees, GQA and MLA.  So the GPU
benchmark compares like with like, and our kernel agrees with the kernel SGLang verifies with."""
import json
import os
import subprocess
import sys

import pytest

from helpers import env_without_checkout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("sglang.kernels.ops.attention.extend_attention")


def test_smoke_matches_the_reference_and_sglangs_kernel(tmp_path):
    env = env_without_checkout(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "verify_attention.py"), "--smoke",
                        "--tune", "--out", str(tmp_path / "va")], cwd=str(tmp_path), env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    doc = json.loads((tmp_path / "va.json").read_text())
    assert doc["ok"] and {row["arch"] for row in doc["rows"]} == {"gqa", "mla"}
    for row in doc["rows"]:
        assert row["ours_vs_reference_max_abs"] < 1e-4, row          # fp32 inputs
        assert row["sglang_extend_vs_reference_max_abs"] < 1e-4, row
    assert (tmp_path / "va.md").read_text().startswith("# Tree-verify attention")
    # --tune: every launch override (split counts, tiles, warps, stages) gives the default's output
    assert {r["arch"] for r in doc["tune"]} == {"gqa", "mla"}
    for r in doc["tune"]:
        assert len(r["trials"]) >= 20
        for t in r["trials"]:
            assert "error" not in t and t["ok"] and t["max_abs"] < 1e-4, (r["arch"], t)
    assert "## Launch tuning" in (tmp_path / "va.md").read_text()


def test_launch_config_rejects_bad_overrides():
    from sglang_ddtree.kernels.tree_verify_attention import launch_config
    assert launch_config(16 * 4, 128, 128) == dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=None)
    assert launch_config(16 * 64, 512, 512) == dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    assert launch_config(64, 128, 128, dict(BLOCK_M=128, num_stages=2))["BLOCK_M"] == 128
    for bad in (dict(BLOCK_M=48), dict(BLOCK_N=8), dict(num_warps=3), dict(num_stages=0), dict(tile=1)):
        with pytest.raises(ValueError):
            launch_config(64, 128, 128, bad)


def test_occupancy_split_rule():
    """~2 programs per SM, never above the prefix bound's splits or the cap (H200 tuning: bs 32
    wants 1 split, bs 1 wants the most the prefix allows)."""
    from sglang_ddtree.kernels.tree_verify_attention import default_num_splits, occupancy_num_splits
    # GQA Qwen3-8B (G 4), N 16: M 64 -> 1 tile per kv head; 8 kv heads
    assert occupancy_num_splits(1, 64, 8, 32768, sms=132) == 32       # 8 programs -> capped at 32
    assert occupancy_num_splits(32, 64, 8, 32768, sms=132) == 2       # 256 programs -> ceil(264/256)
    assert occupancy_num_splits(64, 64, 8, 32768, sms=132) == 1
    # MLA K2 (64 heads), N 16: M 1024 -> 16 tiles (BLOCK_M 64)
    assert occupancy_num_splits(1, 1024, 1, 32768, block_d1=512, block_dv=512, sms=132) == 17
    assert occupancy_num_splits(32, 1024, 1, 4096, block_d1=512, block_dv=512, sms=132) == 1
    # short prefixes keep chunks >= 256 tokens; the cap wins
    assert occupancy_num_splits(1, 64, 8, 600, sms=132) == default_num_splits(600) == 3
    assert occupancy_num_splits(1, 64, 8, 32768, sms=132, cap=7) == 7


def test_target_verdict_names_what_a_missed_cell_is_short_of():
    """Issue 13's target per cell: <= 1.3x the floor from a 4k prefix up, faster than each baseline
    that ran; a miss names the bound and the achieved share of it, or the baseline it did not beat."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import verify_attention as VA
    finally:
        sys.path.pop(0)
    doc = {"copy_gbs": 4000.0, "matmul_tflops": 600.0}
    base = dict(arch="gqa", bs=1, N=16, prefix=4096, floor_bytes=4e6, flops=6e8,
                ours_speedup_vs_sglang_extend=3.0, ours_speedup_vs_flashinfer=1.5)
    # floor 1 us (bytes / bandwidth); 1.2 us is within 1.3x
    assert VA.target_verdict(doc, dict(base, ours_us=1.2, floor_us=1.0, ours_x_floor=1.2, bound="memory")) == (True, "")
    ok, why = VA.target_verdict(doc, dict(base, ours_us=2.0, floor_us=1.0, ours_x_floor=2.0, bound="memory"))
    assert not ok and why == "2.00x the memory floor (50 % of the bandwidth)"
    # near the ridge (compute floor >= half the memory floor) both shares are named
    ok, why = VA.target_verdict(doc, dict(base, flops=2.4e9, ours_us=8.0, floor_us=1.0, ours_x_floor=8.0,
                                          bound="memory", bytes_floor_us=1.0, flop_floor_us=0.8))
    assert not ok and why == ("8.00x the memory floor (12 % of the bandwidth; 50 % of the matmul rate, "
                              "the compute floor 0.80x the memory floor)")
    ok, why = VA.target_verdict(doc, dict(base, ours_us=4.0, floor_us=1.0, ours_x_floor=4.0, bound="compute"))
    assert not ok and why == "4.00x the compute floor (25 % of the matmul rate)"
    # short prefixes are held only to the baselines; a baseline that ran and was not beaten is a miss
    short = dict(base, prefix=1024, ours_us=5.0, floor_us=1.0, ours_x_floor=5.0, bound="memory")
    assert VA.target_verdict(doc, short) == (True, "")
    ok, why = VA.target_verdict(doc, dict(short, ours_speedup_vs_flashinfer=0.8))
    assert not ok and why == "not faster than flashinfer (0.80x)"
    assert VA.target_verdict(doc, dict(base, ours_us=None)) == (None, "not timed")
    # the rendered section counts them and lists the grid cells the file lacks
    rows = [dict(base, ours_us=1.2, floor_us=1.0, ours_x_floor=1.2, bound="memory"),
            dict(base, N=64, ours_us=2.0, floor_us=1.0, ours_x_floor=2.0, bound="memory")]
    md = "\n".join(VA.render_target_md(dict(doc, rows=rows)))
    assert "Met in 1 of 2 measured cells." in md and "| gqa | 1 | 4096 | 64 | 2.00x the memory floor" in md
    assert "(34): gqa bs1 P4096 N32, " in md and "gqa bs1 P4096 N16," not in md


def test_merge_keeps_each_rows_own_run_and_reports_the_grid(tmp_path):
    """--merge: the grid measured in parts becomes one report; a cell measured twice keeps the later
    run's row; each row's achieved shares use its own run's copy bandwidth / matmul rate; parts of
    another card or timing mode are refused with a clear error."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import verify_attention as VA
    finally:
        sys.path.pop(0)
    with open(os.path.join(REPO, "bench", "results", "verify_attention_h200.json")) as f:
        doc = json.load(f)
    # single runs made from the committed file (itself merged: its parts and per-row peaks dropped)
    doc = dict({k: v for k, v in doc.items() if k not in ("parts", "replaced")},
               rows=[{k: v for k, v in r.items() if k not in ("copy_gbs", "matmul_tflops")} for r in doc["rows"]],
               copy_gbs=doc["rows"][0].get("copy_gbs") or doc["copy_gbs"],
               matmul_tflops=doc["rows"][0].get("matmul_tflops") or doc["matmul_tflops"])
    gqa = dict(doc, rows=[r for r in doc["rows"] if r["arch"] == "gqa"], tune=[])
    mla = dict(doc, rows=[r for r in doc["rows"] if r["arch"] == "mla"][:-1], tune=[],   # one cell left out
               copy_gbs=doc["copy_gbs"] / 2, matmul_tflops=doc["matmul_tflops"] / 2,
               env=dict(doc["env"], git_commit="abc1234"))
    again = dict(gqa, rows=[dict(gqa["rows"][0], ours_us=gqa["rows"][0]["ours_us"] * 2)],
                 env=dict(doc["env"], git_commit="def5678"))
    paths = []
    for name, d in (("a", gqa), ("b", mla), ("c", again)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
        paths.append(str(tmp_path / f"{name}.json"))
    out = str(tmp_path / "m")
    assert VA.main(["--merge", out] + paths) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert len(m["rows"]) == len(doc["rows"]) - 1 and [p["rows"] for p in m["parts"]] == [len(gqa["rows"]), len(mla["rows"]), 1]
    first = gqa["rows"][0]
    kept = next(r for r in m["rows"] if VA.cell_key(r) == VA.cell_key(first))
    assert kept["ours_us"] == first["ours_us"] * 2 and len(m["replaced"]) == 1
    r_mla = next(r for r in m["rows"] if r["arch"] == "mla")
    bw, fl = VA.achieved_pct(m, r_mla)
    assert fl == pytest.approx(100 * r_mla["flops"] / (r_mla["ours_us"] * 1e-6) / (mla["matmul_tflops"] * 1e12))
    md = (tmp_path / "m.md").read_text()
    assert "Merged from 3 runs" in md and "abc1234" in md and "Measured again" in md
    missing = 72 - len(m["rows"])
    assert f"Cells of the issue's grid not in this file ({missing}):" in md and missing >= 1
    # merging a merged file keeps every part
    assert VA.main(["--merge", str(tmp_path / "m2"), out + ".json"]) == 0
    assert len(json.loads((tmp_path / "m2.json").read_text())["parts"]) == 3
    other = dict(mla, env=dict(mla["env"], gpu=["NVIDIA B200, 183359 MiB"]))
    (tmp_path / "o.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit):
        VA.main(["--merge", str(tmp_path / "x"), paths[0], str(tmp_path / "o.json")])
    assert not (tmp_path / "x.json").exists()
