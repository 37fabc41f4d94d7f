"""Convert the trainer's target.pt / drafter.pt (bf16 state dicts) into the committed safetensors
(``.safetensors.xz``: xz-compressed, as the checkout keeps them).

    python bench/textpair/export.py RUN_DIR [--dest sglang_ddtree/data/textpair]

RUN_DIR holds target.pt, drafter.pt and log.json (train.py --out; a --target-init run has no
target.pt, and the committed target stays). The safetensors metadata keeps
the seed, step counts and held-out numbers of that run.
"""
import argparse
import json
import lzma
import os
import sys

import torch
from safetensors.torch import save

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--dest", default=C.WEIGHTS_DIR)
    a = ap.parse_args()
    log = json.load(open(os.path.join(a.run, "log.json")))
    os.makedirs(a.dest, exist_ok=True)
    for name in ("target", "drafter"):
        if not os.path.exists(os.path.join(a.run, f"{name}.pt")):
            print(f"no {name}.pt in {a.run}: {name} left as it is")
            continue
        sd = torch.load(os.path.join(a.run, f"{name}.pt"))
        sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(sd.items())}
        meta = {"format": "pt", "script": "bench/textpair/train.py", "seed": str(log["args"]["seed"]),
                "steps": str(log[name]["steps"]), "device": log["device"], "torch": log["torch"]}
        if name == "target":
            meta["tied_head"] = "lm_head.weight = model.embed_tokens.weight (materialize.py writes the copy)"
            meta["heldout"] = json.dumps(log["target"]["heldout_fp32_bf16weights"])
        else:
            meta["dflash_sim_heldout"] = json.dumps(log["dflash_sim_heldout"])
        # committed xz-compressed (the wheel build writes the plain file: sglang_ddtree/_build.py)
        p = os.path.join(a.dest, f"{name}.safetensors.xz")
        with open(p, "wb") as f:
            f.write(lzma.compress(save(sd, metadata=meta), format=lzma.FORMAT_XZ, filters=C._tp.XZ_FILTERS))
        if os.path.exists(p[:-3]):
            os.remove(p[:-3])   # a plain copy would shadow the new weights
        print("wrote", p, os.path.getsize(p), "bytes", sum(v.numel() for v in sd.values()), "params")


if __name__ == "__main__":
    main()
