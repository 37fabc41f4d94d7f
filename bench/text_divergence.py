"""Why do text-pair outputs differ from the plain target's?  Classify every divergence (CPU, torch).

usage: python bench/text_divergence.py RESULTS_JSONL [RESULTS_JSONL ...] [--out bench/results/text_divergence_h200]

For every text stage of a test-bed run (records with ``outputs_bs16`` / ``reference_bs16``), take each
request whose output differs from the plain target's own greedy output (``text_base_graph``) and
look at the FIRST differing position j: both runs agree on prompt + out[:j], then one emits a, the
other b.  The fp32 reference forward of the target (bench/textpair, the trained weights) on that
common prefix gives the logits of a and b.  A divergence is a *near tie* when the target's own
top logit is within ``TIE`` of both a and b (a few bf16 spacings of the logits; the same rule as
bench/ab_divergence.py, so a three-way tie among a, b and a third token counts, as bf16 can flip
any of them:
SGLang runs the target in bf16 with different kernels for plain decode and for verify, so such a
pair can flip either way; the plain target flips the same way between a cold and a radix-cached
run).  Anything else (either token more than ``TIE`` below the top logit) is an *error*: the output is not
the target's greedy output.

Writes OUT.json / OUT.md.
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "textpair"))
sys.path.insert(0, HERE)
import common as C  # noqa: E402
import pairlib as PL  # noqa: E402
from materialize import load_pair  # noqa: E402
from ab_serve import first_diff  # noqa: E402
from rawio import open_maybe_gz, record_name  # noqa: E402

TIE = 0.15  # logit units: a few bf16 spacings at |logit| ~ 8-16 (this target's top logits)


def bump(counts: dict, key: str) -> None:
    """Count one more (the mixed-check keys appear only for stages that kept mixed outputs)."""
    counts[key] = counts.get(key, 0) + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", help="results.jsonl of one run (several calls: all of them)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "text_divergence_h200"))
    a = ap.parse_args()
    T, _ = load_pair()
    T = {k: v.float() for k, v in T.items()}
    prompts = [p["ids"] for p in json.load(open(C.PROMPTS))[:16]]
    rows, per_stage = [], {}

    def classify(stage, i, j, ref, out):
        """The fp32 target's logits of ref[j] and out[j] after prompt i + ref[:j]: a near tie or not."""
        ctx = torch.tensor([prompts[i] + ref[:j]])
        with torch.no_grad():
            lg = PL.logits(T, ctx)[0, -1].float()
        top2 = torch.topk(lg, 2)
        ta, tb = ref[j], out[j]
        gap = float((lg[ta] - lg[tb]).abs())
        below_top = float(top2.values[0]) - min(float(lg[ta]), float(lg[tb]))
        return {"stage": stage, "check": "bs16", "request": i, "pos": j, "ref_tok": ta, "out_tok": tb,
                "logit_ref": round(float(lg[ta]), 4), "logit_out": round(float(lg[tb]), 4),
                "gap": round(gap, 4), "below_top": round(below_top, 4),
                "rank_out": int((lg > lg[tb]).sum()) + 1, "top2": top2.indices.tolist(),
                "top2_gap": round(float(top2.values[0] - top2.values[1]), 4), "near_tie": below_top <= TIE}

    lines = [line for path in a.results for line in open_maybe_gz(path) if line.strip()]
    src = " ".join(record_name(p) for p in a.results)
    for line in lines:
        r = json.loads(line)
        if not r["stage"].startswith("text_") or "outputs_bs16" not in r:
            continue
        st = per_stage.setdefault(r["stage"], {"requests": 0, "diverged": 0, "near_tie": 0, "error": 0,
                                               "accept_bs16": r.get("accept_len_bs16_mean")})
        for i, (out, ref) in enumerate(zip(r["outputs_bs16"], r["reference_bs16"])):
            st["requests"] += 1
            j = first_diff(out, ref)
            if j is None:
                continue
            st["diverged"] += 1
            row = classify(r["stage"], i, j, ref, out)
            st["near_tie" if row["near_tie"] else "error"] += 1
            rows.append(row)
        # the mixed check (stage.py text_mixed: request i asks for 1 + 2i tokens, odd ones also stop at a
        # token of their reference): its expected output is a prefix of reference_bs16[i] of length
        # mixed_lens[i][1]; the first token that leaves the reference inside that prefix is classified
        # like a bs16 divergence; equal tokens with a different length mean a stop / length error
        for i, out in enumerate(r.get("mixed_outputs") or []):
            ref, exp_len = r["reference_bs16"][i], r["mixed_lens"][i][1]
            j = first_diff(out[:exp_len], ref[:min(len(out), exp_len)])
            if j is None and len(out) == exp_len:
                continue
            bump(st, "mixed_diverged")
            if j is None or j >= exp_len:   # same tokens, wrong length: not a tie
                bump(st, "mixed_error")
                rows.append({"stage": r["stage"], "check": "mixed", "request": i,
                             "pos": f"len {len(out)} != {exp_len}", "near_tie": False})
                continue
            row = classify(r["stage"], i, j, ref, out)
            row["check"] = "mixed"
            bump(st, "mixed_near_tie" if row["near_tie"] else "mixed_error")
            rows.append(row)
    doc = {"tie_threshold_logits": TIE, "tie_rule": "below_top", "stages": per_stage, "divergences": rows,
           "source": src}
    json.dump(doc, open(a.out + ".json", "w"), indent=1)
    md = ["# Text pair: where DDTree / DFLASH outputs leave the plain target's greedy output\n",
          f"`bench/text_divergence.py {src}` (CPU, fp32 reference forward of the "
          f"trained target on each first divergence's common prefix). Near tie: both tokens' fp32 logits "
          f"are within {TIE} of the target's top logit (bench/ab_divergence.py's rule). Reference: `text_base_graph` (16 held-out "
          "prompts x 96 tokens, first cold run).\n",
          "Mixed: the test bed's mixed check (request i: 1 + 2i tokens, odd ones with a stop token), its "
          "first token off the reference classified the same way; a length difference with equal tokens is "
          "an error.\n",
          "| stage | requests | diverged | near ties | errors | mixed diverged | mixed near ties | mixed errors "
          "| accept/round bs16 |", "|---|---|---|---|---|---|---|---|---|"]
    for s, v in sorted(per_stage.items()):
        md.append(f"| {s} | {v['requests']} | {v['diverged']} | {v['near_tie']} | {v['error']} | "
                  f"{v.get('mixed_diverged', 0)} | {v.get('mixed_near_tie', 0)} | {v.get('mixed_error', 0)} | "
                  f"{v['accept_bs16']} |")
    md += ["\n| stage | check | request | position | reference token | output token | logit gap | below top | output's rank | target top-2 gap | near tie |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['stage']} | {r['check']} | {r['request']} | {r['pos']} | {r.get('ref_tok', '-')} | "
                  f"{r.get('out_tok', '-')} | {r.get('gap', '-')} | {r.get('below_top', '-')} | "
                  f"{r.get('rank_out', '-')} | {r.get('top2_gap', '-')} | {'yes' if r['near_tie'] else '**NO**'} |")
    open(a.out + ".md", "w").write("\n".join(md) + "\n")
    print("\n".join(md[:4 + len(per_stage)]))


if __name__ == "__main__":
    main()
