"""Memory and time of the sampled verify's accept (GPU): SGLang's DFlash path vs ours, same inputs.

    python bench/sampled_memory.py --out bench/results/sampled_memory_h200

old (what the worker ran before, SGLang 0.5.16's DFlash recipe): ``build_dflash_verify_target_probs``
(scaled logits + dense probs) -> ``tree_speculative_sampling_target_only`` with
``draft_probs = torch.zeros_like(target_probs)`` (a second dense fp32 [bs, N, V] tensor).
new: ``sampling.verify_target_probs`` (one dense fp32 output, chunked temporaries) ->
``ddtree.accept_sampled`` (our Triton kernel; no draft probs).
Peak memory is ``torch.cuda.max_memory_allocated`` above what was allocated before the call (the
logits and the tree), per configuration; time is the median of ``--iters`` calls after warm-up.
Configurations: bs 16 / 64, N 33 (budget 32), V 151,936 (Qwen3), top-k 40 and "top-p 0.9 only".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

import torch


def _tree(bs, N, D, V, dev):
    from sglang_ddtree import ddtree
    lp = torch.log_softmax(torch.randn(bs, D, N - 1, device=dev) * 2, -1).sort(-1, descending=True).values
    ids = torch.randint(0, V, (bs, D, N - 1), device=dev)
    return ddtree.build_tree(lp.contiguous(), ids, N - 1, root_tokens=torch.randint(0, V, (bs,), device=dev),
                             validate=False)


def old_path(tree, logits, info, bs, N, D, max_top_k):
    from sglang.srt.speculative.dflash_utils import (build_dflash_verify_target_probs,
                                                     tree_speculative_sampling_target_only)
    from sglang_ddtree import tree_ops
    dev = logits.device
    first_child, next_sibling = tree_ops.lcrs_links(tree.parent)
    retrive_index = torch.arange(bs * N, device=dev, dtype=torch.int64).view(bs, N)
    target_probs = build_dflash_verify_target_probs(next_token_logits=logits, sampling_info=info,
                                                    draft_token_num=N, bs=bs, max_top_k=max_top_k)
    predicts = torch.empty((bs * N,), dtype=torch.int32, device=dev)
    accept_index = torch.full((bs, D + 1), -1, dtype=torch.int32, device=dev)
    accept_num = torch.empty((bs,), dtype=torch.int32, device=dev)
    tree_speculative_sampling_target_only(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
        candidates=tree.tokens.contiguous(), retrive_index=retrive_index,
        retrive_next_token=first_child, retrive_next_sibling=next_sibling,
        uniform_samples=torch.rand((bs, N), dtype=torch.float32, device=dev),
        uniform_samples_for_final_sampling=torch.rand((bs,), dtype=torch.float32, device=dev),
        target_probs=target_probs, draft_probs=torch.zeros_like(target_probs),
        threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    return accept_num


def new_path(tree, logits, info, bs, N, D, max_top_k):
    from sglang_ddtree import ddtree, sampling
    probs = sampling.verify_target_probs(
        logits, temperatures=info.temperatures, top_ks=info.top_ks, top_ps=info.top_ps, min_ps=None,
        num_slots=N, need_top_k=info.need_top_k_sampling, need_top_p=info.need_top_p_sampling,
        need_min_p=False, max_top_k=max_top_k)
    u = torch.rand((bs, D + 1), dtype=torch.float32, device=logits.device)
    return ddtree.accept_sampled(tree, probs, u, validate=False).accept_len


def measure(fn, args, iters):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for _ in range(3):
        fn(*args)
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return dict(peak_mib=round(peak / 2 ** 20, 1), median_ms=round(1000 * statistics.median(ts), 3))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    V, N, D = 151936, 33, 15
    rows = []
    for bs in (16, 64):
        for label, top_k, top_p in (("top_k 40, T 0.8", 40, 1.0), ("top_p 0.9, T 0.8", 1 << 30, 0.9)):
            torch.manual_seed(0)
            tree = _tree(bs, N, D, V, dev)
            logits = torch.randn(bs * N, V, device=dev) * 3
            info = types.SimpleNamespace(
                temperatures=torch.full((bs, 1), 0.8, device=dev),
                top_ks=torch.full((bs,), top_k, dtype=torch.int32, device=dev),
                top_ps=torch.full((bs,), top_p, device=dev),
                need_top_k_sampling=top_k < V, need_top_p_sampling=top_p < 1.0)
            mk = min(top_k, V)
            row = dict(bs=bs, N=N, V=V, filters=label, dense_tensor_mib=round(bs * N * V * 4 / 2 ** 20, 1))
            for name, fn in (("old", old_path), ("new", new_path)):
                try:
                    row[name] = measure(fn, (tree, logits, info, bs, N, D, mk), a.iters)
                except Exception as e:  # noqa: BLE001
                    row[name] = dict(error=repr(e)[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
            del logits, tree
            torch.cuda.empty_cache()
    import platform
    import triton
    doc = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               commit=os.environ.get("DDTREE_COMMIT"), rows=rows)
    try:
        import sglang
        doc["sglang"] = sglang.__version__
    except Exception:  # noqa: BLE001
        pass
    json.dump(doc, open(a.out + ".json", "w"), indent=1)
    L = [f"# Sampled verify accept: peak memory and time, old (SGLang DFlash recipe) vs new", "",
         f"`bench/sampled_memory.py`, {doc['date']}, {doc['gpu']}, torch {doc['torch']}, triton {doc['triton']}, "
         f"SGLang {doc.get('sglang')}, commit {doc['commit']}. Peak = max allocated above the inputs (logits, tree); "
         f"median of {a.iters} calls.", "",
         "| bs | N | V | filters | one dense fp32 [bs*N, V] | old peak MiB | new peak MiB | old ms | new ms |",
         "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        o, n = r["old"], r["new"]
        L.append(f"| {r['bs']} | {r['N']} | {r['V']} | {r['filters']} | {r['dense_tensor_mib']} | "
                 f"{o.get('peak_mib', o.get('error'))} | {n.get('peak_mib', n.get('error'))} | "
                 f"{o.get('median_ms', '-')} | {n.get('median_ms', '-')} |")
    open(a.out + ".md", "w").write("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
