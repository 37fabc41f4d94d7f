"""Issue 14 item 1 on the GPU host: does the INT4 (Marlin) server compute its dequantized twin's function,
logits included, not just its greedy tokens?

Three servers on the test bed's INT4 MLA pair (bench/device/mk_int4.py): plain decoding on the INT4
target (Marlin MoE), plain decoding on its bf16 twin built from the dequantized weights, and DDTREE-GPU
on the INT4 target (its log-probs come from the verify logits).  For short id prompts
(bench/device/mk_chain_prompts.py) each greedy-decodes with ``return_logprob`` and ``top_logprobs_num=5``.
The reference is the twin's function in fp32: Hugging Face's DeepseekV3ForCausalLM on the twin's weights
(bench/hf_reference.py), scoring every served top-5 entry at its position.

The chain's top token has log-prob ~0 and its alternatives sit ~100-200 nats below, where one bf16
spacing of a logit is 0.5-1, so the bf16 twin's own distance from fp32 is the noise floor.  Pass: the
tokens of all three equal the chain and each other; the INT4 server's max / p99 distance from fp32 are
within 1.5x the twin's (+0.05 / +0.02 nats); DDTree's within 1.5x the INT4 base server's; the top-5
ids agree with the reference's top-5 (as sets) wherever the reference's 5th and 6th are apart by more
than the floor.

usage: python bench/int4_logits_check.py --int4 DIR --ref DIR --draft-model-path D --out PREFIX
Writes PREFIX.json and PREFIX.md; exit 0 only when every check passes.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "device"))
from logprobs_check import card_line, finish_report, generate, out_tokens, start_servers, stat  # noqa: E402
from mk_chain_prompts import chain_prompts  # noqa: E402

TOP_N = 5


def distances(served_tops, ref_rows):
    """|served log-prob - fp32 log-prob| of every served top-n entry; served_tops[j] = [(id, lp)],
    ref_rows[j] a row of fp32 log-probs (indexable by id)."""
    out = []
    for tops, row in zip(served_tops, ref_rows):
        out += [abs(float(lp) - float(row[int(i)])) for i, lp in tops]
    return out


def topset_mismatches(served_tops, ref_rows, floor: float):
    """Positions whose served top-n ids differ (as a set) from the reference's top-n, counted only where
    the reference's n-th and (n+1)-th log-probs are more than ``floor`` apart (else either order is
    within noise)."""
    import torch

    bad = 0
    for tops, row in zip(served_tops, ref_rows):
        v, idx = torch.as_tensor(row).topk(len(tops) + 1)
        if float(v[len(tops) - 1] - v[len(tops)]) <= floor:
            continue
        bad += int({int(i) for i, _ in tops} != set(idx[:len(tops)].tolist()))
    return bad


def verdicts(summ, mism, tokens_ok):
    """The checks of the module docstring from the per-server distance statistics."""
    def within(a, b, m_max, m_p99):
        sa, sb = summ[a], summ[b]
        return bool(sa["n"] and sb["n"] and sa["max"] <= 1.5 * sb["max"] + m_max and sa["p99"] <= 1.5 * sb["p99"] + m_p99)
    return {"tokens_identical_to_the_chain": tokens_ok,
            "int4_at_the_twin_floor": within("int4_base", "ref_base", 0.05, 0.02),
            "ddtree_at_the_int4_floor": within("int4_ddtree", "int4_base", 0.05, 0.02),
            "top5_sets_agree": all(v == 0 for v in mism.values())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--int4", required=True, help="the INT4 target (mlaint4_target)")
    ap.add_argument("--ref", required=True, help="its dequantized bf16 twin (mlaint4ref_target)")
    ap.add_argument("--draft-model-path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--port", type=int, default=30400)
    ap.add_argument("--deadline", type=float, default=300)
    a = ap.parse_args()

    import torch

    from hf_reference import load_deepseek_v3, output_logprobs
    from sglang_ddtree.ab import servers as S
    from sglang_ddtree.ab.environment import env_info

    t0 = time.time()
    prompts = chain_prompts(a.num_prompts, seed=14)
    perm = json.load(open(os.path.join(a.int4, "perm.json")))
    workdir = os.path.dirname(os.path.abspath(a.out + ".json"))
    servers = {"int4_base": (a.int4, "base"), "ref_base": (a.ref, "base"),
               "int4_ddtree": (a.int4, f"ddtree_b{a.budget}")}
    specs = {name: (S.parse_arm(arm), {"model_path": model, "draft_model_path": a.draft_model_path, "maxc": 4,
                                       "token_ids": True, "mem_fraction": 0.25,
                                       "server_args": "--context-length 2048"})
             for name, (model, arm) in servers.items()}
    procs, urls, outs = {}, {}, {k: [] for k in servers}
    try:
        start_servers(procs, urls, specs, dict(os.environ), workdir, "int4logits", a.port,
                      lambda: a.deadline - (time.time() - t0) - 60, sequential=True)
        up_s = time.time() - t0
        for p in prompts:
            for name in servers:
                outs[name].append(out_tokens(generate(urls[name], p, a.max_new_tokens, top_n=TOP_N)))
    finally:
        for pr in procs.values():
            pr.stop()

    def chain(t, n):
        out = []
        for _ in range(n):
            t = perm[t]
            out.append(t)
        return out
    tokens_ok = all([t for t, _ in outs[name][i][0]] == chain(p[-1], a.max_new_tokens)
                    for name in servers for i, p in enumerate(prompts))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = load_deepseek_v3(a.ref, dev)
    dists = {k: [] for k in servers}
    refs = []
    for i, p in enumerate(prompts):
        toks = [t for t, _ in outs["int4_base"][i][0]]
        rows = output_logprobs(ref, p, toks, dev).cpu()
        refs.append(rows)
        for name in servers:
            dists[name] += distances(outs[name][i][1], rows)
    summ = {k: stat(v) for k, v in dists.items()}
    floor = summ["ref_base"]["max"] or 0.0
    mism = {name: sum(topset_mismatches(outs[name][i][1], refs[i], floor) for i in range(len(prompts)))
            for name in servers}
    checks = verdicts(summ, mism, tokens_ok)
    doc = {"environment": env_info(sys.executable), "int4": a.int4, "ref": a.ref, "budget": a.budget,
           "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "top_n": TOP_N,
           "servers_up_s": round(up_s, 1), "distance_from_fp32": summ, "top5_set_mismatches": mism,
           "checks": checks, "pass": all(checks.values()), "wall_s": round(time.time() - t0, 1)}
    json.dump(doc, open(a.out + ".json", "w"), indent=1)
    f = (lambda x: "-" if x is None else f"{x:.4f}")
    names = {"ref_base": "bf16 twin (dequantized weights), plain decoding: the floor",
             "int4_base": "INT4 target (Marlin MoE), plain decoding", "int4_ddtree": f"INT4 target, DDTREE-GPU b{a.budget}"}
    md = ["# INT4 MoE + MLA: the server's log-probabilities vs the dequantized twin's fp32 function (issue 14)\n",
          card_line(doc["environment"], "bench/int4_logits_check.py"),
          f"{len(prompts)} short id prompts x {a.max_new_tokens} greedy tokens, top-{TOP_N} log-probs per token, each "
          "entry scored by Hugging Face's DeepseekV3ForCausalLM in fp32 on the twin's weights. Pass: INT4 within 1.5x "
          "the twin's distance (+0.05 max / +0.02 p99 nats), DDTree within 1.5x INT4's, top-5 id sets equal to the "
          "reference's wherever its 5th and 6th are apart by more than the floor's max.\n",
          "| server | entries | max | p99 | median | top-5 set mismatches |", "|---|---:|---:|---:|---:|---:|"]
    for k, n in names.items():
        s_ = summ[k]
        md.append(f"| {n} | {s_['n']} | {f(s_['max'])} | {f(s_['p99'])} | {f(s_['median'])} | {mism[k]} |")
    md.append("")
    return finish_report(a.out, md, doc)


if __name__ == "__main__":
    sys.exit(main())
