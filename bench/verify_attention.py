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
REPLAY_BUDGET_S = 1.5   # seconds of timed replays per measurement, at least 5 replays
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
    fns[0]()                                   # compile / first call outside the timing
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    st.record()
    fns[0]()
    en.record()
    en.synchronize()
    one_s = max(st.elapsed_time(en) * 1e-3, 1e-6)
    # a slow baseline (SGLang's extend at 128k: ~0.5 s a call) gets fewer replays (>= 5)
    replays = max(5, min(20 if quick else 100, int(REPLAY_BUDGET_S / one_s)))
    return graph_time_us(fns, replays=replays)[0]


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
    # the tensors are drawn where they live: on the GPU a 128k-token cell is ~17 G samples, which
    # the host's generator takes minutes to draw (the tree and the slot permutation stay on g)
    dg = g if device.type == "cpu" else \
        torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=g)))

    def randn(*shape):
        return torch.randn(*shape, generator=dg, device=device, dtype=dtype)
    if arch["arch"] == "gqa":
        q = randn(T, arch["Hq"], arch["D"])
        k = randn(S, arch["Hkv"], arch["D"])
        v = randn(S, arch["Hkv"], arch["Dv"])
        kv = dict(q=q, k_cache=k, v_cache=v, sm_scale=1.0 / math.sqrt(arch["D"]))
        qo = T * arch["Hq"] * (arch["D"] + arch["Dv"]) * 2
    else:
        H, Lr, R = arch["H"], arch["L"], arch["R"]
        qn = randn(T, H, Lr)
        qr = randn(T, H, R)
        cache = randn(S, 1, Lr + R)
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
    # int64 slot indices, as SGLang's triton backend passes them: the kernel's address math is
    # index x row stride, which overflows int32 once the pool holds 2^31 elements (GQA bs 32 / 128k)
    prefix_slots = m["prefix_slots"].long()
    o = torch.empty(q.shape[0], q.shape[1], vb.shape[-1], dtype=q.dtype, device=q.device)

    def run():
        extend_attention_fwd(q, k_ext, v_ext, o, kb, vb, m["qo_indptr"], m["kv_indptr"],
                             prefix_slots, m["mask"], False, m["mask_indptr"], m["N"], 1.0, 1.0,
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


# ------------------------------------------------------------------------------- launch tuning
TUNE_CELLS = {   # (bs, N, prefix): where the defaults miss the floor most (run 9, verify_attention_h200.md)
    "gqa": [(1, 16, 32768), (32, 16, 32768), (32, 64, 32768)],
    "mla": [(1, 16, 32768), (8, 16, 32768), (32, 16, 4096)],
}


def tune_configs(arch) -> list:
    """Launch overrides tried per tune cell: the split count alone, then tiles / warps / stages
    (each distinct set compiles once per arch: ~22 per arch keeps the tuning to a few minutes)."""
    cfgs = [dict(num_splits=n) for n in (1, 2, 4, 8, 16, 32)]
    if arch["arch"] == "gqa":
        tiles = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
                 for m in (64, 128) for n in (64, 128) for w in (4, 8) for st in (2, 3)]
    else:
        tiles = [dict(BLOCK_M=64, BLOCK_N=n, num_warps=w, num_stages=st)
                 for n in (16, 32, 64) for w in (4, 8) for st in (1, 2)]
        tiles += [dict(BLOCK_M=32, BLOCK_N=n, num_warps=4, num_stages=2) for n in (32, 64)]
    return cfgs + tiles


def _kernel_call(arch, cell, rpi, cfg):
    """The kernel module's entry with launch overrides (``num_splits`` and ``launch_config`` keys)."""
    from sglang_ddtree.kernels import tree_verify_attention as tva
    c = cell["kv"]
    cfg = dict(cfg)
    ns = cfg.pop("num_splits", None)
    common = dict(num_splits=ns, max_prefix=None if ns else cell["max_prefix"], config=cfg or None)
    args = (cell["r2t"], rpi, cell["plen"], cell["tree"].mask_words)
    if arch["arch"] == "gqa":
        return tva.tree_verify_attention(c["q"], c["k_cache"], c["v_cache"], *args, c["sm_scale"], **common)
    return tva.tree_verify_attention_mla(c["q_nope_absorbed"], c["q_rope"], c["kv_cache"], *args, c["sm_scale"],
                                         kv_lora_rank=arch["L"], **common)


def tune_cell(arch, bs, N, prefix, g, device, quick, deadline_at=None) -> dict:
    """Every tune config on one cell: graph-replay time, max |diff| vs the default launch, errors."""
    import time
    rot = 4 if 2 * make_cell_size(arch, bs, N, prefix) <= L2_BYTES else 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cell = make_cell(arch, bs, N, prefix, rot, g, device, dtype)
    sets = [torch.arange(r * bs, (r + 1) * bs, device=device) for r in range(rot)]
    want = attention(arch, cell, sets[0]).float()
    row = dict(arch=arch["arch"], bs=bs, N=N, prefix=prefix, rotations=rot, trials=[])
    if device.type == "cuda":
        row["default_us"] = _bench_graph([lambda s=s: attention(arch, cell, s) for s in sets], quick)
    for cfg in tune_configs(arch):
        if deadline_at is not None and time.time() > deadline_at:
            row["cut_at_deadline"] = True
            break
        t = dict(config=cfg)
        try:
            got = _kernel_call(arch, cell, sets[0], cfg)
            t["max_abs"] = float((got.float() - want).abs().max())
            t["ok"] = t["max_abs"] <= TOL
            if device.type == "cuda":
                t["us"] = _bench_graph([lambda s=s: _kernel_call(arch, cell, s, cfg) for s in sets], True)
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is recorded
            t["error"] = f"{type(e).__name__}: {e}"[:200]
            if device.type == "cuda":
                torch.cuda.synchronize()
        row["trials"].append(t)
    timed = [t for t in row["trials"] if t.get("ok") and t.get("us")]
    if timed:
        best = min(timed, key=lambda t: t["us"])
        row["best"] = best
        row["best_speedup"] = row["default_us"] / best["us"] if row.get("default_us") else None
    del cell
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def render_tune_md(rows) -> list:
    L = ["", "## Launch tuning (`--tune`): best override per cell vs the default launch", "",
         "| arch | bs | prefix | N | default us | best us | speedup | best config | configs ok / tried |",
         "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        b = r.get("best") or {}
        n_ok = sum(1 for t in r["trials"] if t.get("ok"))
        L.append(f"| {r['arch']} | {r['bs']} | {r['prefix']} | {r['N']} | {r.get('default_us') and round(r['default_us'], 1)} "
                 f"| {b.get('us') and round(b['us'], 1)} | {r.get('best_speedup') and round(r['best_speedup'], 2)} | "
                 f"`{json.dumps(b.get('config'))}` | {n_ok} / {len(r['trials'])}{' (cut)' if r.get('cut_at_deadline') else ''} |")
    return L


def achieved_pct(doc, r):
    """(bandwidth %, matmul %): the cell's bytes and FLOPs over our time, against the measured copy
    bandwidth and matmul throughput; None without a GPU time."""
    # a merged file's rows carry their own run's measured peaks (--merge)
    us, bw, tf = r.get("ours_us"), r.get("copy_gbs") or doc.get("copy_gbs"), r.get("matmul_tflops") or doc.get("matmul_tflops")
    if not us or not bw or not tf or not r.get("flops"):
        return None
    return (r["floor_bytes"] / (us * 1e-6) / (bw * 1e9) * 100, r["flops"] / (us * 1e-6) / (tf * 1e12) * 100)


def achieved(doc, r) -> str:
    """'B % / F %' of :func:`achieved_pct` ('-' without a GPU time)."""
    pct = achieved_pct(doc, r)
    return "-" if pct is None else f"{pct[0]:.0f} % / {pct[1]:.0f} %"


TARGET_X_FLOOR = 1.3          # issue 13: <= 1.3x the floor from 4k up, and faster than both baselines
TARGET_MIN_PREFIX = 4096
ISSUE_GRID = dict(bs=(1, 8, 32, 64), prefix=(4096, 32768, 131072), N=(16, 32, 64))   # issue 13 item 4; the full grid


def target_verdict(doc, r):
    """(met, reason) of one measured row against issue 13's target; reason names what a missed cell
    is short of, from its own measured numbers: the floor's bound and the achieved % of it."""
    x = r.get("ours_x_floor")
    if x is None or not r.get("ours_us"):
        return None, "not timed"
    why = []
    if r["prefix"] >= TARGET_MIN_PREFIX and x > TARGET_X_FLOOR:
        pct = achieved_pct(doc, r)
        memory = r.get("bound") == "memory"
        short = "?" if pct is None else f"{pct[0 if memory else 1]:.0f} %"
        what = "bandwidth" if memory else "matmul rate"
        # a memory-bound cell near the ridge (N 32 for GQA): the FLOPs alone would take over half the
        # memory floor, so the time can be short of the matmul rate rather than of the bandwidth
        fl, by = r.get("flop_floor_us"), r.get("bytes_floor_us")
        near = memory and pct is not None and fl and by and fl >= 0.5 * by
        also = f"; {pct[1]:.0f} % of the matmul rate, the compute floor {fl / by:.2f}x the memory floor" if near else ""
        why.append(f"{x:.2f}x the {r.get('bound', '?')} floor ({short} of the {what}{also})")
    for name, key in (("SGLang extend", "ours_speedup_vs_sglang_extend"), ("flashinfer", "ours_speedup_vs_flashinfer")):
        sp = r.get(key)
        if sp is not None and sp <= 1.0:
            why.append(f"not faster than {name} ({sp:.2f}x)")
    return not why, "; ".join(why)


def render_target_md(doc) -> list:
    rows = [r for r in doc["rows"] if r.get("ours_us")]
    verdicts = [(r, *target_verdict(doc, r)) for r in rows]
    met = [r for r, ok, _ in verdicts if ok]
    L = ["", f"## Issue 13's target: <= {TARGET_X_FLOOR}x the floor (prefix >= {TARGET_MIN_PREFIX}) and faster than "
             "SGLang's extend and flashinfer (where it runs)", "",
         f"Met in {len(met)} of {len(rows)} measured cells."]
    missed = [(r, why) for r, ok, why in verdicts if ok is False]
    if missed:
        L += ["", "| arch | bs | prefix | N | missed: why |", "|---|---:|---:|---:|---|"]
        L += [f"| {r['arch']} | {r['bs']} | {r['prefix']} | {r['N']} | {why} |" for r, why in missed]
    done = {cell_key(r) for r in doc["rows"]}
    archs = sorted({r["arch"] for r in doc["rows"]})
    todo = [cell_label(a, bs, p, n) for a in archs for bs in ISSUE_GRID["bs"] for p in ISSUE_GRID["prefix"]
            for n in ISSUE_GRID["N"] if (a, bs, p, n) not in done]
    if todo:
        L += ["", f"Cells of the issue's grid not in this file ({len(todo)}): " + ", ".join(todo)]
    return L


def cell_key(r) -> tuple:
    return (r["arch"], r["bs"], r["prefix"], r["N"])


def cell_label(arch: str, bs: int, prefix: int, N: int) -> str:
    """How the reports name a cell (cut / skipped / not-in-file lists)."""
    return f"{arch} bs{bs} P{prefix} N{N}"


def all_ok(rows, tune) -> bool:
    """Every row within tolerance and no tuning trial wrong."""
    return all(r.get("ok") for r in rows) and all(t.get("ok") is not False for r in tune for t in r["trials"])


def merge(paths) -> dict:
    """One report from several runs of this bench (the issue's grid measured in parts, e.g. by
    ``--archs`` / ``--bss``): rows in the order given, a cell measured twice keeps the later file's
    row (listed under ``replaced``); each row keeps its own run's copy bandwidth and matmul rate, so
    its floor and achieved shares stay those of the run that timed it.  Every part must be a GPU run
    of the same card and timing mode."""
    docs = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("kind") != "verify_attention":
            raise ValueError(f"{path}: not a bench/verify_attention.py result")
        docs.append((path, doc))
    if not docs:
        raise ValueError("--merge needs at least one JSON")
    timings = {d.get("timing") for _, d in docs}
    if len(timings) > 1:
        raise ValueError(f"parts differ in timing: {sorted(map(str, timings))}")
    gpus = {json.dumps(d["env"].get("gpu")) for _, d in docs}
    if len(gpus) > 1:
        raise ValueError(f"parts ran on different GPUs: {sorted(map(str, gpus))}")
    rows, where, replaced = {}, {}, []
    for path, d in docs:
        for r in d["rows"]:
            k = cell_key(r)
            if k in rows:
                replaced.append(f"{cell_label(*k)}: {os.path.basename(where[k])} -> "
                                f"{os.path.basename(path)}")
            rows[k] = dict(r, copy_gbs=r.get("copy_gbs") or d.get("copy_gbs"),
                           matmul_tflops=r.get("matmul_tflops") or d.get("matmul_tflops"))
            where[k] = path
    have = {cell_label(*k) for k in rows}
    last = docs[-1][1]
    out = dict(kind="verify_attention", env=last["env"],
               copy_gbs=last.get("copy_gbs"), matmul_tflops=last.get("matmul_tflops"),
               timing=last.get("timing"), rows=list(rows.values()),
               tune=[t for _, d in docs for t in d.get("tune", [])],
               cut=sorted({c for _, d in docs for c in d.get("cut", [])} - have),
               skipped=sorted({c for _, d in docs for c in d.get("skipped", [])} - have),
               tolerance=last.get("tolerance"),
               # a merged part brings its own parts (merging is associative)
               parts=[q for p, d in docs for q in (d.get("parts") or [
                   dict(file=os.path.basename(p), date=d["env"].get("date"), commit=d["env"].get("git_commit"),
                        copy_gbs=d.get("copy_gbs"), matmul_tflops=d.get("matmul_tflops"), rows=len(d["rows"]))])],
               replaced=[x for _, d in docs for x in d.get("replaced", [])] + replaced)
    out["ok"] = all_ok(out["rows"], out["tune"])
    return out


def save(doc, out) -> None:
    """``out.json`` and its markdown ``out.md``."""
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(render_md(doc))


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
         "achieved: ours' bytes (prefix + tree KV, q, out) / time as a % of the copy bandwidth, and its FLOPs / "
         "time as a % of the matmul throughput: which of the two a cell that misses the floor is short of.", "",
         "| arch | bs | prefix | N | ours | floor | bound | ours / floor | achieved BW / FLOPs | SGLang extend | x | "
         "flashinfer | x | ok |",
         "|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---|"]
    if doc.get("parts"):
        L[2:2] = [f"Merged from {len(doc['parts'])} runs (`--merge`; each row's floor and achieved shares use "
                  "its own run's copy bandwidth and matmul rate; the header's are the last run's): "
                  + "; ".join(f"{p['file']} ({p['date']}, commit {p['commit']}, {p['rows']} cells, "
                              f"{p['copy_gbs'] and round(p['copy_gbs'])} GB/s, "
                              f"{p['matmul_tflops'] and round(p['matmul_tflops'])} TFLOP/s)" for p in doc["parts"])
                  + "." + (" Measured again, the later run's row kept: " + "; ".join(doc["replaced"]) + "."
                           if doc.get("replaced") else ""), ""]

    def f(v, nd=1):
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))
    for r in doc["rows"]:
        L.append(f"| {r['arch']} | {r['bs']} | {r['prefix']} | {r['N']} | {f(r.get('ours_us'))} | "
                 f"{f(r.get('floor_us'))} | {r.get('bound', '-')} | {f(r.get('ours_x_floor'), 2)} | "
                 f"{achieved(doc, r)} | "
                 f"{f(r.get('sglang_extend_us')) if 'sglang_extend_error' not in r else 'error'} | "
                 f"{f(r.get('ours_speedup_vs_sglang_extend'), 2)} | "
                 f"{f(r.get('flashinfer_us')) if 'flashinfer_error' not in r else 'n/a'} | "
                 f"{f(r.get('ours_speedup_vs_flashinfer'), 2)} | {'yes' if r.get('ok') else 'NO'} |")
    if doc.get("skipped"):
        L += ["", "Skipped (KV pool over the limit): " + ", ".join(doc["skipped"])]
    if doc.get("cut"):
        L += ["", "Not run (the --deadline passed first): " + ", ".join(doc["cut"])]
    failed = [f"{cell_label(*cell_key(r))}: {r['error']}" for r in doc["rows"] if r.get("error")]
    if failed:
        L += ["", "Cells that failed (no time): " + "; ".join(failed)]
    errs = sorted({r[k] for r in doc["rows"] for k in r if k.endswith("_error")})
    if errs:
        L += ["", "Baseline errors: " + "; ".join(errs)]
    ge = sorted({f"{k[:-len('_graph_error')]}: {r[k]}" for r in doc["rows"] for k in r if k.endswith("_graph_error")})
    if ge:
        L += ["", "Timed eagerly (not capturable in a CUDA graph): " + "; ".join(ge)]
    L += ["", f"All outputs within {TOL} of the baseline / reference: {'yes' if doc['ok'] else 'NO'}"]
    L += render_target_md(doc)
    if doc.get("tune"):
        L += render_tune_md(doc["tune"])
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
    ap.add_argument("--render", metavar="JSON", help="rewrite JSON's markdown from it (nothing is measured)")
    ap.add_argument("--tune", action="store_true",
                    help="also try launch overrides (split count, tiles, warps, stages) on the TUNE_CELLS")
    ap.add_argument("--tune-only", action="store_true", help="only the tuning part (no grid)")
    ap.add_argument("--prefixes", default=None, help="comma list overriding the grid's prefixes")
    ap.add_argument("--bss", default=None, help="comma list overriding the grid's batch sizes")
    ap.add_argument("--merge", nargs="+", metavar=("OUT", "JSON"),
                    help="OUT a.json b.json ...: one report (OUT.json / OUT.md) from runs of parts of the grid")
    ap.add_argument("--skip-done", metavar="JSON", action="append", default=[],
                    help="cells timed in this earlier run's JSON are not run again (a grid resumed "
                         "after a cut or a crash; --merge the parts after)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds: cells not started by then are listed as cut, and the files still written")
    a = ap.parse_args(argv)
    if a.merge:
        if len(a.merge) < 2:
            ap.error("--merge OUT a.json [b.json ...]")
        try:
            doc = merge(a.merge[1:])
        except (ValueError, OSError, KeyError) as e:
            ap.error(f"--merge: {e}")
        out = a.merge[0][:-5] if a.merge[0].endswith(".json") else a.merge[0]
        save(doc, out)
        print(f"wrote {out}.json, {out}.md ({len(doc['rows'])} cells from {len(doc['parts'])} runs)")
        return 0
    if a.render:
        with open(a.render) as f:
            doc = json.load(f)
        out = a.render[:-5] if a.render.endswith(".json") else a.render
        with open(out + ".md", "w") as f:
            f.write(render_md(doc))
        print(f"wrote {out}.md")
        return 0
    import time
    deadline_at = None if a.deadline is None else time.time() + a.deadline
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.smoke:
        grid = [(1, 5, 40), (2, 9, 70)]
        archs = [dict(GQA, Hq=4, Hkv=2, D=32, Dv=32), dict(MLA, H=4, L=64, R=16)]
    else:
        bss, prefixes, Ns = ((1, 32), (4096, 32768), (16, 64)) if a.quick else \
            (ISSUE_GRID["bs"], ISSUE_GRID["prefix"], ISSUE_GRID["N"])
        if a.prefixes:
            prefixes = tuple(int(x) for x in a.prefixes.split(","))
        if a.bss:
            bss = tuple(int(x) for x in a.bss.split(","))
        grid = [(bs, N, p) for bs in bss for p in prefixes for N in Ns]
        archs = [x for x in (GQA, MLA) if x["arch"] in a.archs.split(",")]
    if a.tune_only:
        grid = []
    if device.type != "cuda" and not a.smoke:
        sys.exit("no CUDA device: only --smoke runs on the CPU")
    bw = copy_bandwidth_gbs() if device.type == "cuda" else None
    tflops = matmul_tflops() if device.type == "cuda" else None
    graph = device.type == "cuda" and not a.eager_timing
    g = torch.Generator().manual_seed(0)
    done = set()
    for path in a.skip_done:
        with open(path) as f:
            done |= {cell_key(r) for r in json.load(f)["rows"] if r.get("ours_us")}
    rows, skipped, cut, tune = [], [], [], []
    env = env_info(sys.executable)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def write():
        """The files as they stand: written after every cell, so a run killed by its caller's
        timeout still leaves the cells it measured (the rest listed as not in the file)."""
        doc = dict(kind="verify_attention", env=env, copy_gbs=bw, matmul_tflops=tflops,
                   timing="cuda graph" if graph else "eager", rows=rows, tune=tune, cut=cut,
                   skipped=skipped, tolerance=TOL, ok=all_ok(rows, tune))
        save(doc, a.out)
        return doc
    if a.tune or a.tune_only:
        for arch in archs:
            cells = [(1, 5, 40)] if a.smoke else TUNE_CELLS[arch["arch"]]
            for bs, N, prefix in cells:
                if deadline_at is not None and time.time() > deadline_at:
                    cut.append("tune " + cell_label(arch["arch"], bs, prefix, N))
                    continue
                r = tune_cell(arch, bs, N, prefix, g, device, a.quick, deadline_at)
                print(json.dumps({k: v for k, v in r.items() if k != "trials"}), flush=True)
                tune.append(r)
                write()
    for arch in archs:
        for bs, N, prefix in grid:
            if (arch["arch"], bs, prefix, N) in done:
                continue
            if make_cell_size(arch, bs, N, prefix) * 1.0 > a.max_pool_gb * 1e9:
                skipped.append(cell_label(arch["arch"], bs, prefix, N))
                continue
            if deadline_at is not None and time.time() > deadline_at:
                cut.append(cell_label(arch["arch"], bs, prefix, N))
                continue
            try:
                row = run_cell(arch, bs, N, prefix, g, device, a.quick, bw, tflops, graph)
            except Exception as e:  # noqa: BLE001 - one failing cell (e.g. out of memory) is recorded
                row = dict(arch=arch["arch"], bs=bs, N=N, prefix=prefix, ok=False,
                           error=f"{type(e).__name__}: {e}"[:300])
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
            write()
    doc = write()
    print(f"wrote {a.out}.json, {a.out}.md; all ok: {doc['ok']}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
