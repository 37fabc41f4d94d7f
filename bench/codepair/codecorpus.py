"""The code pair's corpus, split, tokenizer and token streams, built on the machine that trains
(the GPU host: its Python standard library and installed packages' sources; no downloads).

    python bench/codepair/codecorpus.py OUT [--root SPEC ...] [--vocab 8192] [--tok-sample-mb 48]
           [--check-manifest MANIFEST.tsv.gz]

Roots (``--root``, repeatable; default ``DEFAULT_ROOTS``):
  stdlib        the running interpreter's standard library (sysconfig "stdlib"), without
                site-packages/, dist-packages/, encodings/ (generated charmap tables),
                config-*/ and _sysconfigdata* (machine-specific), as bench/textpair/corpus.py;
  pkg:NAME      the installed top-level package NAME (importlib: its folder), key prefix NAME/;
  dir:PATH      a folder (e.g. the unpacked SGLang kit's /tmp/site/sglang), key prefix its basename/.
A missing ``pkg:`` / ``dir:`` root is skipped and recorded (``?`` suffix: optional), or is an error
without it.  Files: every *.py below a root that is UTF-8, not a symlink, 1 byte .. --max-file-kb.

Split by file, never by window: each file's key is ``prefix/relative/path``.  Identical contents
are kept once (the first key in sorted order; the rest are listed as duplicates), so no held-out
text is also a training file.  A file is held out iff int(sha256(key)[:8], 16) % 20 == 10: the
key, not the content or the file's index, so the same path in two package versions (e.g. the
image's and the kit's) falls on the same side, and adding a root moves no other file.

OUT gets:
  manifest.tsv.gz   key, split (T / H / D = duplicate of an earlier key), bytes, sha256[:16]; a
                    header with the interpreter, roots and the totals (commit it: it is small);
  tokenizer/        byte-level BPE (--vocab, specials <pad> <s> </s> <unk> <mask> = 0..4) trained
                    on a seeded sample of the TRAIN files only (--tok-sample-mb);
  train.pt, heldout.pt   int16 token streams (each file's ids then </s>), as bench/textpair's cache;
  heldout_prompts.json   held-out prompts (``make_prompts``: token ids + text, distinct files);
  meta.json         counts, bytes per token, hashes, seconds.
--check-manifest: stop if the files found differ from a committed manifest (another host image).
"""
import argparse
import gzip
import hashlib
import importlib.util
import json
import os
import random
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import codeconfig as K  # noqa: E402

# On the GPU host run_stages.sh puts the SGLang kit (/tmp/site) first on PYTHONPATH: there pkg:sglang,
# pkg:flashinfer and pkg:transformers are the kit's, the rest the image's (run the recipe through the
# codepair_train stage, or with the same PYTHONPATH, so the corpus is the manifest's).
DEFAULT_ROOTS = ["stdlib", "pkg:torch", "pkg:triton", "pkg:transformers", "pkg:sglang?", "pkg:flashinfer?",
                 "pkg:jax?", "pkg:numpy?", "pkg:scipy?", "pkg:sympy?", "pkg:pandas?", "pkg:sklearn?"]
STDLIB_SKIP_TOP = ("site-packages", "dist-packages", "encodings", "__pycache__")


def resolve_root(spec):
    """(key prefix, folder or None, optional) of a --root spec."""
    opt = spec.endswith("?")
    spec = spec.rstrip("?")
    if spec == "stdlib":
        return "stdlib", sysconfig.get_paths()["stdlib"], opt
    if spec.startswith("pkg:"):
        name = spec[4:]
        try:
            s = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            s = None
        d = os.path.dirname(s.origin) if s is not None and s.origin else None
        if d is None and s is not None and s.submodule_search_locations:
            d = list(s.submodule_search_locations)[0]
        return name, d, opt
    if spec.startswith("dir:"):
        d = spec[4:].rstrip("/")
        return os.path.basename(d), (d if os.path.isdir(d) else None), opt
    raise SystemExit(f"--root {spec!r}: stdlib, pkg:NAME or dir:PATH (a trailing ? makes it optional)")


def list_root(prefix, root, max_bytes):
    """[(key, path)] of the root's .py files (sorted by key)."""
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if prefix == "stdlib" and parts and (parts[0] in STDLIB_SKIP_TOP or parts[0].startswith("config-")):
            dirs[:] = []
            continue
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in files:
            if not f.endswith(".py") or (prefix == "stdlib" and f.startswith("_sysconfigdata")):
                continue
            p = os.path.join(d, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            n = os.path.getsize(p)
            if n == 0 or n > max_bytes:
                continue
            out.append((prefix + "/" + os.path.relpath(p, root).replace(os.sep, "/"), p))
    return sorted(out)


def held_out(key):
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % K.HELDOUT_EVERY == K.HELDOUT_AT


def scan(roots, max_bytes):
    """The corpus: rows [key, split, bytes, sha16], texts {key: str} of the kept files, root info."""
    rows, texts, info, seen = [], {}, [], {}
    files = []
    for spec in roots:
        prefix, d, opt = resolve_root(spec)
        if d is None:
            if not opt:
                raise SystemExit(f"--root {spec}: not found on this interpreter ({sys.executable})")
            info.append({"root": spec, "found": False})
            continue
        got = list_root(prefix, d, max_bytes)
        info.append({"root": spec, "found": True, "dir": d, "files": len(got)})
        files += got
    files.sort()
    keys = set()
    for key, path in files:
        if key in keys:   # the same prefix from two roots (e.g. a package found twice): the first wins
            continue
        keys.add(key)
        data = open(path, "rb").read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        sha = hashlib.sha256(data).hexdigest()
        if sha in seen:
            rows.append([key, "D", len(data), sha[:16]])
            continue
        seen[sha] = key
        rows.append([key, "H" if held_out(key) else "T", len(data), sha[:16]])
        texts[key] = text
    return rows, texts, info


def write_manifest(path, rows, info, totals):
    with gzip.GzipFile(path, "wb", mtime=0) as g:
        head = {"python": sys.version.split()[0], "executable": sys.executable, "roots": info, **totals,
                "split": f"held out iff int(sha256(key)[:8], 16) % {K.HELDOUT_EVERY} == {K.HELDOUT_AT}; "
                         "D = same bytes as an earlier key (dropped)"}
        g.write(("# " + json.dumps(head, sort_keys=True) + "\n").encode())
        g.write("# key\tsplit\tbytes\tsha256_16\n".encode())
        for r in rows:
            g.write(("\t".join(str(x) for x in r) + "\n").encode())


def read_manifest(path):
    with gzip.open(path, "rt") as f:
        return [line.rstrip("\n").split("\t") for line in f if not line.startswith("#")]


def train_tokenizer(texts, vocab, out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=K.SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"tokenizer: {tok.get_vocab_size()} ids, not {vocab} (too little sample text?)")
    for i, s in enumerate(K.SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "mask_token": "<mask>"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": 4096,
                   "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False},
                  f, indent=1)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=1)
    return tok


def tokenizer_sample(train_keys, texts, mb, seed):
    """A seeded sample of train files, about mb megabytes."""
    keys = list(train_keys)
    random.Random(seed).shuffle(keys)
    out, n = [], 0
    for k in keys:
        if n >= mb * 1e6:
            break
        out.append(texts[k])
        n += len(texts[k])
    return out


def encode_stream(tok, texts):
    """The texts' ids, each followed by ``</s>``, as one int16 stream.

    ``encode_batch`` runs on all cores only while ``TOKENIZERS_PARALLELISM`` allows it, and
    bench/device/run_stages.sh exports it false for the SGLang servers: on the H100 host that
    made the corpus phase 146 s (s35, ``codepair_train_h100_run1.json.gz``), single-threaded
    (here, 2 cores: 10.4 s vs 5.9 s for 19 MB).  It is switched on for the call and put back."""
    import torch
    parts, eos = [], torch.tensor([K.EOS], dtype=torch.int16)
    was = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        for i in range(0, len(texts), 2048):
            for e in tok.encode_batch(texts[i:i + 2048], add_special_tokens=False):
                parts += [torch.tensor(e.ids, dtype=torch.int16), eos]   # vocab < 2^15
    finally:
        if was is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = was
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int16)


def make_prompts(tok, held, lens, per_len, seed, min_after=64):
    """per_len prompts of each length in lens, every one from a different held-out file (seeded),
    starting at a non-blank line start: {"file", "line", "len", "input_ids", "text"}."""
    rng = random.Random(seed)
    need = len(lens) * per_len
    cands = sorted(k for k, t in held.items() if len(t) > 2000)
    rng.shuffle(cands)
    out, used = [], 0
    for L in [L for L in lens for _ in range(per_len)]:
        while used < len(cands):
            key = cands[used]
            used += 1
            lines = held[key].splitlines(keepends=True)
            starts = [j for j, s in enumerate(lines) if s.strip()]
            for _ in range(8):
                j = rng.choice(starts)
                ids = tok.encode("".join(lines[j:]), add_special_tokens=False).ids
                if len(ids) >= L + min_after:
                    ids = ids[:L]
                    out.append({"file": key, "line": j + 1, "len": L, "input_ids": ids, "text": tok.decode(ids)})
                    break
            else:
                continue
            break
    if len(out) < need:
        print(f"WARNING: only {len(out)} of {need} held-out prompts (too few long held-out files)", flush=True)
    return out


def build(out, roots=None, vocab=8192, tok_sample_mb=48, max_file_kb=512, seed=K.SEED,
          prompt_lens=(64, 128, 256, 512), prompts_per_len=16, check_manifest=None):
    """Everything above into OUT; returns meta.  Skips the work when OUT/meta.json is complete."""
    t0 = time.time()
    assert vocab <= 32768, "the streams are int16"
    os.makedirs(out, exist_ok=True)
    roots = list(roots or DEFAULT_ROOTS)
    rows, texts, info = scan(roots, max_file_kb * 1024)
    train_keys = [r[0] for r in rows if r[1] == "T"]
    held_keys = [r[0] for r in rows if r[1] == "H"]
    if check_manifest:
        ref = {(r[0], r[1], r[3]) for r in read_manifest(check_manifest)}
        now = {(r[0], r[1], r[3]) for r in rows}
        if ref != now:
            raise SystemExit(f"corpus differs from {check_manifest}: {len(ref - now)} rows missing here, "
                             f"{len(now - ref)} new (another image?)")
    tb = {"train": sum(len(texts[k].encode()) for k in train_keys),
          "heldout": sum(len(texts[k].encode()) for k in held_keys)}
    totals = {"files": {"train": len(train_keys), "heldout": len(held_keys),
                        "duplicates": sum(r[1] == "D" for r in rows)}, "bytes": tb}
    write_manifest(os.path.join(out, "manifest.tsv.gz"), rows, info, totals)
    t_scan = time.time() - t0
    sample = tokenizer_sample(train_keys, texts, tok_sample_mb, seed)
    tok = train_tokenizer(sample, vocab, os.path.join(out, "tokenizer"))
    t_tok = time.time() - t0 - t_scan
    import torch
    meta = {"roots": info, **totals, "vocab": vocab, "tok_sample_files": len(sample),
            "tokenizer_sha256": hashlib.sha256(open(os.path.join(out, "tokenizer", "tokenizer.json"), "rb")
                                               .read()).hexdigest()}
    for name, keys in (("train", train_keys), ("heldout", held_keys)):
        t = encode_stream(tok, [texts[k] for k in keys])
        torch.save(t, os.path.join(out, f"{name}.pt"))
        meta.setdefault("tokens", {})[name] = int(t.numel())
    meta["bytes_per_token"] = {k: round(tb[k] / max(1, meta["tokens"][k]), 3) for k in tb}
    prompts = make_prompts(tok, {k: texts[k] for k in held_keys}, prompt_lens, prompts_per_len, seed)
    with open(os.path.join(out, "heldout_prompts.json"), "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(o) for o in prompts) + "\n]\n")
    meta["prompts"] = {"n": len(prompts), "lens": list(prompt_lens), "files": len({p["file"] for p in prompts})}
    meta["seconds"] = {"scan": round(t_scan, 1), "tokenizer": round(t_tok, 1),
                       "total": round(time.time() - t0, 1)}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--root", action="append", default=None)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tok-sample-mb", type=float, default=48)
    ap.add_argument("--max-file-kb", type=int, default=512)
    ap.add_argument("--seed", type=int, default=K.SEED)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--prompts-per-len", type=int, default=16)
    ap.add_argument("--check-manifest", default=None)
    a = ap.parse_args()
    meta = build(a.out, a.root, a.vocab, a.tok_sample_mb, a.max_file_kb, a.seed, a.prompt_lens,
                 a.prompts_per_len, a.check_manifest)
    print(json.dumps({k: meta[k] for k in ("files", "bytes", "tokens", "bytes_per_token", "seconds")}))


if __name__ == "__main__":
    main()
