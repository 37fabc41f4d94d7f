"""Kernel microbenchmarks: GPU tree build / accept / top-k vs the CPU heap and torch baselines.

    python bench/tree_kernels.py [--out bench/results] [--quick]

Writes ``tree_kernels_<gpu>.json`` (every number, card, versions, commit, date) and ``.md``.
Method (shared/conventions/benchmarks.md): warm-up, median of many; GPU times of the
build/accept kernels are CUDA-graph replays of ``REPS`` back-to-back calls on rotating input
sets (time per call = replay / REPS); the CPU heap is the exact reference (numpy + heapq per
request, as published ports run it) on the same inputs, including its device->host copy.
top-k is timed with ``triton.testing.do_bench`` (median) against the HBM floor
(bytes read / measured device-copy bandwidth) and against torch (fp32 copy + topk +
logsumexp, what published ports run).  Inputs are drafter-like bf16 logits (ties occur).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from helpers import drafter_logits  # noqa: E402
from sglang_ddtree import ddtree  # noqa: E402
from sglang_ddtree.cuda_timing import graph_time_us  # noqa: E402,F401  (sglang_ddtree.ab.sweep: tk.graph_time_us)
from sglang_ddtree.kernels.topk_logprobs import topk_logprobs_torch  # noqa: E402

REPS = 10  # calls per captured graph


def env_info():
    import triton
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                text=True).stdout.strip() or os.environ.get("DDTREE_COMMIT", "unknown")
    except OSError:
        commit = os.environ.get("DDTREE_COMMIT", "unknown")
    return dict(gpu=torch.cuda.get_device_name(), sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), commit=os.environ.get("DDTREE_COMMIT", commit),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def copy_bandwidth():
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / statistics.median(ts)


def cpu_time_us(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


def make_inputs(bs, D, budget, n_sets, gen, V=32000):
    sets = []
    for _ in range(n_sets):
        logits = drafter_logits(bs, D, V, gen).cuda()
        lp, ids = ddtree.topk_logprobs(logits, min(budget, V), validate=False)
        roots = torch.randint(0, V, (bs,), generator=gen).cuda()
        sets.append((lp, ids, roots))
    return sets


def bench_build(bss, budgets, D, gen, quick):
    rows = []
    for budget in budgets:
        for bs in bss:
            sets = make_inputs(bs, D, budget, REPS, gen)
            outs = []
            for lp, ids, roots in sets:
                outs.append(ddtree.build_tree(lp, ids, budget, root_tokens=roots, validate=False))
            # exactness on these very inputs
            ref = ddtree.build_tree(sets[0][0].cpu(), sets[0][1].cpu(), budget,
                                    root_tokens=sets[0][2].cpu(), backend="reference")
            exact = all(torch.equal(getattr(outs[0], f).cpu(), getattr(ref, f)) for f in
                        ("tokens", "depth", "parent", "num_nodes", "visibility"))
            fns = [lambda s=s, o=o: ddtree.build_tree(s[0], s[1], budget, root_tokens=s[2],
                                                      validate=False, out=o)
                   for s, o in zip(sets, outs)]
            gpu_med, gpu_min, gpu_max = graph_time_us(fns)
            from sglang_ddtree.kernels.tree_build import build_tree_triton
            from sglang_ddtree.kernels.tree_mask import tree_mask_triton
            build_only = graph_time_us([lambda s=s, o=o: build_tree_triton(
                s[0], s[1], budget, s[2], out=(o.tokens, o.depth, o.parent, o.num_nodes))
                for s, o in zip(sets, outs)])[0]
            mask_only = graph_time_us([lambda o=o: tree_mask_triton(
                o.parent, D, out=(o.visibility, o.mask_words)) for o in outs])[0]
            lp, ids, roots = sets[0]
            reps = 3 if bs * budget >= 8192 else (5 if quick else 10)
            cpu_med = cpu_time_us(lambda: ddtree.build_tree(lp, ids, budget, root_tokens=roots,
                                                            backend="reference", validate=False), reps)
            rows.append(dict(op="build_tree", bs=bs, budget=budget, D=D, gpu_us=gpu_med, gpu_min_us=gpu_min,
                             gpu_max_us=gpu_max, build_kernel_us=build_only, mask_kernel_us=mask_only,
                             cpu_heap_us=cpu_med, speedup=cpu_med / gpu_med, exact=exact))
            print(f"build_tree bs={bs:4d} budget={budget:4d}: gpu {gpu_med:8.2f} us "
                  f"(build {build_only:.2f} + mask {mask_only:.2f})  cpu heap {cpu_med:10.1f} us"
                  f"  x{cpu_med / gpu_med:8.1f}  exact={exact}", flush=True)
    return rows


def bench_accept(bss, budgets, D, gen):
    rows = []
    for budget in budgets:
        for bs in bss:
            sets = make_inputs(bs, D, budget, REPS, gen)
            trees = [ddtree.build_tree(lp, ids, budget, root_tokens=r, validate=False) for lp, ids, r in sets]
            # targets that follow the drafter's top-1 chain (long accepted paths: the worst case)
            targets = []
            for t in trees:
                tgt = torch.randint(0, 32000, t.tokens.shape, generator=gen).cuda()
                first = (t.parent.unsqueeze(-1) == torch.arange(budget + 1, device="cuda")).int().argmax(1)
                child_tok = torch.gather(t.tokens, 1, first.long())
                tgt = torch.where(first > 0, child_tok, tgt)
                targets.append(tgt)
            outs = [ddtree.accept_greedy(t, g, validate=False) for t, g in zip(trees, targets)]
            ref = ddtree.accept_greedy(trees[0], targets[0], backend="reference")
            exact = torch.equal(outs[0].path.cpu(), ref.path.cpu()) and torch.equal(outs[0].bonus.cpu(), ref.bonus.cpu())
            fns = [lambda t=t, g=g, o=o: ddtree.accept_greedy(t, g, validate=False, out=o)
                   for t, g, o in zip(trees, targets, outs)]
            gpu_med, gpu_min, gpu_max = graph_time_us(fns)
            cpu_med = cpu_time_us(lambda: ddtree.accept_greedy(trees[0], targets[0], backend="reference",
                                                               validate=False), 5)
            mean_len = float(outs[0].accept_len.float().mean())
            rows.append(dict(op="accept_greedy", bs=bs, budget=budget, D=D, gpu_us=gpu_med, gpu_min_us=gpu_min,
                             gpu_max_us=gpu_max, cpu_ref_us=cpu_med, mean_accept_len=mean_len, exact=exact))
            print(f"accept bs={bs:4d} budget={budget:4d}: gpu {gpu_med:7.2f} us  cpu {cpu_med:9.1f} us "
                  f"mean accept {mean_len:.2f} exact={exact}", flush=True)
    return rows


def bench_topk(cases, bw, gen):
    import triton
    rows = []
    for bs, D, V, k in cases:
        n_sets = max(1, min(4, (256 << 20) // (bs * D * V * 2)))  # rotate when a set fits in L2
        sets = [drafter_logits(bs, D, V, gen).cuda() for _ in range(n_sets)]
        outs = [ddtree.topk_logprobs(x, k, validate=False) for x in sets]
        want = topk_logprobs_torch(sets[0], k)
        exact_ids = torch.equal(outs[0][1], want[1])
        max_err = float((outs[0][0] - want[0]).abs().max())
        it = [0]

        def ours():
            it[0] = (it[0] + 1) % n_sets
            ddtree.topk_logprobs(sets[it[0]], k, validate=False, out=outs[it[0]])

        def torch_port():
            it[0] = (it[0] + 1) % n_sets
            x = sets[it[0]].float()
            torch.logsumexp(x, -1)
            torch.topk(x, k, dim=-1)

        t_ours = triton.testing.do_bench(ours, warmup=50, rep=300, return_mode="median") * 1e3
        t_torch = triton.testing.do_bench(torch_port, warmup=50, rep=300, return_mode="median") * 1e3
        floor = bs * D * V * 2 / bw * 1e6
        rows.append(dict(op="topk_logprobs", bs=bs, D=D, V=V, k=k, gpu_us=t_ours, torch_us=t_torch,
                         floor_us=floor, vs_floor=t_ours / floor, speedup_vs_torch=t_torch / t_ours,
                         exact_ids=exact_ids, max_abs_err=max_err))
        print(f"topk bs={bs:3d} D={D} V={V:6d} k={k:3d}: ours {t_ours:8.1f} us  floor {floor:7.1f} us "
              f"(x{t_ours / floor:5.2f})  torch {t_torch:8.1f} us  ids_exact={exact_ids} err={max_err:.1e}",
              flush=True)
    return rows


def to_markdown(info, bw, build, accept, topk):
    L = [f"# Tree kernels on {info['gpu']}", "",
         f"{info['date']} · torch {info['torch']} · triton {info['triton']} · CUDA {info['cuda']} · "
         f"Python {info['python']} · commit {info['commit']} · copy bandwidth {bw / 1e12:.2f} TB/s "
         "(read + write)", "",
         "Produced by `python bench/tree_kernels.py`. GPU times: median CUDA-graph replay per call "
         f"({REPS} calls per graph, rotating inputs). CPU heap: the exact reference (numpy + heapq per "
         "request, incl. device->host copy), median. `exact`: GPU tree equals the reference node for node.", "",
         "## build_tree (D = 16, K = budget, drafter-like bf16 logits, V = 32000)", "",
         "| bs | budget | GPU (us) | build kernel | mask kernel | CPU heap (us) | speed-up | exact |",
         "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in build:
        L.append(f"| {r['bs']} | {r['budget']} | {r['gpu_us']:.2f} | {r['build_kernel_us']:.2f} | "
                 f"{r['mask_kernel_us']:.2f} | {r['cpu_heap_us']:.0f} | "
                 f"{r['speedup']:.0f}x | {'yes' if r['exact'] else 'NO'} |")
    L += ["", "## accept_greedy (targets follow the drafter's top-1 chain: long paths)", "",
          "| bs | budget | GPU (us) | CPU reference (us) | mean accept len | exact |",
          "|---:|---:|---:|---:|---:|:---:|"]
    for r in accept:
        L.append(f"| {r['bs']} | {r['budget']} | {r['gpu_us']:.2f} | {r['cpu_ref_us']:.0f} | "
                 f"{r['mean_accept_len']:.2f} | {'yes' if r['exact'] else 'NO'} |")
    L += ["", "## topk_logprobs (bf16 logits; floor = bytes read / copy bandwidth)", "",
          "| bs | D | V | k | ours (us) | floor (us) | ours / floor | torch fp32 topk+lse (us) | vs torch | ids exact |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in topk:
        L.append(f"| {r['bs']} | {r['D']} | {r['V']} | {r['k']} | {r['gpu_us']:.1f} | {r['floor_us']:.1f} | "
                 f"{r['vs_floor']:.2f} | {r['torch_us']:.1f} | {r['speedup_vs_torch']:.1f}x | "
                 f"{'yes' if r['exact_ids'] else 'NO'} |")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="fewer sizes (smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/tree_kernels.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(a.seed)
    info = env_info()
    bw = copy_bandwidth()
    print(info, f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    bss = [1, 8, 64, 256] if not a.quick else [1, 64]
    budgets = [8, 16, 32, 64, 128] if not a.quick else [32]
    build = bench_build(bss, budgets, 16, gen, a.quick)
    accept = bench_accept([1, 64, 256] if not a.quick else [64], [16, 64] if not a.quick else [64], 16, gen)
    topk_cases = [(64, 16, 32000, 32), (64, 16, 151936, 32), (64, 16, 163840, 32), (256, 16, 151936, 32),
                  (64, 16, 151936, 8), (64, 16, 151936, 64), (1, 16, 151936, 32), (8, 16, 151936, 32)]
    if a.quick:
        topk_cases = topk_cases[:2]
    topk = bench_topk(topk_cases, bw, gen)
    os.makedirs(a.out, exist_ok=True)
    tag = info["gpu"].split()[-1].lower()
    with open(os.path.join(a.out, f"tree_kernels_{tag}.json"), "w") as f:
        json.dump(dict(info=info, copy_bandwidth_Bps=bw, reps_per_graph=REPS, build_tree=build,
                       accept_greedy=accept, topk_logprobs=topk), f, indent=1)
    md = to_markdown(info, bw, build, accept, topk)
    with open(os.path.join(a.out, f"tree_kernels_{tag}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
