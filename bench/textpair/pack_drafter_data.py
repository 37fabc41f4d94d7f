"""A small token pack for training a drafter on the GPU host against the shipped target.

    python bench/textpair/pack_drafter_data.py OUT_DIR [--train-tokens 400000] [--heldout-tokens 60000] [--chunk 1000]

``train.py --target-init`` (drafter only) needs train windows for its prompts (the drafter learns
the target's own greedy continuations of them) and held-out windows for its offline DFLASH
simulation, not the whole 9.4M-token cache: this writes OUT_DIR/train.pt and OUT_DIR/heldout.pt in
the cache's format (int16 token streams): a random segment of up to --chunk tokens of each file of
a split, then </s>, files in a seeded random order, until the token count is reached (0.9 MB for the defaults:
small enough to carry to the GPU host beside the SGLang kit and its JIT cache: train, then serve the new drafter, in one call).
Needs the corpus manifest's Python stdlib (bench/textpair/corpus.py; here Python 3.11.7).
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import corpus  # noqa: E402


def pack(files, tok, n_tokens, rng, chunk):
    """Up to ``chunk`` contiguous tokens (a random segment) of each file, files in a seeded random
    order, each segment followed by </s>, until ``n_tokens``: many files, not a few long ones."""
    order = list(range(len(files)))
    rng.shuffle(order)
    ids, used = [], 0
    for i in order:
        if len(ids) >= n_tokens:
            break
        enc, _ = corpus.encode_files(tok, [files[i]])
        body = enc[:-1]
        start = rng.randrange(max(1, len(body) - chunk + 1))
        ids.extend(body[start:start + chunk] + [C.EOS])
        used += 1
    return ids[:n_tokens], used


def main():
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--train-tokens", type=int, default=400_000)
    ap.add_argument("--heldout-tokens", type=int, default=60_000)
    ap.add_argument("--chunk", type=int, default=1000, help="tokens taken from each file at most")
    a = ap.parse_args()
    train, held = corpus.read_corpus()
    tok = corpus.load_tokenizer()
    rng = random.Random(C.SEED + 7)
    os.makedirs(a.out, exist_ok=True)
    meta = {}
    for name, files, n in (("train", train, a.train_tokens), ("heldout", held, a.heldout_tokens)):
        ids, used = pack(files, tok, n, rng, a.chunk)
        torch.save(torch.tensor(ids, dtype=torch.int16), os.path.join(a.out, f"{name}.pt"))
        meta[name] = {"tokens": len(ids), "files": used, "of_files": len(files)}
    meta["seed"], meta["chunk"] = C.SEED + 7, a.chunk
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
