"""Short token-id prompts for an A/B on a permutation-chain pair (gqa / mla / kimicost).

usage: python bench/device/mk_chain_prompts.py OUT.jsonl [--n 64] [--seed 0] [--len 2-40]

The test bed's prompts (stage.py ``PROMPTS``: 2-40 ids below 1024) are where the toy drafters
accept 3.8-4.4 tokens per round; the A/B's default prompts (512-token stdlib text through the toy
tokenizer) give them 1.15-1.4 (bench/results/ab_h200_kimicost.md).  This writes prompts of the
first kind, one ``{"input_ids": [...]}`` per line, for ``sglang-ddtree-ab --prompts OUT.jsonl``:
lengths uniform in [2, 40], ids uniform in [3, 1000), the first id 1 as in stage.py.
"""
import argparse
import json
import random


def chain_prompts(n: int, seed: int = 0, min_len: int = 2, max_len: int = 40):
    """n prompts: id 1, then ``len - 1`` ids uniform in [3, 1000), len uniform in [min_len, max_len]
    (the defaults: the test bed's; long contexts: e.g. 8000-8192 for a long-context arm)."""
    if not 2 <= min_len <= max_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 1000) for _ in range(rng.randint(min_len - 1, max_len - 1))]
            for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--len", default="2-40", help="prompt length range LO-HI in tokens (default 2-40)")
    a = ap.parse_args()
    if a.n < 1:
        raise SystemExit("--n must be >= 1")
    try:
        lo, hi = (int(x) for x in a.len.split("-"))
        prompts = chain_prompts(a.n, a.seed, lo, hi)
    except ValueError as e:
        raise SystemExit(f"--len {a.len!r}: {e}")
    with open(a.out, "w") as f:
        for ids in prompts:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    print(f"wrote {a.n} prompts to {a.out}")


if __name__ == "__main__":
    main()
