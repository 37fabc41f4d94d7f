"""Tree-verify attention speed (issue 13 item 4): ours vs the HBM floor, SGLang's triton extend path
with the tree mask and flashinfer's custom-mask prefill, same inputs, same run.

    python bench/verify_attention.py [--out bench/results/verify_attention_h200] [--quick]
    python bench/verify_attention.py --smoke --out /tmp/va      (CPU, TRITON_INTERPRET: harness check)

One attention layer per cell, at the shapes the issue names: GQA = Qwen3-8B heads (32 q / 8 kv x 128),
MLA = Kimi K2 absorbed (64 heads, latent 512 + rope 64, one latent KV head); bs 1 / 8 / 32 / 64 x
prefix 4k / 32k / 128k x N 16 / 32 / 64 (cells whose KV pool would exceed ``--max-pool-gb`` are
skipped and listed).  Inputs: random bf16 q / K / V, SGLang's paged layout with page size 1 and
shuffled slots (``req_to_token`` rows), trees from ``ddtree.build_tree`` on random drafter log-probs
(their ``mask_words``; the baselines get the same tree as SGLang's FULL mask, built by
``ddtree.verify_mask``).  Timing: the calls captured in a CUDA graph and replayed (as the server
runs the verify; ``--eager-timing``: ``triton.testing.do_bench`` on eager calls, which counts the
host launch overhead); when a cell's working set fits twice in L2 the calls rotate over 4 disjoint
slot sets.  Floor: the larger of the bytes each request's KV (prefix + tree) must be read once,
plus q and out, over the measured device-copy bandwidth, and the attention's FLOPs over the measured
bf16 matmul throughput.  Correctness: ours against SGLang's extend output of the same cell (max abs difference;
a cell whose difference exceeds the bf16 tolerance is marked, and the run says so).

Baselines (each in try/except: a failure is recorded, the run goes on):
  * ``sglang_extend``: ``sglang.kernels.ops.attention.extend_attention.extend_attention_fwd``, the
    call SGLang 0.5.16's TritonAttnBackend makes for TARGET_VERIFY (prefix through kv_indices, the
    tree's K/V as k_extend / v_extend, the FULL custom mask with mask_indptr); for MLA the same
    kernel on the latent cache (q = cat(q_nope_absorbed, q_rope), k = 576 dims, v = the 512 latent).
  * ``flashinfer``: ``BatchPrefillWithPagedKVCacheWrapper`` planned with ``custom_mask`` (GQA only:
    flashinfer's MLA wrappers take no mask).
Writes OUT.json (every number, GPU, versions, commit, date) and OUT.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sglang_ddtree import ddtree  # noqa: E402
from sglang_ddtree.ab.environment import env_info  # noqa: E402

GQA = dict(arch="gqa", Hq=32, Hkv=8, D=128, Dv=128)
MLA = dict(arch="mla", H=64, L=512, R=64)
L2_BYTES = 60 * 2**20
TOL = 3e-2   # bf16 outputs of two fp32-accumulating kernels


def _bench(fn, quick: bool):
    import triton.testing
    if not torch.cuda.is_available():
        fn()
        return None
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=50 if quick else 200,
                                   return_mode="median") * 1e3   # us


def _bench_graph(fns, quick: bool):
    """Median GPU time (us) of one call, the calls captured in a CUDA graph as the server replays
    the verify (``fns``: one per rotating slot set; ``sglang_ddtree.cuda_timing``).  No host launch
    overhead is counted, unlike eager timing of a small cell."""
    from sglang_ddtree.cuda_timing import graph_time_us
    return graph_time_us(fns, replays=20 if quick else 100)[0]


def matmul_tflops() -> float:
    """bf16 dense matmul throughput (TFLOP/s) on 8192^3: the compute floor's peak."""
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    us = _bench(lambda: x @ y, False)
    return 2 * 8192 ** 3 / (us * 1e-6) / 1e12


def attention_flops(arch, bs, N, prefix) -> int:
    """Multiply-adds x 2 of the cell's attention (every query against prefix + tree: scores + values)."""
    if arch["arch"] == "gqa":
        return 2 * bs * N * arch["Hq"] * (prefix + N) * (arch["D"] + arch["Dv"])
    return 2 * bs * N * arch["H"] * (prefix + N) * (arch["L"] + arch["R"] + arch["L"])


def copy_bandwidth_gbs() -> float:
    """Device copy bandwidth (GB/s, read + write counted) on a 2 GiB buffer."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = _bench(lambda: dst.copy_(src), False)
    return 2 * n / (us * 1e-6) / 1e9


def make_tree(bs, N, g, device):
    V = 4096
    logits = torch.randn(bs, 7, V, generator=g) * 2.0
    hot = torch.randint(0, V, (bs, 7, 4), generator=g)
    logits.scatter_(2, hot, 8.0)
    lp, ids = ddtree.topk_logprobs(logits.to(torch.bfloat16).to(device), min(N - 1, V),
                                   backend="triton" if device.type == "cuda" else "reference")
    return ddtree.build_tree(lp, ids, N - 1, backend="triton" if device.type == "cuda" else "reference")


def kv_bytes_per_token(arch) -> int:
    """bf16 bytes of one token's KV in one layer (the GPU cells' dtype)."""
    if arch["arch"] == "gqa":
        return arch["Hkv"] * (arch["D"] + arch["Dv"]) * 2
    return (arch["L"] + arch["R"]) * 2


def make_cell_size(arch, bs, N, prefix) -> int:
    """bytes of the KV the cell's requests read (prefix + tree), one slot set."""
    return bs * (prefix + N) * kv_bytes_per_token(arch)


def make_cell(arch, bs, N, prefix, rot, g, device, dtype=torch.bfloat16):
    """Inputs of one cell; ``rot`` disjoint slot sets (req_to_token rows rot*bs)."""
    tree = make_tree(bs, N, g, device)
    prefixes = [prefix] * bs
    L = prefix + N
    S = rot * bs * L
    perm = torch.randperm(S, generator=g).to(torch.int32)
    r2t = perm.view(rot * bs, L).to(device)
    plen = torch.tensor(prefixes, dtype=torch.int32, device=device)
    T = bs * N
    if arch["arch"] == "gqa":
        q = torch.randn(T, arch["Hq"], arch["D"], generator=g).to(dtype).to(device)
        k = torch.randn(S, arch["Hkv"], arch["D"], generator=g).to(dtype).to(device)
        v = torch.randn(S, arch["Hkv"], arch["Dv"], generator=g).to(dtype).to(device)
        kv = dict(q=q, k_cache=k, v_cache=v, sm_scale=1.0 / math.sqrt(arch["D"]))
        qo = T * arch["Hq"] * (arch["D"] + arch["Dv"]) * 2
    else:
        H, Lr, R = arch["H"], arch["L"], arch["R"]
        qn = torch.randn(T, H, Lr, generator=g).to(dtype).to(device)
        qr = torch.randn(T, H, R, generator=g).to(dtype).to(device)
        cache = torch.randn(S, 1, Lr + R, generator=g).to(dtype).to(device)
        kv = dict(q_nope_absorbed=qn, q_rope=qr, kv_cache=cache, sm_scale=1.0 / math.sqrt(128 + R))
        qo = T * H * (Lr + R + Lr) * 2
    return dict(tree=tree, r2t=r2t, plen=plen, max_prefix=prefix, kv=kv, S=S,
                floor_bytes=make_cell_size(arch, bs, N, prefix) + qo)


def attention(arch, cell, rpi, backend="triton"):
    """The cell's tree-verify attention through the public API (``max_prefix``: a host int, so
    the timed call never syncs)."""
    c = cell["kv"]
    common = dict(req_to_token=cell["r2t"], req_pool_indices=rpi, prefix_lens=cell["plen"],
                  mask_words=cell["tree"].mask_words, backend=backend, max_prefix=cell["max_prefix"])
    if arch["arch"] == "gqa":
        return ddtree.tree_verify_attention(c["q"], c["k_cache"], c["v_cache"], sm_scale=c["sm_scale"], **common)
    return ddtree.tree_verify_attention_mla(c["q_nope_absorbed"], c["q_rope"], c["kv_cache"],
                                            sm_scale=c["sm_scale"], kv_lora_rank=arch["L"], **common)


def _cycle(items):
    """A callable returning the next of items, round robin (rotating input sets)."""
    k = [0]

    def nxt():
        k[0] = (k[0] + 1) % len(items)
        return items[k[0]]
    return nxt


def _layout(cell, rpi):
    """SGLang's TARGET_VERIFY metadata for the triton backend and flashinfer: indptrs, the prefix /
    all slots per request, the FULL mask."""
    bs, N = cell["tree"].tokens.shape
    dev = cell["plen"].device
    rows = cell["r2t"][rpi.long()].long()                              # [bs, prefix + N]
    P = int(cell["plen"][0])
    prefix_slots = rows[:, :P].reshape(-1)
    tree_slots = rows[:, P:].reshape(-1)                               # [bs * N], request-major
    all_slots = rows.reshape(-1)
    ar = torch.arange(bs + 1, device=dev, dtype=torch.int32)
    if "full_mask" not in cell:   # the same for every slot set: built once per cell
        cell["full_mask"] = ddtree.verify_mask(cell["tree"], cell["plen"], mode="full")
    full = cell["full_mask"]
    return dict(bs=bs, N=N, P=P, prefix_slots=prefix_slots.to(torch.int32), tree_slots=tree_slots,
                all_slots=all_slots.to(torch.int32), qo_indptr=ar * N, kv_indptr=ar * P,
                all_indptr=ar * (P + N), mask=full, mask_indptr=(ar * (N * (P + N))).to(torch.int64))


def sglang_extend(arch, cell, rpi):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    m = _layout(cell, rpi)
    c = cell["kv"]
    if arch["arch"] == "gqa":
        q, kb, vb = c["q"], c["k_cache"], c["v_cache"]
    else:
        q = torch.cat([c["q_nope_absorbed"], c["q_rope"]], -1).contiguous()
        kb, vb = c["kv_cache"], c["kv_cache"][..., :arch["L"]]
    k_ext, v_ext = kb[m["tree_slots"]].contiguous(), vb[m["tree_slots"]].contiguous()
    o = torch.empty(q.shape[0], q.shape[1], vb.shape[-1], dtype=q.dtype, device=q.device)

    def run():
        extend_attention_fwd(q, k_ext, v_ext, o, kb, vb, m["qo_indptr"], m["kv_indptr"],
                             m["prefix_slots"], m["mask"], False, m["mask_indptr"], m["N"], 1.0, 1.0,
                             c["sm_scale"])
        return o
    return run


def flashinfer_prefill(arch, cell, rpi):
    if arch["arch"] != "gqa":
        raise NotImplementedError("flashinfer's MLA wrappers take no custom mask")
    import flashinfer

    m = _layout(cell, rpi)
    c = cell["kv"]
    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device=c["q"].device)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    last = torch.ones(m["bs"], dtype=torch.int32, device=c["q"].device)
    w.plan(m["qo_indptr"], m["all_indptr"], m["all_slots"], last, arch["Hq"], arch["Hkv"], arch["D"], 1,
           custom_mask=m["mask"], q_data_type=c["q"].dtype, kv_data_type=c["k_cache"].dtype,
           sm_scale=c["sm_scale"])
    kc, vc = c["k_cache"].unsqueeze(1), c["v_cache"].unsqueeze(1)   # [S, page 1, Hkv, D]
    return lambda: w.run(c["q"], (kc, vc))


def run_cell(arch, bs, N, prefix, g, device, quick, bw, tflops=None, graph=True):
    rot = 4 if 2 * make_cell_size(arch, bs, N, prefix) <= L2_BYTES else 1
    # the CPU harness check runs fp32: Triton 3.6's interpreter computes bf16 tl.dot wrongly
    cell = make_cell(arch, bs, N, prefix, rot, g, device,
                     torch.bfloat16 if device.type == "cuda" else torch.float32)
    sets = [torch.arange(r * bs, (r + 1) * bs, device=device) for r in range(rot)]
    next_rpi = _cycle(sets)
    row = dict(arch=arch["arch"], bs=bs, N=N, prefix=prefix, rotations=rot,
               floor_bytes=cell["floor_bytes"])
    mine = attention(arch, cell, sets[0])
    row["timing"] = "cuda graph" if graph and device.type == "cuda" else "eager"
    if row["timing"] == "cuda graph":
        row["ours_us"] = _bench_graph([lambda s=s: attention(arch, cell, s) for s in sets], quick)
    else:
        row["ours_us"] = _bench(lambda: attention(arch, cell, next_rpi()), quick)
    if device.type != "cuda":
        # the harness check: ours and SGLang's extend kernel (both under the interpreter) against
        # the dense reference on the same cell (flashinfer needs CUDA)
        want = attention(arch, cell, sets[0], backend="reference")
        row["ours_vs_reference_max_abs"] = float((mine.float() - want.float()).abs().max())
        try:
            got = sglang_extend(arch, cell, sets[0])()
            row["sglang_extend_vs_reference_max_abs"] = float((got.float() - want.float()).abs().max())
        except Exception as e:  # noqa: BLE001
            row["sglang_extend_error"] = f"{type(e).__name__}: {e}"[:300]
        row["ok"] = row["ours_vs_reference_max_abs"] <= TOL and \
            row.get("sglang_extend_vs_reference_max_abs", 1.0) <= TOL
        return row
    row["bytes_floor_us"] = cell["floor_bytes"] / (bw * 1e9) * 1e6
    row["flops"] = attention_flops(arch, bs, N, prefix)
    row["flop_floor_us"] = None if not tflops else row["flops"] / (tflops * 1e12) * 1e6
    row["floor_us"] = max(row["bytes_floor_us"], row["flop_floor_us"] or 0.0)
    row["bound"] = "compute" if (row["flop_floor_us"] or 0.0) > row["bytes_floor_us"] else "memory"
    row["ours_x_floor"] = row["ours_us"] / row["floor_us"]
    for name, make in (("sglang_extend", sglang_extend), ("flashinfer", flashinfer_prefill)):
        try:
            fns = [make(arch, cell, s) for s in sets]
            got = fns[0]()
            torch.cuda.synchronize()
            row[f"{name}_vs_ours_max_abs"] = float((got.float() - mine.float()).abs().max())
            next_fn = _cycle(fns)
            if row["timing"] == "cuda graph":
                try:
                    row[f"{name}_us"] = _bench_graph(fns, quick)
                except Exception as e:  # noqa: BLE001 - not capturable: timed eagerly, said so
                    row[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:200]
                    torch.cuda.synchronize()
                    row[f"{name}_us"] = _bench(lambda: next_fn()(), quick)
            else:
                row[f"{name}_us"] = _bench(lambda: next_fn()(), quick)
            row[f"ours_speedup_vs_{name}"] = row[f"{name}_us"] / row["ours_us"]
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    diff = row.get("sglang_extend_vs_ours_max_abs")
    row["ok"] = diff is not None and diff <= TOL
    del cell
    torch.cuda.empty_cache()
    return row


def render_md(doc) -> str:
    e = doc["env"]
    L = [f"# Tree-verify attention: ours vs the floor, SGLang's triton extend, flashinfer", "",
         f"Made by `bench/verify_attention.py` on {e.get('date')}, commit {e.get('git_commit')}, GPU "
         f"{e.get('gpu')}, versions {json.dumps(e.get('versions'))}; copy bandwidth "
         f"{doc.get('copy_gbs') and round(doc['copy_gbs'])} GB/s, bf16 matmul "
         f"{doc.get('matmul_tflops') and round(doc['matmul_tflops'])} TFLOP/s. One layer; GQA = Qwen3-8B heads "
         f"(32 q / 8 kv x 128), MLA = Kimi K2 absorbed (64 heads, latent 512 + rope 64). Times: medians, us, "
         f"timed {doc.get('timing', 'eager')} (graph: the calls captured and replayed as the server's verify "
         f"is; no host launch overhead). Floor: max(bytes / copy bandwidth, FLOPs / matmul throughput); "
         f"bound says which.", "",
         "| arch | bs | prefix | N | ours | floor | bound | ours / floor | SGLang extend | x | flashinfer | x | ok |",
         "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]

    def f(v, nd=1):
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))
    for r in doc["rows"]:
        L.append(f"| {r['arch']} | {r['bs']} | {r['prefix']} | {r['N']} | {f(r.get('ours_us'))} | "
                 f"{f(r.get('floor_us'))} | {r.get('bound', '-')} | {f(r.get('ours_x_floor'), 2)} | "
                 f"{f(r.get('sglang_extend_us')) if 'sglang_extend_error' not in r else 'error'} | "
                 f"{f(r.get('ours_speedup_vs_sglang_extend'), 2)} | "
                 f"{f(r.get('flashinfer_us')) if 'flashinfer_error' not in r else 'n/a'} | "
                 f"{f(r.get('ours_speedup_vs_flashinfer'), 2)} | {'yes' if r.get('ok') else 'NO'} |")
    if doc.get("skipped"):
        L += ["", "Skipped (KV pool over the limit): " + ", ".join(doc["skipped"])]
    errs = sorted({r[k] for r in doc["rows"] for k in r if k.endswith("_error")})
    if errs:
        L += ["", "Baseline errors: " + "; ".join(errs)]
    ge = sorted({f"{k[:-len('_graph_error')]}: {r[k]}" for r in doc["rows"] for k in r if k.endswith("_graph_error")})
    if ge:
        L += ["", "Timed eagerly (not capturable in a CUDA graph): " + "; ".join(ge)]
    L += ["", f"All outputs within {TOL} of the baseline / reference: {'yes' if doc['ok'] else 'NO'}"]
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "verify_attention_h200"))
    ap.add_argument("--quick", action="store_true", help="fewer cells and repetitions")
    ap.add_argument("--smoke", action="store_true", help="tiny cells (the CPU harness check)")
    ap.add_argument("--archs", default="gqa,mla")
    ap.add_argument("--max-pool-gb", type=float, default=48.0)
    ap.add_argument("--eager-timing", action="store_true",
                    help="time eager calls (host launch overhead included) instead of CUDA-graph replays")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.smoke:
        grid = [(1, 5, 40), (2, 9, 70)]
        archs = [dict(GQA, Hq=4, Hkv=2, D=32, Dv=32), dict(MLA, H=4, L=64, R=16)]
    else:
        bss, prefixes, Ns = ((1, 32), (4096, 32768), (16, 64)) if a.quick else \
            ((1, 8, 32, 64), (4096, 32768, 131072), (16, 32, 64))
        grid = [(bs, N, p) for bs in bss for p in prefixes for N in Ns]
        archs = [x for x in (GQA, MLA) if x["arch"] in a.archs.split(",")]
    if device.type != "cuda" and not a.smoke:
        sys.exit("no CUDA device: only --smoke runs on the CPU")
    bw = copy_bandwidth_gbs() if device.type == "cuda" else None
    tflops = matmul_tflops() if device.type == "cuda" else None
    graph = device.type == "cuda" and not a.eager_timing
    g = torch.Generator().manual_seed(0)
    rows, skipped = [], []
    for arch in archs:
        for bs, N, prefix in grid:
            if make_cell_size(arch, bs, N, prefix) * 1.0 > a.max_pool_gb * 1e9:
                skipped.append(f"{arch['arch']} bs{bs} P{prefix} N{N}")
                continue
            row = run_cell(arch, bs, N, prefix, g, device, a.quick, bw, tflops, graph)
            print(json.dumps(row), flush=True)
            rows.append(row)
    doc = dict(kind="verify_attention", env=env_info(sys.executable), copy_gbs=bw, matmul_tflops=tflops,
               timing="cuda graph" if graph else "eager", rows=rows,
               skipped=skipped, ok=all(r.get("ok") for r in rows), tolerance=TOL)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(render_md(doc))
    print(f"wrote {a.out}.json, {a.out}.md; all ok: {doc['ok']}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
