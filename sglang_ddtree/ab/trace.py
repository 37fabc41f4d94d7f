"""GPU traces of a serving level (``sglang-ddtree-ab --torch-profile C[:STEPS]``): SGLang's own
``/start_profile`` (torch.profiler, CUDA activities only) over STEPS scheduler steps while the level
runs, then a summary of the Chrome trace it writes, so two arms' rounds can be compared kernel by
kernel at the same load (issue 17: DDTREE-GPU's width-8 verify costs 1.29x DFLASH's per slot at
c=16 with the same attention kernel; the CUDA events cannot say whether the GPU is busier or idle).

``summarize_trace(path, steps)`` -> dict: the window (first kernel start to last kernel end), the GPU
busy time (union of kernel / memcpy / memset intervals) and idle time, both per step; kernel time
per category (attention, moe, gemm, ddtree, sampling, comm, copy, other) and per kernel name (top
``top``); the host calls that block (``cudaStreamSynchronize``, ``cudaEventSynchronize``,
``cudaDeviceSynchronize``, synchronous ``cudaMemcpy``) and graph launches, counts and time; the
longest GPU idle gaps with the kernels on either side; with ``:cpu`` the host's top-level torch ops
per step (``host_ops``).  Kernels replayed inside CUDA graphs are traced by CUPTI like any other
(their names are the captured kernels')."""
from __future__ import annotations

import gzip
import json
import os
import re
import threading
import time
from typing import Dict, List, Optional, Tuple

# first match wins; names are matched lower-cased
CATEGORIES: List[Tuple[str, str]] = [
    ("ddtree", r"_partial_kernel|_merge_kernel|tree_build|build_tree|topk_logprobs|_accept|tree_mask|"
               r"verify_mask|commit_path|ddtree"),
    ("attention", r"attention|attn|_fwd_kernel|flash|fmha|mla|prefill|decode_kernel|extend"),
    ("moe", r"moe|marlin|expert|topk_softmax|grouped_topk|noaux|align_block|fused_gate"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_|sm80_|wgmma|splitk"),
    ("sampling", r"sampl|argmax|softmax|top_?k|top_?p|renorm|multinomial|logsumexp"),
    ("comm", r"nccl|allreduce|all_reduce|all_gather|cross_device"),
    ("norm_act", r"norm|silu|gelu|act_and_mul|rotary|rope"),
    ("elementwise", r"elementwise|vectorized|unrolled|index|scatter|gather|copy|fill|cat|reduce"),
]
_CAT_RE = [(c, re.compile(p)) for c, p in CATEGORIES]
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str) -> str:
    n = name.lower()
    for c, r in _CAT_RE:
        if r.search(n):
            return c
    return "other"


def load_events(path: str) -> List[dict]:
    """The events of a Chrome trace (``.json`` or ``.json.gz``; a bare list or ``traceEvents``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc.get("traceEvents", doc) if isinstance(doc, dict) else doc


def _union(intervals: List[Tuple[float, float]]) -> Tuple[float, List[Tuple[float, float]]]:
    """Total covered length and the merged intervals (sorted)."""
    merged: List[List[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged), [(s, e) for s, e in merged]


def summarize_trace(path: str, steps: int, top: int = 25, gaps: int = 8) -> dict:
    """See the module docstring.  Times in ms; ``per_step`` values divide by ``steps``."""
    ev = [e for e in load_events(path) if isinstance(e, dict) and e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in GPU_CATS and "dur" in e]
    host = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    steps = max(1, int(steps))
    out: Dict[str, object] = dict(file=os.path.basename(path), steps=steps, gpu_events=len(gpu))
    if not gpu:
        out["error"] = "no GPU kernel events in the trace"
        return out
    iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    t0, t1 = min(s for s, _ in iv), max(e for _, e in iv)
    busy, merged = _union(iv)
    win = t1 - t0
    out.update(window_ms=round(win / 1e3, 3), busy_ms=round(busy / 1e3, 3), idle_ms=round((win - busy) / 1e3, 3),
               busy_fraction=round(busy / win, 4) if win > 0 else None)
    out["per_step"] = dict(window_ms=round(win / 1e3 / steps, 4), busy_ms=round(busy / 1e3 / steps, 4),
                           idle_ms=round((win - busy) / 1e3 / steps, 4))
    by_cat: Dict[str, float] = {}
    by_name: Dict[str, List[float]] = {}
    for e in gpu:
        name = str(e.get("name", "?"))
        d = float(e["dur"])
        cat = "copy" if e.get("cat") != "kernel" else category(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + d
        x = by_name.setdefault(name, [0.0, 0])
        x[0] += d
        x[1] += 1
    out["kernel_ms_per_step_by_category"] = {c: round(v / 1e3 / steps, 4)
                                             for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    out["top_kernels"] = [dict(name=n[:160], category=category(n), ms_per_step=round(v[0] / 1e3 / steps, 4),
                               calls_per_step=round(v[1] / steps, 2), us_per_call=round(v[0] / v[1], 2))
                          for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]
    hs: Dict[str, List[float]] = {}
    for e in host:
        n = str(e.get("name", ""))
        if n in SYNC_CALLS or "GraphLaunch" in n or n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync"):
            x = hs.setdefault(n, [0.0, 0])
            x[0] += float(e["dur"])
            x[1] += 1
    out["host_calls_per_step"] = {n: dict(calls=round(v[1] / steps, 2), ms=round(v[0] / 1e3 / steps, 4))
                                  for n, v in sorted(hs.items(), key=lambda kv: -kv[1][0])}
    ho = host_ops(ev, steps)
    if ho is not None:
        out["host_ops"] = ho
    # the longest idle gaps, with the kernels that end before and start after them
    starts = sorted(gpu, key=lambda e: float(e["ts"]))
    gap_list = []
    for (s0, e0), (s1, _) in zip(merged, merged[1:]):
        gap_list.append((s1 - e0, e0, s1))
    gap_list.sort(reverse=True)
    out["longest_gaps"] = []
    for g, e0, s1 in gap_list[:gaps]:
        before = max((e for e in gpu if float(e["ts"]) + float(e["dur"]) <= e0 + 1e-3),
                     key=lambda e: float(e["ts"]) + float(e["dur"]), default=None)
        after = next((e for e in starts if float(e["ts"]) >= s1 - 1e-3), None)
        out["longest_gaps"].append(dict(us=round(g, 1), after=str((before or {}).get("name", "?"))[:100],
                                        before=str((after or {}).get("name", "?"))[:100]))
    return out


def find_trace(trace_dir: str, since: float) -> Optional[str]:
    """The newest ``*.trace.json(.gz)`` in ``trace_dir`` written after ``since`` (time.time())."""
    if not os.path.isdir(trace_dir):
        return None
    files = [os.path.join(trace_dir, f) for f in os.listdir(trace_dir)
             if f.endswith(".trace.json.gz") or f.endswith(".trace.json")]
    files = [f for f in files if os.path.getmtime(f) >= since - 1]
    return max(files, key=os.path.getmtime) if files else None


def parse_spec(spec: Optional[str]) -> Optional[Tuple[int, int, bool]]:
    """``C[:STEPS][:cpu]`` (``C:cpu`` too) -> (concurrency, steps, cpu); STEPS defaults to 30; ``cpu`` also records
    the host's torch ops (CPU activity: the host time per step by op).  ValueError otherwise."""
    if spec in (None, ""):
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?(?::\s*(cpu)\s*)?", str(spec))
    if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
        raise ValueError(f"--torch-profile wants C, C:STEPS or C:STEPS:cpu (positive ints), got {spec!r}")
    return int(m.group(1)), int(m.group(2) or 30), m.group(3) is not None


def _top_level(ops: List[dict]) -> List[dict]:
    """The host ops not nested in another op of the same thread (their durations add up)."""
    out = []
    by_tid: Dict[object, List[dict]] = {}
    for e in ops:
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        end = float("-inf")
        for e in evs:
            if float(e["ts"]) >= end - 1e-3:
                out.append(e)
                end = float(e["ts"]) + float(e["dur"])
    return out


def host_ops(ev: List[dict], steps: int, top: int = 20) -> Optional[dict]:
    """Top-level ``cpu_op`` events (torch ops on the host) per step: count, ms, and the top names."""
    ops = [e for e in ev if e.get("cat") == "cpu_op" and "dur" in e]
    if not ops:
        return None
    tl = _top_level(ops)
    by: Dict[str, List[float]] = {}
    for e in tl:
        x = by.setdefault(str(e.get("name", "?")), [0.0, 0])
        x[0] += float(e["dur"])
        x[1] += 1
    return dict(ops_per_step=round(len(tl) / steps, 2), ms_per_step=round(sum(v[0] for v in by.values()) / 1e3 / steps, 4),
                top=[dict(name=n[:100], ms_per_step=round(v[0] / 1e3 / steps, 4), calls_per_step=round(v[1] / steps, 2))
                     for n, v in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]])


class LevelProfiler:
    """Starts SGLang's profiler ``delay_s`` into a level (the batch full by then) from a thread, for
    ``steps`` scheduler steps; ``finish()`` waits for the trace and summarizes it."""

    def __init__(self, base_url: str, trace_dir: str, steps: int, delay_s: float = 1.5, http=None,
                 cpu: bool = False):
        from .client import http_json
        self.base_url, self.trace_dir, self.steps, self.delay_s = base_url, trace_dir, steps, delay_s
        self.activities = ["CPU", "GPU"] if cpu else ["GPU"]
        self._http = http or http_json
        self.t_start = time.time()
        self.error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "LevelProfiler":
        os.makedirs(self.trace_dir, exist_ok=True)
        self._thread.start()
        return self

    def _run(self):
        time.sleep(self.delay_s)
        try:
            st, body = self._http(self.base_url, "POST", "/start_profile",
                                  dict(output_dir=self.trace_dir, num_steps=self.steps, activities=self.activities,
                                       with_stack=False, record_shapes=False), timeout=300)
            if st != 200:
                self.error = f"/start_profile answered {st}: {body[:200]!r}"
        except Exception as e:  # noqa: BLE001 - recorded in the level, the run goes on
            self.error = f"/start_profile failed: {e!r}"[:300]

    def finish(self, wait_s: float = 60.0) -> dict:
        """After the level: the summary of its trace (or ``error``).  A profile still running (the
        level ended before ``steps`` steps) is stopped with ``/stop_profile`` and marked
        ``stopped_early`` (its per-step figures then divide by a step count that is too high)."""
        self._thread.join(timeout=min(20.0, wait_s))
        early = False
        if self._thread.is_alive():
            early = True
            try:
                self._http(self.base_url, "POST", "/stop_profile", None, timeout=120)
            except Exception as e:  # noqa: BLE001
                self.error = f"/stop_profile failed: {e!r}"[:300]
            self._thread.join(timeout=wait_s)
        t_end = time.time() + wait_s
        path = None
        while time.time() < t_end:
            path = find_trace(self.trace_dir, self.t_start)
            if path and time.time() - os.path.getmtime(path) > 1.0:   # written completely
                break
            time.sleep(0.5)
        if self.error and not path:
            return dict(error=self.error, steps=self.steps)
        if not path:
            return dict(error="no trace file appeared (the level may have ended before the steps)",
                        steps=self.steps)
        try:
            s = summarize_trace(path, self.steps)
        except Exception as e:  # noqa: BLE001
            return dict(error=f"trace summary failed: {e!r}"[:300], steps=self.steps, file=path)
        s["path"] = path
        if early:
            s["stopped_early"] = True
        return s
