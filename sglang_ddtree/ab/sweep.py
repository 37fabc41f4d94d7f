"""The kernel sweep: GPU ``build_tree`` against the CPU heap on the same inputs, in a subprocess (no
server), with bench/tree_kernels.py's input maker and timers (a checkout file)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import List

from . import checkout
from .servers import log_tail

SWEEP_BS = (1, 4, 16, 64, 256)
SWEEP_BUDGETS = (8, 16, 32, 64)
SWEEP_DEPTHS = (15, 7)


# ------------------------------------------------------------------------------------------ kernel sweep
def kernel_sweep_child(jsonl_path: str, bss, budgets, depths, seed: int = 0, tk=None) -> int:
    """Runs in its own process: GPU tree build vs the CPU heap, one JSON line per case.  ``tk``:
    bench/tree_kernels.py (its input maker and timers; injected by the tests)."""
    try:
        import torch
    except ImportError:
        print("kernel sweep skipped: torch is not importable", flush=True)
        return 2
    if tk is None and not torch.cuda.is_available():
        print("kernel sweep skipped: no CUDA device (the GPU tree build needs one)", flush=True)
        with open(jsonl_path, "a") as f:
            f.write(json.dumps({"skipped": "no CUDA device"}) + "\n")
        return 0
    if tk is None:
        import importlib.util
        try:
            tk_path = checkout.path("bench", "tree_kernels.py", what="the kernel sweep (--kernel-sweep)")
        except checkout.CheckoutMissing as e:
            print(f"kernel sweep skipped: {e}", flush=True)
            with open(jsonl_path, "a") as f:
                f.write(json.dumps({"skipped": str(e)}) + "\n")
            return 0
        spec = importlib.util.spec_from_file_location("tree_kernels", tk_path)
        tk = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tk)  # puts the checkout and tests/ on sys.path: fine, SGLang is never imported here
    from sglang_ddtree import ddtree
    import triton
    gen = torch.Generator().manual_seed(seed)
    with open(jsonl_path, "a") as f:
        f.write(json.dumps({"info": dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                         torch=torch.__version__, triton=triton.__version__)}) + "\n")
    for D in depths:
        for bs in bss:
            for budget in budgets:
                t0 = time.time()
                (lp, ids, roots), = tk.make_inputs(bs, D, budget, 1, gen)
                out = ddtree.build_tree(lp, ids, budget, root_tokens=roots, validate=False)
                ref = ddtree.build_tree(lp, ids, budget, root_tokens=roots, backend="reference", validate=False)
                exact = all(torch.equal(getattr(out, k).cpu(), getattr(ref, k).cpu())
                            for k in ("tokens", "depth", "parent", "num_nodes", "visibility"))
                gpu_med, gpu_min, gpu_max = tk.graph_time_us(
                    [lambda: ddtree.build_tree(lp, ids, budget, root_tokens=roots, validate=False, out=out)] * tk.REPS)
                reps = 3 if bs * budget >= 8192 else 10
                cpu_med = tk.cpu_time_us(lambda: ddtree.build_tree(lp, ids, budget, root_tokens=roots,
                                                                   backend="reference", validate=False), reps)
                row = dict(bs=bs, budget=budget, D=D, k=min(budget, 32000), V=32000, gpu_us=round(gpu_med, 3),
                           gpu_min_us=round(gpu_min, 3), cpu_heap_us=round(cpu_med, 2),
                           speedup=round(cpu_med / gpu_med, 2), exact=bool(exact), case_s=round(time.time() - t0, 2))
                with open(jsonl_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"sweep D={D:2d} bs={bs:3d} budget={budget:2d}: gpu {gpu_med:8.2f} us  cpu heap "
                      f"{cpu_med:10.1f} us  x{cpu_med / gpu_med:7.1f}  exact={exact}", flush=True)
    return 0


def child_command(python: str, *argv: str) -> List[str]:
    """``python`` running this package's CLI with ``argv``: the folder this package was imported from
    goes first on the child's sys.path, so the child runs this very code (installed or not)."""
    import sglang_ddtree
    parent = os.path.dirname(os.path.dirname(os.path.abspath(sglang_ddtree.__file__)))
    code = ("import sys; sys.path.insert(0, %r); from sglang_ddtree.ab.cli import main; "
            "sys.exit(main(sys.argv[1:]))" % parent)
    return [python, "-c", code, *argv]


def run_kernel_sweep(python: str, limit_s: float, tmpdir: str) -> dict:
    path = os.path.join(tmpdir, "kernel_sweep.jsonl")
    cmd = child_command(python, "--kernel-sweep-child", path)
    env = dict(os.environ)
    if checkout.root() and not env.get(checkout.ENV):  # the child finds bench/tree_kernels.py where we do
        env[checkout.ENV] = checkout.root()
    t0 = time.time()
    log = os.path.join(tmpdir, "kernel_sweep.log")
    with open(log, "wb") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = p.wait(max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "deadline"
    rows, info, skipped = [], None, None
    for line in open(path) if os.path.isfile(path) else []:
        d = json.loads(line)
        if "info" in d:
            info = d["info"]
        elif "skipped" in d:
            skipped = d["skipped"]
        else:
            rows.append(d)
    res = dict(status="ok" if rc == 0 and not skipped else ("skipped" if skipped else f"incomplete (rc={rc})"),
               seconds=round(time.time() - t0, 1), info=info, rows=rows,
               method="bench/tree_kernels.py make_inputs (drafter-like bf16 logits, V 32000, top-k = budget) + "
                      "graph_time_us (CUDA-graph replay of 10 calls, median per call) for the GPU build_tree "
                      "(tree + mask); cpu_time_us (wall clock median) for build_tree(backend='reference') on the "
                      "same CUDA inputs, device->host->device copies included")
    if skipped:
        res["note"] = skipped
    if rc not in (0,):
        res["log_tail"] = log_tail(log, 20)
    return res

