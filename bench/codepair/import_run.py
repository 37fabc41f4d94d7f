"""Put a codepair_train call's returned files where the checkout keeps them (small, compressed).

    python bench/codepair/import_run.py FILES_AT [--name h200]

FILES_AT: the device call's returned folder (bundle.tar is opened when the files are inside it).
Writes
  bench/codepair/corpus_manifest.tsv.gz     the split (as returned: already gzip)
  bench/codepair/tokenizer.json.xz          the tokenizer (xz -9: ~546 KB -> ~70 KB)
  bench/codepair/heldout_prompts.json.gz    the held-out prompts (token ids + text)
  bench/results/codepair_train_<name>.json.gz   codepair_log.json + corpus_meta.json (loss curves,
                                            perplexity, offline acceptance, timings)
and prints the headline numbers.  Check `git ls-files -z | xargs -0 cat | wc -c` (< 24 MB) before committing.
"""
import argparse
import gzip
import json
import lzma
import os
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WANT = ("codepair_log.json", "corpus_manifest.tsv.gz", "tokenizer.json", "heldout_prompts.json", "corpus_meta.json")


def collect(src):
    """{name: bytes} of WANT from the folder or its bundle.tar."""
    got = {}
    for n in WANT:
        p = os.path.join(src, n)
        if os.path.exists(p):
            got[n] = open(p, "rb").read()
    b = os.path.join(src, "bundle.tar")
    if os.path.exists(b):
        with tarfile.open(b) as t:
            for m in t.getmembers():
                n = os.path.basename(m.name)
                if n in WANT and n not in got:
                    got[n] = t.extractfile(m).read()
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files_at")
    ap.add_argument("--name", default="h200")
    ap.add_argument("--repo", default=REPO, help="the checkout to write into (tests: a scratch folder)")
    a = ap.parse_args()
    here = os.path.join(a.repo, "bench", "codepair")
    os.makedirs(here, exist_ok=True)
    os.makedirs(os.path.join(a.repo, "bench", "results"), exist_ok=True)
    got = collect(a.files_at)
    missing = [n for n in WANT if n not in got]
    if missing:
        raise SystemExit(f"missing in {a.files_at}: {missing}")
    with open(os.path.join(here, "corpus_manifest.tsv.gz"), "wb") as f:
        f.write(got["corpus_manifest.tsv.gz"])
    with open(os.path.join(here, "tokenizer.json.xz"), "wb") as f:
        f.write(lzma.compress(got["tokenizer.json"], preset=9))
    with gzip.GzipFile(os.path.join(here, "heldout_prompts.json.gz"), "wb", mtime=0) as f:
        f.write(got["heldout_prompts.json"])
    log = json.loads(got["codepair_log.json"])
    log["corpus_meta"] = json.loads(got["corpus_meta.json"])
    out = os.path.join(a.repo, "bench", "results", f"codepair_train_{a.name}.json.gz")
    with gzip.GzipFile(out, "wb", mtime=0) as f:
        f.write(json.dumps(log, indent=1).encode())
    t, acc = log.get("target", {}), log.get("offline_acceptance", {})
    print(json.dumps({"target_steps": t.get("steps"), "tokens": t.get("tokens"),
                      "achieved_tflops": t.get("achieved_tflops"), "mfu_vs_790": t.get("mfu_vs_790"),
                      "heldout_ppl": (t.get("heldout_fp32_bf16weights") or {}).get("heldout_ppl"),
                      "drafter_steps": log.get("drafter", {}).get("steps"),
                      "offline_dflash_tokens_per_round": acc.get("dflash_tokens_per_round"),
                      "offline_ddtree": {b: [v.get("tokens_per_round"), v.get("sibling_win_round_frac")]
                                         for b, v in (log.get("offline_tree") or {}).get("all", {}).items()},
                      "wrote": out}, indent=1))


if __name__ == "__main__":
    main()
