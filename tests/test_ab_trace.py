"""sglang_ddtree.ab.trace: the GPU-trace summary of --torch-profile, against a brute-force count on
random traces drawn fresh each run, and the format torch.profiler really exports."""
import gzip
import json
import os
import random

import pytest

from sglang_ddtree.ab import trace as T


def _random_trace(rng, n):
    ev, t = [], 0.0
    for _ in range(n):
        t += rng.choice([0.0, rng.uniform(0, 30)])
        dur = float(rng.randint(1, 40))
        start = float(int(t)) - rng.choice([0, 0, 5])         # some overlap (two streams)
        ev.append(dict(ph="X", cat=rng.choice(["kernel", "kernel", "gpu_memcpy"]),
                       name=rng.choice(["_fwd_kernel_extend", "fused_moe_marlin", "nvjet_gemm", "x_other",
                                        "_partial_kernel"]), ts=max(0.0, start), dur=dur))
        t = max(0.0, start) + dur
    ev.append(dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=1.0, dur=7.0))
    ev.append(dict(ph="i", cat="kernel", name="instant", ts=3.0))      # not a span: ignored
    return ev


def test_summary_matches_a_brute_force_count(tmp_path):
    rng = random.Random(os.urandom(8))
    ev = _random_trace(rng, rng.randint(20, 80))
    p = tmp_path / "t.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    steps = rng.randint(1, 7)
    s = T.summarize_trace(str(p), steps)
    gpu = [e for e in ev if e["ph"] == "X" and e["cat"] != "cuda_runtime"]
    lo, hi = int(min(e["ts"] for e in gpu)), int(max(e["ts"] + e["dur"] for e in gpu))
    covered = sum(1 for x in range(lo, hi) if any(e["ts"] <= x < e["ts"] + e["dur"] for e in gpu))
    assert s["window_ms"] == pytest.approx((hi - lo) / 1e3, abs=1e-3)
    assert s["busy_ms"] == pytest.approx(covered / 1e3, abs=1e-3)          # integer-aligned intervals
    assert s["idle_ms"] == pytest.approx((hi - lo - covered) / 1e3, abs=1e-3)
    assert s["per_step"]["busy_ms"] == pytest.approx(covered / 1e3 / steps, abs=1e-4)
    total = sum(e["dur"] for e in gpu) / 1e3 / steps
    assert sum(s["kernel_ms_per_step_by_category"].values()) == pytest.approx(total, abs=1e-3)
    assert s["host_calls_per_step"]["cudaStreamSynchronize"]["calls"] == pytest.approx(1 / steps, abs=0.01)
    if s["longest_gaps"]:
        assert s["longest_gaps"][0]["us"] == pytest.approx(max(
            [b - a for (_, a), (b, _) in zip(T._union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])[1],
                                             T._union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])[1][1:])]), abs=0.1)


def test_categories():
    assert T.category("_partial_kernel") == "ddtree"
    assert T.category("_fwd_kernel_stage1") == "attention"
    assert T.category("void marlin_moe_wna16::Marlin<...>") == "moe"
    assert T.category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert T.category("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "comm"
    assert T.category("something_else") == "other"


def test_parse_spec():
    assert T.parse_spec(None) is None and T.parse_spec("") is None
    assert T.parse_spec("16") == (16, 30, False) and T.parse_spec("16:40") == (16, 40, False)
    assert T.parse_spec("16:40:cpu") == (16, 40, True) and T.parse_spec("16:cpu") == (16, 30, True)
    for bad in ("0", "16:0", "a", "1:2:3", "-4", "16:4:gpu", "cpu"):
        with pytest.raises(ValueError):
            T.parse_spec(bad)


def test_reads_what_torch_profiler_exports(tmp_path):
    """A real torch.profiler Chrome trace (CPU only here: no kernel events) loads; with no GPU
    events the summary says so instead of inventing numbers."""
    torch = pytest.importorskip("torch")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    p = tmp_path / "real.trace.json"
    prof.export_chrome_trace(str(p))
    assert T.find_trace(str(tmp_path), 0) == str(p)
    s = T.summarize_trace(str(p), 3)
    assert s["gpu_events"] == 0 and "no GPU kernel events" in s["error"]


def test_level_profiler_stops_a_profile_the_level_did_not_finish(tmp_path):
    """The level ended before num_steps steps: finish() sends /stop_profile, then summarizes the
    trace the stop wrote, marked stopped_early."""
    import threading
    stopped = threading.Event()
    calls = []

    def http(base, method, path, body=None, timeout=10):
        calls.append(path)
        if path == "/start_profile":
            stopped.wait(30)              # SGLang answers when the profile ends
            return 200, b"ok"
        with gzip.open(os.path.join(str(tmp_path), "x-TP-0.trace.json.gz"), "wt") as f:
            json.dump({"traceEvents": [dict(ph="X", cat="kernel", name="k", ts=0, dur=10)]}, f)
        os.utime(os.path.join(str(tmp_path), "x-TP-0.trace.json.gz"), (0, 0))   # "written a while ago"
        stopped.set()
        return 200, b"stopped"

    lp = T.LevelProfiler("http://x", str(tmp_path), steps=50, delay_s=0.0, http=http)
    lp.t_start = -10          # the utime above predates the run otherwise
    s = lp.start().finish(wait_s=5)
    assert calls == ["/start_profile", "/stop_profile"]
    assert s.get("stopped_early") and s["busy_ms"] == pytest.approx(0.01)


def test_host_ops_count_top_level_ops_only():
    """Nested ops (aten::to -> aten::_to_copy -> aten::copy_) count once, by the outermost."""
    ev = [dict(ph="X", cat="cpu_op", name="aten::to", ts=0, dur=10, pid=1, tid=1),
          dict(ph="X", cat="cpu_op", name="aten::_to_copy", ts=1, dur=8, pid=1, tid=1),
          dict(ph="X", cat="cpu_op", name="aten::copy_", ts=2, dur=5, pid=1, tid=1),
          dict(ph="X", cat="cpu_op", name="aten::add", ts=12, dur=4, pid=1, tid=1),
          dict(ph="X", cat="cpu_op", name="aten::to", ts=3, dur=2, pid=1, tid=2),   # another thread
          dict(ph="X", cat="kernel", name="k", ts=0, dur=1)]
    h = T.host_ops(ev, steps=2)
    assert h["ops_per_step"] == 1.5 and h["ms_per_step"] == pytest.approx(16 / 1e3 / 2)
    assert {o["name"]: o["calls_per_step"] for o in h["top"]} == {"aten::to": 1.0, "aten::add": 0.5}
    assert T.host_ops([dict(ph="X", cat="kernel", name="k", ts=0, dur=1)], 1) is None
