"""Classify the A/B benchmark's output mismatches on the text pair (CPU, fp32 reference forward).

    python bench/ab_divergence.py AB_JSON [--prompts-python PY] [--ids-out RAW.json.gz]

AB_JSON is an ``ab_serve.py`` result written with ``--save-output-ids`` (``output_ids[arm][c]``)
on the text pair (``--pair text``).  For every request whose output differs from the reference
arm's (``base``, same prompt, same concurrency), the FIRST differing index j is looked at: both
agree on prompt + out[:j], then the reference emits a and the arm emits b.  The fp32 forward of the
trained target (bench/textpair weights) on that common prefix gives the logits of a and b.  As in
``bench/text_divergence.py``, the divergence is a *near tie* when the target's own top-2 are exactly
{a, b} and their logit gap is <= TIE; anything else is an *error* (the arm's output is not the
target's greedy output).  The reference arm against itself across concurrencies (batch-shape
numerics of plain bf16 decoding) is classified the same way.

The prompts' token ids come from ``AB_JSON["prompt_ids"]`` (runs of this version of ab_serve.py),
else from ``--prompts-file`` (``ab_serve.py --save-prompts``), else they are regenerated with ``ab_serve.make_prompts`` under ``--prompts-python`` (the stdlib that
generated them, e.g. the GPU host's Python) and checked against the run's sha256.

Writes ``identity.classification`` into AB_JSON, moves ``output_ids`` (and ``prompt_ids``) to
``--ids-out`` (gzip JSON: the committed report stays small) and rewrites the markdown.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "textpair"))
import ab_serve as AB  # noqa: E402

TIE = 0.15  # = bench/text_divergence.TIE (logit units: a few bf16 spacings of this target's top logits)


def regenerate_prompt_ids(doc: dict, python: str) -> list:
    """Token ids of the run's prompts, rebuilt under ``python`` and checked against its sha256."""
    s = doc["settings"]
    code = (  # the texts come from that interpreter's stdlib; the tokenizer runs here (tokenizers package)
        "import json,sys; sys.path.insert(0, %r); import ab_serve as AB\n"
        "p = AB.make_prompts(%d, '{prompt}', files=AB.textpair_heldout_files())[:%d]\n"
        "print(json.dumps([x['text'] for x in p]))\n" % (HERE, s["num_prompts"], s["num_prompts"]))
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    prompts = [{"text": t} for t in json.loads(out)]
    how = AB.tokenize_prompts(prompts, os.path.join(HERE, "textpair", "tokenizer"), 512)
    if how != "tokenizer.json":
        raise SystemExit("the text pair's tokenizer could not be loaded (is the tokenizers package installed?)")
    ids = [p["input_ids"] for p in prompts]
    got = AB.prompt_digest([{"input_ids": x} for x in ids])
    if got != doc["prompts"]["sha256_16"]:
        raise SystemExit(f"prompts rebuilt under {python} have sha256 {got}, the run's are "
                         f"{doc['prompts']['sha256_16']}: give the interpreter whose stdlib made them")
    return ids


class Target:
    """fp32 reference forward of the text pair's target, with a cache of classified prefixes."""

    def __init__(self):
        import torch
        import pairlib as PL
        from materialize import load_pair
        T, _ = load_pair()
        self.T = {k: v.float() for k, v in T.items()}
        self.PL, self.torch = PL, torch

    def classify(self, prefix: list, ref_tok: int, out_tok: int) -> dict:
        torch = self.torch
        with torch.no_grad():
            lg = self.PL.logits(self.T, torch.tensor([prefix]))[0, -1].float()
        top2 = torch.topk(lg, 2)
        gap = float((lg[ref_tok] - lg[out_tok]).abs())
        tie = set(top2.indices.tolist()) == {ref_tok, out_tok} and gap <= TIE
        return dict(ref_tok=ref_tok, out_tok=out_tok, logit_ref=round(float(lg[ref_tok]), 4),
                    logit_out=round(float(lg[out_tok]), 4), gap=round(gap, 4), top2=top2.indices.tolist(),
                    top2_gap=round(float(top2.values[0] - top2.values[1]), 4), near_tie=tie)


def classify_pairs(pairs, prompt_ids, target) -> dict:
    """pairs: (label, c, prompt index, ref ids, out ids).  -> counts + rows."""
    res = dict(compared=0, diverged=0, near_tie=0, error=0, length=0, rows=[])
    for label, c, i, ref, out in pairs:
        if ref is None or out is None:
            continue
        res["compared"] += 1
        j = AB.first_diff(out, ref)
        if j is None:
            continue
        res["diverged"] += 1
        if j >= min(len(out), len(ref)):  # one is a prefix of the other: no token pair to compare
            res["length"] += 1
            res["error"] += 1
            res["rows"].append(dict(arm=label, concurrency=c, prompt=i, pos=j, near_tie=False, note="length"))
            continue
        row = target.classify(prompt_ids[i] + ref[:j], ref[j], out[j])
        res["near_tie" if row["near_tie"] else "error"] += 1
        res["rows"].append(dict(arm=label, concurrency=c, prompt=i, pos=j, **row))
    return res


def classify_doc(doc: dict, prompt_ids: list, target) -> dict:
    outs = doc["output_ids"]
    ref = doc["settings"].get("reference_arm", "base")
    R = {int(c): v for c, v in outs[ref].items()}
    cls = dict(method=f"fp32 reference forward of the trained target on each first divergence's common "
                      f"prefix; near tie = the target's own top-2 are exactly the two tokens and their logit "
                      f"gap <= {TIE} (bench/ab_divergence.py)", tie_threshold_logits=TIE, reference=ref, arms={})
    for arm, by_c in outs.items():
        if arm == ref:
            continue
        pairs = [(arm, int(c), i, R.get(int(c), [])[i] if i < len(R.get(int(c), [])) else None, x)
                 for c, ids in by_c.items() for i, x in enumerate(ids)]
        cls["arms"][arm] = classify_pairs(pairs, prompt_ids, target)
    cs = sorted(R)
    if len(cs) > 1:  # the reference against its own first level
        pairs = [(f"{ref}@c={c}", c, i, R[cs[0]][i], R[c][i]) for c in cs[1:]
                 for i in range(min(len(R[c]), len(R[cs[0]])))]
        cls["reference_vs_own_first_level"] = dict(level=cs[0], **classify_pairs(pairs, prompt_ids, target))
    return cls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ab_json")
    ap.add_argument("--prompts-python", default=sys.executable)
    ap.add_argument("--prompts-file", default=None, help="the run's prompts as JSON lines with input_ids "
                                                         "(ab_serve.py --save-prompts), checked by sha256")
    ap.add_argument("--ids-out", default=None, help="gzip JSON for output_ids / prompt_ids (default: AB_JSON "
                                                    "with .ids.json.gz)")
    a = ap.parse_args(argv)
    doc = json.load(open(a.ab_json))
    if doc.get("settings", {}).get("pair") != "text":
        raise SystemExit("only the text pair has an fp32 reference here (the toy pairs are checked exactly)")
    if "output_ids" not in doc:
        raise SystemExit(f"{a.ab_json} has no output_ids: run ab_serve.py with --save-output-ids")
    if doc.get("prompt_ids"):
        prompt_ids = doc["prompt_ids"]
    elif a.prompts_file:
        prompt_ids = [json.loads(x)["input_ids"] for x in open(a.prompts_file) if x.strip()]
        prompt_ids = prompt_ids[: doc["settings"]["num_prompts"]]
        got = AB.prompt_digest([{"input_ids": x} for x in prompt_ids])
        if got != doc["prompts"]["sha256_16"]:
            raise SystemExit(f"{a.prompts_file} has sha256 {got}, the run's prompts {doc['prompts']['sha256_16']}")
    else:
        prompt_ids = regenerate_prompt_ids(doc, a.prompts_python)
    cls = classify_doc(doc, prompt_ids, Target())
    doc["identity"]["classification"] = cls
    base = a.ab_json[:-5] if a.ab_json.endswith(".json") else a.ab_json
    ids_out = a.ids_out or base + ".ids.json.gz"
    with gzip.open(ids_out, "wt") as f:
        json.dump(dict(output_ids=doc.pop("output_ids"), prompt_ids=prompt_ids,
                       prompts_sha256_16=doc["prompts"]["sha256_16"]), f)
    doc.pop("prompt_ids", None)
    doc["output_ids_file"] = os.path.basename(ids_out)
    AB.write_outputs(doc, base, plot=False)
    for arm, d in cls["arms"].items():
        print(f"{arm}: compared {d['compared']}, diverged {d['diverged']}, near ties {d['near_tie']}, "
              f"errors {d['error']}")
    r = cls.get("reference_vs_own_first_level")
    if r:
        print(f"{cls['reference']} vs itself at c={r['level']}: diverged {r['diverged']}, near ties "
              f"{r['near_tie']}, errors {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
