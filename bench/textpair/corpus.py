"""Corpus, tokenizer and tokenized cache of the text pair (runs here, not on the device).

    python bench/textpair/corpus.py manifest      # (re)write corpus_manifest.tsv from this interpreter
    python bench/textpair/corpus.py tokenizer     # train the byte-level BPE on the train split
    python bench/textpair/corpus.py cache         # tokenize both splits -> cache/{train,heldout}.pt
    python bench/textpair/corpus.py prompts       # heldout_prompts.json (32 held-out prompts)
    python bench/textpair/corpus.py all           # tokenizer + cache + prompts (manifest must match)

Corpus: the Python standard library shipped with the interpreter that runs this script
(sysconfig stdlib path): every *.py file below it, sorted by relative path, except site-packages/,
encodings/ (generated charmap tables), _sysconfigdata* (machine-specific) and files that are not
UTF-8. pydoc_data/topics.py (the language reference's topics) is the docs part. Sorted file i is
held out iff i % 20 == 10 (split by file). corpus_manifest.tsv lists path, sha256 and bytes of every
file; every command except `manifest` checks it and stops on any difference (another Python).
Needs `tokenizers` (training, encoding) and torch (the cache); nothing of this runs on the device.
"""
import argparse
import hashlib
import json
import os
import random
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

EXCLUDE_TOP = ("site-packages", "encodings", "__pycache__")


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def list_files(root):
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and (parts[0] in EXCLUDE_TOP or parts[0].startswith("config-")):
            dirs[:] = []
            continue
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in files:
            if not f.endswith(".py") or f.startswith("_sysconfigdata"):
                continue
            p = os.path.join(d, f)
            if os.path.islink(p):
                continue
            data = open(p, "rb").read()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.append(os.path.relpath(p, root).replace(os.sep, "/"))
    return sorted(out)


def write_manifest():
    root = stdlib_root()
    files = list_files(root)
    with open(C.MANIFEST, "w") as f:
        f.write(f"# python {sys.version.split()[0]} stdlib ({len(files)} files); "
                f"columns: path sha256 bytes; held out iff index % {C.HELDOUT_EVERY} == {C.HELDOUT_AT}\n")
        for p in files:
            data = open(os.path.join(root, p), "rb").read()
            f.write(f"{p}\t{hashlib.sha256(data).hexdigest()}\t{len(data)}\n")
    print(f"wrote {C.MANIFEST}: {len(files)} files, {sum(os.path.getsize(os.path.join(root, p)) for p in files)} bytes")


def read_corpus(allow_mismatch=False):
    """[(path, text)] for train and held-out, checked against the manifest."""
    root = stdlib_root()
    rows = [l.rstrip("\n").split("\t") for l in open(C.MANIFEST) if not l.startswith("#")]
    bad = []
    train, held = [], []
    for i, (p, sha, n) in enumerate(rows):
        fp = os.path.join(root, p)
        data = open(fp, "rb").read() if os.path.exists(fp) else None
        if data is None or len(data) != int(n) or hashlib.sha256(data).hexdigest() != sha:
            bad.append(p)
            continue
        (held if i % C.HELDOUT_EVERY == C.HELDOUT_AT else train).append((p, data.decode("utf-8")))
    if bad:
        msg = (f"{len(bad)} of {len(rows)} manifest files differ or are missing under {root} "
               f"(python {sys.version.split()[0]}; the manifest's header names the one it was made with), "
               f"e.g. {bad[:3]}")
        if not allow_mismatch:
            sys.exit("corpus mismatch: " + msg + "; rerun with --allow-mismatch to use what matches")
        print("WARNING:", msg)
    return train, held


def train_tokenizer(train):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=C.VOCAB, special_tokens=C.SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((t for _, t in train), trainer)
    assert tok.get_vocab_size() == C.VOCAB, tok.get_vocab_size()
    for i, s in enumerate(C.SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    os.makedirs(C.TOKENIZER_DIR, exist_ok=True)
    tok.save(os.path.join(C.TOKENIZER_DIR, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "mask_token": "<mask>"}
    with open(os.path.join(C.TOKENIZER_DIR, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": 4096,
                   "add_bos_token": False, "add_eos_token": False,
                   "clean_up_tokenization_spaces": False}, f, indent=1)
    with open(os.path.join(C.TOKENIZER_DIR, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=1)
    return tok


def load_tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(C.TOKENIZER_DIR, "tokenizer.json"))


def encode_files(tok, files):
    """One stream: each file's ids followed by </s>; also each file's start offset."""
    enc = tok.encode_batch([t for _, t in files], add_special_tokens=False)
    ids, starts = [], []
    for e in enc:
        starts.append(len(ids))
        ids.extend(e.ids)
        ids.append(C.EOS)
    return ids, starts


def build_cache(tok, train, held):
    import torch
    os.makedirs(C.CACHE, exist_ok=True)
    meta = {}
    for name, files in (("train", train), ("heldout", held)):
        ids, starts = encode_files(tok, files)
        t = torch.tensor(ids, dtype=torch.int16)  # vocab 2048 < 2^15
        torch.save(t, os.path.join(C.CACHE, f"{name}.pt"))
        nbytes = sum(len(x.encode()) for _, x in files)
        meta[name] = {"files": len(files), "bytes": nbytes, "tokens": len(ids),
                      "bytes_per_token": round(nbytes / len(ids), 3)}
        print(name, meta[name], flush=True)
    meta["tokenizer_sha256"] = hashlib.sha256(
        open(os.path.join(C.TOKENIZER_DIR, "tokenizer.json"), "rb").read()).hexdigest()
    with open(os.path.join(C.CACHE, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def make_prompts(tok, held, n=32, seed=C.SEED):
    """n prompts from n different held-out files (seeded): start at a line start, 16-200 tokens."""
    rng = random.Random(seed)
    cands = [(p, t) for p, t in held if len(t) > 4000]
    pick = sorted(rng.sample(range(len(cands)), n))
    out = []
    for k, i in enumerate(pick):
        p, text = cands[i]
        L = 16 + round((200 - 16) * k / (n - 1))  # lengths spread evenly over 16..200
        lines = text.splitlines(keepends=True)
        while True:
            j = rng.randrange(len(lines))
            ids = tok.encode("".join(lines[j:]), add_special_tokens=False).ids
            if len(ids) >= L + 64 and lines[j].strip():
                break
        ids = ids[:L]
        out.append({"file": p, "line": j + 1, "len": L, "ids": ids, "text": tok.decode(ids)})
    rng.shuffle(out)
    with open(C.PROMPTS, "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(o) for o in out) + "\n]\n")
    print(f"wrote {C.PROMPTS}: {len(out)} prompts, lengths {min(o['len'] for o in out)}-{max(o['len'] for o in out)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["manifest", "tokenizer", "cache", "prompts", "all"])
    ap.add_argument("--allow-mismatch", action="store_true")
    a = ap.parse_args()
    if a.cmd == "manifest":
        return write_manifest()
    t0 = time.time()
    train, held = read_corpus(a.allow_mismatch)
    print(f"corpus: {len(train)} train files, {len(held)} held-out files", flush=True)
    tok = train_tokenizer(train) if a.cmd in ("tokenizer", "all") else load_tokenizer()
    if a.cmd in ("tokenizer", "all"):
        print(f"tokenizer trained ({time.time()-t0:.0f}s)", flush=True)
    if a.cmd in ("cache", "all"):
        build_cache(tok, train, held)
    if a.cmd in ("prompts", "all"):
        make_prompts(tok, held)
    print(f"done in {time.time()-t0:.0f}s")


if __name__ == "__main__":
    main()
