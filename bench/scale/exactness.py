"""Does the scaled target compute the small target's greedy function?  (GPU host, SGLang 0.5.16.)

Serves the scaled target (bench/scale/transform.py) in an SGLang Engine (bf16, or ``--dtype float32``; triton attention,
the launch flags of the A/B) and reads its greedy token at every position of the 32 held-out
prompts from one prefill each (``return_logprob``, ``top_logprobs_num=1`` from position 0). The
small target (the shipped text pair with the learned vocabulary extension) runs the same contexts
in fp32 with ``sglang_ddtree.reference_model``. Every position where the two argmaxes differ is
classified with the fp32 logits: a near tie (the fp32 top-2 are the two tokens and their gap is
<= 0.15, a few bf16 spacings) or an error. The issue's bar: >= 99.5 % of positions equal, the rest
near ties.  In bf16 the small target alone moves 0.95 % of its greedy tokens against its fp32 self
(session 16), more than the bar allows; ``--dtype float32`` serves both targets in fp32, which leaves
only summation-order noise between two functions that are equal in real arithmetic.

    python bench/scale/exactness.py --model-path DIR --out bench/results/scale_exactness_h200 [--dtype float32]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # transform.py (bench/scale holds nothing else importable)
TIE = 0.15


def small_reference(prompts):
    """fp32 logits of the extended small target at every position: [(ids, logits [T, V])]."""
    import transform as T  # noqa: E402
    from sglang_ddtree import reference_model as RM
    sd, cfg, _ = T.extended_text_target(float32=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    sd = {k: v.to(dev) for k, v in sd.items()}
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=dev)
            out.append(RM.target_logits(sd, cfg, ids)[0].cpu())
    return out


def write_small(out):
    """The small target with the same vocabulary extension, as a folder SGLang loads (the greedy
    function the scaled one must equal, served the same way)."""
    import transform as T  # noqa: E402
    sd, cfg, _ = T.extended_text_target()
    w = T._FolderWriter(out, 1)
    w.shard(sd)
    w.close(cfg)
    return out


def agreement(ref_logits, a, b):
    """Positions where argmax lists a and b agree; differences classified with the fp32 logits."""
    n = same = ties = 0
    diffs = []
    for i, (lg, x, y) in enumerate(zip(ref_logits, a, b)):
        for j, (u, v) in enumerate(zip(x, y)):
            n += 1
            if u == v:
                same += 1
                continue
            top2 = torch.topk(lg[j], 2)
            gap = float(lg[j, u] - lg[j, v])
            tie = set(top2.indices.tolist()) == {u, v} and abs(gap) <= TIE
            ties += tie
            diffs.append({"prompt": i, "pos": j, "a": u, "b": v, "fp32_gap": round(gap, 4), "near_tie": bool(tie)})
    return {"positions": n, "equal": same, "equal_fraction": same / n, "near_ties": ties,
            "errors": len(diffs) - ties, "differences": diffs}


def served_argmax(model_path, prompts, mem, dtype="bfloat16"):
    import sglang as sgl
    eng = sgl.Engine(model_path=model_path, attention_backend="triton", dtype=dtype,
                     mem_fraction_static=mem, skip_tokenizer_init=True, log_level="error",
                     disable_radix_cache=True, disable_cuda_graph=True)  # prefills only
    try:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                            return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    finally:
        eng.shutdown()
    res = []
    for p, o in zip(prompts, outs):
        top = o["meta_info"]["input_top_logprobs"]
        # entry i is the distribution of token i given tokens < i (entry 0: None); the next-token
        # prediction after the last prompt token is the first output token
        if len(top) == len(p) and not top[0]:
            top = top[1:]
        arg = [t[0][1] if t else None for t in top] + [o["output_ids"][0]]
        if len(arg) != len(p):
            raise RuntimeError(f"expected {len(p)} positions, got {len(arg)}")
        res.append(arg)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mem-fraction-static", type=float, default=0.6)
    ap.add_argument("--small-dir", default=None,
                    help="also serve the small (vocabulary-extended) target, written here, the same way")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the served targets' dtype (both of them)")
    a = ap.parse_args()
    from sglang_ddtree import textpair as TP
    prompts = [p["ids"] for p in TP.heldout_prompts()]
    t0 = time.time()
    ref = small_reference(prompts)
    fp32 = [lg.argmax(-1).tolist() for lg in ref]
    served = served_argmax(a.model_path, prompts, a.mem_fraction_static, a.dtype)
    small = (served_argmax(write_small(a.small_dir), prompts, a.mem_fraction_static, a.dtype)
             if a.small_dir else None)
    dt = "bf16" if a.dtype == "bfloat16" else "fp32"
    vs_fp32 = agreement(ref, fp32, served)
    vs_small = agreement(ref, small, served) if small else None
    small_vs_fp32 = agreement(ref, fp32, small) if small else None
    cfg = json.load(open(os.path.join(a.model_path, "config.json")))
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        gpu = "no GPU (nvidia-smi not found)"
    import sglang
    doc = {"made_by": "bench/scale/exactness.py", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "gpu": gpu, "versions": {"torch": torch.__version__, "sglang": sglang.__version__},
           "scaled_config": {k: cfg.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers",
                                                      "num_attention_heads", "num_key_value_heads", "head_dim",
                                                      "intermediate_size", "num_experts", "num_experts_per_tok",
                                                      "moe_intermediate_size", "vocab_size")},
           "tie_threshold_logits": TIE, "served_dtype": a.dtype,
           f"scaled_{dt}_vs_small_fp32": vs_fp32, f"scaled_{dt}_vs_small_{dt}": vs_small,
           f"small_{dt}_vs_small_fp32": small_vs_fp32,
           # the bar: the scaled target's greedy token equals the small target's at >= 99.5 %
           # of positions, every other one a near tie; judged against the small target served the
           # same way (same dtype, SGLang) when it ran, else against its fp32 reference
           "passes": (lambda r: r["equal_fraction"] >= 0.995 and r["errors"] == 0)(vs_small or vs_fp32),
           "seconds": round(time.time() - t0, 1)}
    with open(a.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    c = doc["scaled_config"]
    md = [f"# Scaled target vs the small trained target: greedy token at every held-out position\n",
          f"Made by `bench/scale/exactness.py` on {doc['date']}, {gpu}, torch {torch.__version__}, "
          f"SGLang {sglang.__version__}. Scaled target: {c['architectures'][0]}, {c['num_hidden_layers']} layers, "
          f"hidden {c['hidden_size']}, {c['num_attention_heads']} q / {c['num_key_value_heads']} kv heads x "
          f"{c['head_dim']}, vocab {c['vocab_size']} ({dt}, SGLang, triton attention); reference: the small "
          f"target in fp32 (reference_model). 32 held-out prompts, every position.\n",
          "| comparison | positions | equal | equal % | near ties (fp32 gap <= 0.15) | errors |",
          "|---|---:|---:|---:|---:|---:|"]
    for name, r in ((f"scaled ({dt}, SGLang) vs small (fp32 reference)", vs_fp32),
                    (f"scaled ({dt}, SGLang) vs small ({dt}, SGLang)", vs_small),
                    (f"small ({dt}, SGLang) vs small (fp32 reference): {dt} serving alone", small_vs_fp32)):
        if r:
            md.append(f"| {name} | {r['positions']} | {r['equal']} | {100 * r['equal_fraction']:.2f} | "
                      f"{r['near_ties']} | {r['errors']} |")
    md.append(f"\nPasses the bar (>= 99.5 % equal to the small target served the same way, every other "
              f"position a near tie): {'yes' if doc['passes'] else 'NO'}")
    open(a.out + ".md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
