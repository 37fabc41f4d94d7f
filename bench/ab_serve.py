"""A/B serving benchmark: one SGLang server per arm, the same greedy prompts at each concurrency.

    python bench/ab_serve.py --model-path T --draft-model-path D [options]     # measure
    python bench/ab_serve.py [--pair text|gqa|mla] [options]    # a test-bed pair (/tmp/models); default text
    python bench/ab_serve.py --report-only OUT.json              # rewrite OUT.md from a results JSON
    python bench/ab_serve.py --merge OUT a.json b.json           # one report (JSON + MD) from several runs

Arms (``--arms``, comma-separated, run one after another, never two servers at once):
  base              the target alone (no --speculative-algorithm)
  dflash            stock DFLASH (--speculative-num-draft-tokens left to SGLang: the drafter's block)
  ddtree_b<B>       DDTREE-GPU with tree budget B (--speculative-num-draft-tokens B+1)
  ddtreecpu_b<B>    DDTREE-CPU (the exact CPU heap builds the tree), same budget flag
Every server: ``python -m sglang.launch_server --model-path T --attention-backend triton --host
127.0.0.1 --port P --mem-fraction-static 0.6 --cuda-graph-max-bs-decode MAXC
--disable-prefill-cuda-graph --max-running-requests MAXC --skip-server-warmup --random-seed 0``
(+ ``--skip-tokenizer-init`` when prompts are token ids, + the arm's speculative flags, + the
``--server-args`` string last, so it overrides).  With ``--config F.yaml`` the YAML (minus its
speculative and host/port keys) is the base and only the flags it does not set are added.
Each server is started in its own process group, waited for on ``/health_generate``, warmed up,
measured, then killed (group SIGTERM, then SIGKILL) before the next one starts.

Measurement, per concurrency c (``--concurrency``): the first n_c prompts of one fixed prompt list
(``--requests-per-level``; auto = min(N, max(16, 4c)) so the high-c levels reach a steady batch,
``all`` = N) go to ``/generate`` with ``stream: true``, temperature 0, ``ignore_eos``, a fixed
``max_new_tokens``, at most c in flight (threads; a new request starts when one finishes).  The
radix cache is flushed before each level.  Per request: TTFT (first chunk with a token), ITL
(time between chunks / tokens in the chunk, repeated once per token: a speculative round streams
several tokens in one chunk; this is ``sglang.bench_serving``'s definition), end-to-end latency,
output ids and meta_info (completion_tokens, spec_verify_ct).  Per level (field names of
``sglang.bench_serving``'s result JSON): output_throughput = total output tokens / wall time of
the level; TTFT / ITL / TPOT / e2e mean, median, p99 (each level is run ``--repeats`` times,
radix cache flushed before each, and the run with the median output_throughput is reported, with
every run's throughput beside it); accept_length = sum(completion_tokens) /
sum(spec_verify_ct) (SGLang's spec_accept_length, bonus and prefill token included);
ms_per_step = (e2e - TTFT) / steps, averaged over requests (steps = spec_verify_ct, or
completion_tokens - 1 without speculation): the client-side time of one decode round.

Identity: every arm's output ids per (concurrency, prompt) are compared with the reference arm's
(``base``) at the same concurrency; mismatching requests and their first differing index are
reported (bf16 near-ties may flip a token legitimately on a real model; nothing is hidden).

Per-stage round time (DDTREE arms): the server runs with ``SGLANG_DDTREE_PROFILE_FILE`` (see
sglang_ddtree/profiling.py: CUDA events at the stage boundaries of every round, flushed as JSON
lines of per-stage medians every ``--profile-every`` rounds).  Records are attributed to the level
during which they were written (a record can hold up to profile-every rounds of the previous
level) and aggregated as the rounds-weighted mean of the per-record medians.  ``draft`` includes
the top-K (folded into the drafter's CUDA graph); ``--kernel-sweep`` times the tree build alone.
``outside_ms`` = client ms_per_step - GPU round_ms: scheduler, host and HTTP time outside the
worker's round.

``--kernel-sweep``: in a subprocess (no server), for bs 1..256, budget 8..64, depth 7 and 15,
drafter-like bf16 logits -> top-k log-probs (bench/tree_kernels.py's inputs and timers): GPU
``build_tree(backend="triton")`` (CUDA-graph replays, median) against the CPU heap
``backend="reference"`` (wall clock median, device->host copy included), trees checked identical.

Outputs: ``OUT.json`` (every number, per-request columns, identity, stage times, kernel sweep,
GPU, versions, git commit, date, the exact server command lines), ``OUT.md`` and, when matplotlib
is importable, ``OUT.png`` (bench/ab_plot.py; run it later on the JSON otherwise).  JSON + MD are
rewritten after every arm, so a killed run keeps what it measured; ``--deadline`` skips what no
longer fits and still writes both.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import http.client
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_ARMS = "base,dflash,ddtree_b16,ddtreecpu_b16,ddtree_b32,ddtree_b8,ddtree_b64"
ALGO = {"base": None, "dflash": "DFLASH", "ddtree": "DDTREE-GPU", "ddtreecpu": "DDTREE-CPU"}
STAGES = ("draft", "tree", "verify_prep", "verify", "accept", "commit")
SWEEP_BS = (1, 4, 16, 64, 256)
SWEEP_BUDGETS = (8, 16, 32, 64)
SWEEP_DEPTHS = (15, 7)
RE_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')


# ------------------------------------------------------------------------------------------ arms
def parse_arm(name: str) -> dict:
    """'base' | 'dflash' | 'ddtree_b<B>' | 'ddtreecpu_b<B>' -> {name, kind, algo, budget, num_draft_tokens}."""
    name = name.strip()
    kind, _, rest = name.partition("_")
    if kind not in ALGO:
        raise ValueError(f"unknown arm {name!r} (base, dflash, ddtree_b<B>, ddtreecpu_b<B>)")
    budget = None
    if kind.startswith("ddtree"):
        if not (rest.startswith("b") and rest[1:].isdigit()):
            raise ValueError(f"arm {name!r}: write the budget as {kind}_b<B>, e.g. {kind}_b16")
        budget = int(rest[1:])
    elif rest:
        raise ValueError(f"arm {name!r}: {kind} takes no suffix")
    return dict(name=name, kind=kind, algo=ALGO[kind], budget=budget,
                num_draft_tokens=None if budget is None else budget + 1)


def parse_arms(spec: str) -> List[dict]:
    arms = [parse_arm(a) for a in spec.split(",") if a.strip()]
    names = [a["name"] for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate arms in {spec!r}")
    # the reference arm runs first: identity needs it, and a deadline cuts the tail
    arms.sort(key=lambda a: a["kind"] != "base")
    return arms


def cuda_graph_default_bs(maxc: int) -> List[int]:
    return sorted({b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b <= maxc} | {maxc})


def load_yaml_config(path: str) -> dict:
    import yaml  # SGLang's own dependency (its --config loader)
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return raw


CONFIG_DROP = ("speculative-algorithm", "speculative-num-draft-tokens", "speculative-draft-model-path",
               "speculative-num-steps", "speculative-eagle-topk", "port", "host")


def build_server_cmd(arm: dict, opts: dict, port: int, config_path: Optional[str] = None,
                     config_keys: Optional[set] = None) -> List[str]:
    """The exact launch_server command line of one arm.  ``opts``: python, model_path,
    draft_model_path, maxc, token_ids, mem_fraction, cuda_graph_bs (list or None), server_args."""
    keys = config_keys or set()
    cmd = [opts.get("python") or sys.executable, "-m", "sglang.launch_server"]
    if config_path:
        cmd += ["--config", config_path]

    def add(flag, *vals, key=None):
        k = key or flag.lstrip("-")
        if k in keys:
            return
        cmd.append(flag)
        cmd.extend(str(v) for v in vals)

    if opts.get("model_path"):
        cmd += ["--model-path", opts["model_path"]]
    add("--attention-backend", "triton")
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    add("--mem-fraction-static", opts.get("mem_fraction", 0.6))
    maxc = int(opts["maxc"])
    if "cuda-graph-config" not in keys:
        add("--cuda-graph-max-bs-decode", maxc, key="cuda-graph-max-bs-decode")
        if opts.get("cuda_graph_bs"):
            add("--cuda-graph-bs-decode", *opts["cuda_graph_bs"], key="cuda-graph-bs-decode")
        add("--disable-prefill-cuda-graph", key="disable-prefill-cuda-graph")
    if "max-running-requests" in keys:
        pass  # the config's value (a warning is recorded by the caller if it is < maxc)
    else:
        cmd += ["--max-running-requests", str(maxc)]
    add("--skip-server-warmup")
    add("--random-seed", 0)
    if opts.get("token_ids"):
        add("--skip-tokenizer-init")
    if arm["algo"]:
        if not opts.get("draft_model_path"):
            raise ValueError(f"arm {arm['name']} needs --draft-model-path")
        cmd += ["--speculative-algorithm", arm["algo"],
                "--speculative-draft-model-path", opts["draft_model_path"]]
        if arm["num_draft_tokens"] is not None:
            cmd += ["--speculative-num-draft-tokens", str(arm["num_draft_tokens"])]
    cmd += shlex.split(opts.get("server_args") or "")
    return cmd


# ------------------------------------------------------------------------------------------ prompts
_CODE_FILES = ("heapq.py", "bisect.py", "textwrap.py", "functools.py", "json/decoder.py", "json/encoder.py",
               "argparse.py", "dataclasses.py", "statistics.py", "fractions.py", "random.py", "csv.py",
               "difflib.py", "string.py", "shlex.py", "glob.py", "fnmatch.py", "copy.py", "pprint.py",
               "calendar.py", "colorsys.py", "contextlib.py", "enum.py", "graphlib.py", "ipaddress.py",
               "operator.py", "queue.py", "sched.py", "secrets.py", "selectors.py", "tokenize.py",
               "collections/__init__.py", "concurrent/futures/_base.py", "email/utils.py",
               "http/cookies.py", "logging/__init__.py", "urllib/parse.py", "zipfile.py", "tarfile.py",
               "pathlib.py", "typing.py", "inspect.py", "ast.py", "gettext.py", "wave.py", "base64.py")
_CODE_TASKS = ("Explain what the following Python code does, then suggest one improvement.",
               "Write unit tests for the following Python code.",
               "Continue the following Python code.",
               "Rewrite the following Python code with type hints and docstrings.")
_PROSE_TASKS = ("Summarize the following documentation in plain words.",
                "Continue the following text.",
                "Write three exam questions (with answers) about the following text.",
                "Explain the following passage to a beginner, with an example.")


def textpair_heldout_files():
    """The text pair's held-out stdlib files (bench/textpair/corpus_manifest.tsv: sorted file i is
    held out iff i % 20 == 10): prompts for that pair must not come from its training files."""
    man = os.path.join(os.path.dirname(os.path.abspath(__file__)), "textpair", "corpus_manifest.tsv")
    rows = [line.split("\t")[0] for line in open(man) if not line.startswith("#")]
    return tuple(p for i, p in enumerate(rows) if i % 20 == 10)


def _stdlib_texts(files=None):
    """Code windows and prose paragraphs from the interpreter's standard library (offline,
    deterministic for a given Python version).  ``files``: restrict to these stdlib files (then
    the pydoc topics prose is used only if pydoc_data/topics.py is among them)."""
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    code = []
    for rel in (files if files is not None else _CODE_FILES):
        p = os.path.join(root, rel)
        if not os.path.isfile(p):
            continue
        lines = open(p, encoding="utf-8", errors="replace").read().splitlines()
        last = -10 ** 9
        for start, line in enumerate(lines):  # windows that start at a def / class, >= 40 lines apart
            if start - last < 40 or not line.lstrip().startswith(("def ", "class ")):
                continue
            chunk = "\n".join(lines[start:start + 32]).strip("\n")
            if len(chunk) > 400:
                code.append((f"stdlib/{rel}:{start + 1}", chunk))
                last = start
    prose = []
    try:
        if files is not None and "pydoc_data/topics.py" not in files:
            raise ImportError("pydoc topics not among the allowed files")
        from pydoc_data.topics import topics  # the language reference, as prose
        for key in sorted(topics):
            paras = [q.strip() for q in topics[key].split("\n\n")]
            buf = ""
            for q in paras:
                if len(q) < 80 or q.count("   ") > 6:  # skip headings and code/grammar blocks
                    continue
                buf = (buf + "\n\n" + q).strip()
                if len(buf) > 700:
                    prose.append((f"pydoc_data/topics:{key}", buf[:1600]))
                    buf = ""
    except Exception:  # noqa: BLE001 - an interpreter without pydoc_data: module docstrings only
        pass
    if len(prose) < 50:
        import ast
        for rel in (files if files is not None else _CODE_FILES):
            p = os.path.join(root, rel)
            if os.path.isfile(p):
                try:
                    doc = ast.get_docstring(ast.parse(open(p, encoding="utf-8", errors="replace").read()))
                except (SyntaxError, ValueError):  # e.g. lib2to3's Python 2 test data
                    continue
                if doc and len(doc) > 200:
                    prose.append((f"stdlib/{rel}:docstring", doc[:1600]))
    return code, prose


def make_prompts(n: int, template: str = "{prompt}", files=None) -> List[dict]:
    """n prompts, code and prose alternating (a few hundred distinct ones), deterministic."""
    code, prose = _stdlib_texts(files)
    if not code and not prose:
        raise RuntimeError("no standard-library sources found to build prompts from; pass --prompts")
    out = []
    i = 0
    while len(out) < n:
        pool, tasks, kind = (code, _CODE_TASKS, "code") if i % 2 == 0 or not prose else (prose, _PROSE_TASKS, "prose")
        if not pool:
            pool, tasks, kind = (prose, _PROSE_TASKS, "prose") if prose else (code, _CODE_TASKS, "code")
        j = i // 2
        src, body = pool[(j * 7) % len(pool)] if len(pool) > 1 else pool[0]
        task = tasks[j % len(tasks)]
        fence = f"```python\n{body}\n```" if kind == "code" else body
        text = template.replace("{prompt}", f"{task}\n\n{fence}\n")
        out.append(dict(text=text, source=src, kind=kind))
        i += 1
    return out


def load_prompts_file(path: str, template: str = "{prompt}") -> List[dict]:
    """JSON list or JSON lines; each item a string, {"text"|"prompt": str} or {"input_ids": [int]}."""
    with open(path) as f:
        raw = f.read()
    try:
        items = json.loads(raw)
        if isinstance(items, dict):
            items = items.get("prompts") or [items]
    except json.JSONDecodeError:
        items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    out = []
    for k, it in enumerate(items):
        if isinstance(it, str):
            it = {"text": it}
        if "input_ids" in it:
            out.append(dict(input_ids=[int(x) for x in it["input_ids"]], source=f"{os.path.basename(path)}:{k}"))
        else:
            text = it.get("text", it.get("prompt"))
            if not isinstance(text, str):
                raise ValueError(f"{path} item {k}: needs text, prompt or input_ids")
            out.append(dict(text=template.replace("{prompt}", text), source=f"{os.path.basename(path)}:{k}"))
    return out


def tokenize_prompts(prompts: List[dict], model_path: str, max_input_tokens: int, vocab: Optional[int] = None):
    """Token-id prompts for --skip-tokenizer-init servers: the model's tokenizer.json (tokenizers
    package) when present, else bytes + 3.  Truncated to max_input_tokens (the tail is kept)."""
    tok = None
    tj = os.path.join(model_path, "tokenizer.json")
    if os.path.isfile(tj):
        try:
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(tj)
        except Exception:  # noqa: BLE001
            tok = None
    how = "tokenizer.json" if tok is not None else "bytes+3"
    for p in prompts:
        if "input_ids" in p:
            ids = p["input_ids"]
        elif tok is not None:
            ids = tok.encode(p["text"]).ids
        else:
            ids = [b + 3 for b in p["text"].encode("utf-8")]
        if vocab:
            ids = [i % vocab for i in ids]
        p["input_ids"] = ids[-max_input_tokens:] if max_input_tokens else ids
    return how


def prompt_digest(prompts: List[dict]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p.get("input_ids") if "input_ids" in p else p["text"]).encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------ HTTP
def _conn(base_url: str, timeout: float):
    u = urllib.parse.urlparse(base_url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def http_json(base_url: str, method: str, path: str, body=None, timeout: float = 10.0):
    c = _conn(base_url, timeout)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        return r.status, data
    finally:
        c.close()


def stream_generate(base_url: str, payload: dict, timeout: float = 600.0) -> dict:
    """One streaming /generate.  SGLang 0.5.16 streams SSE lines ``data: {json}`` (output_ids are
    cumulative by default, deltas with --incremental-streaming-output; meta_info.completion_tokens is
    cumulative either way) and ends with ``data: [DONE]``.  Chunks are timed on arrival; only the
    token count is pulled out per chunk (a regex), the last chunk is parsed in full."""
    res = dict(ok=False, ttft=None, itl=[], latency=None, n_chunks=0, output_ids=None, meta={}, error=None)
    body = dict(payload, stream=True)
    t0 = time.perf_counter()
    chunks = []
    c = _conn(base_url, timeout)
    try:
        c.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:300].decode('utf-8', 'replace')}"
            return res
        prev_n, t_prev = 0, None
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            t = time.perf_counter()
            chunks.append(data)
            m = RE_COMPLETION.search(data)
            if m is None:
                if b'"error"' in data[:20]:
                    res["error"] = data[:300].decode("utf-8", "replace")
                continue
            n = int(m.group(1))
            new = n - prev_n
            if new <= 0:
                continue
            if t_prev is None:
                res["ttft"] = t - t0
            else:
                res["itl"].extend([(t - t_prev) / new] * new)
            t_prev, prev_n = t, n
            res["n_chunks"] += 1
        res["latency"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - recorded per request
        res["error"] = repr(e)[:300]
        return res
    finally:
        c.close()
    if res["error"] or not chunks:
        res["error"] = res["error"] or "empty stream"
        return res
    last = json.loads(chunks[-1])
    if "error" in last:
        res["error"] = json.dumps(last["error"])[:300]
        return res
    meta = last.get("meta_info") or {}
    ids = last.get("output_ids")
    ct = meta.get("completion_tokens")
    if ids is not None and ct is not None and len(ids) != ct:  # incremental streaming: deltas
        ids = []
        for d in chunks:
            ids.extend(json.loads(d).get("output_ids") or [])
    res["output_ids"] = ids
    res["meta"] = {k: meta.get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "spec_verify_ct",
                                            "spec_accept_length", "spec_num_correct_drafts")
                   if meta.get(k) is not None}
    fr = meta.get("finish_reason")
    res["meta"]["finish_reason"] = fr.get("type") if isinstance(fr, dict) else fr
    res["ok"] = True
    return res


def request_payload(prompt: dict, max_new_tokens: int) -> dict:
    p = {"sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens), "ignore_eos": True}}
    if "input_ids" in prompt:
        p["input_ids"] = prompt["input_ids"]
    else:
        p["text"] = prompt["text"]
    return p


# ------------------------------------------------------------------------------------------ stats
def pct(xs, q):
    """numpy's default (linear) percentile; None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def _ms(x):
    return None if x is None else round(1000.0 * x, 3)


def ids_sha(ids) -> Optional[str]:
    return None if ids is None else hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


def aggregate_level(c: int, results: List[dict], duration: float, prompts: List[dict], partial: bool) -> dict:
    ok = [r for r in results if r and r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    lat = [r["latency"] for r in ok]
    cts = [r["meta"].get("completion_tokens", len(r["output_ids"] or [])) for r in ok]
    vcts = [r["meta"].get("spec_verify_ct") or 0 for r in ok]
    tpot = [(r["latency"] - r["ttft"]) / (n - 1) for r, n in zip(ok, cts) if n > 1 and r["ttft"] is not None]
    steps = [((r["latency"] - r["ttft"]) / (v if v else max(1, n - 1))) for r, n, v in zip(ok, cts, vcts)
             if r["ttft"] is not None and n > 1]
    total_out = sum(cts)
    total_in = sum(r["meta"].get("prompt_tokens", 0) for r in ok)
    lv = dict(
        concurrency=c, num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        partial=partial, duration=round(duration, 4), total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=round(len(ok) / duration, 4) if duration > 0 else None,
        output_throughput=round(total_out / duration, 3) if duration > 0 else None,
        mean_ttft_ms=_ms(mean(ttft)), median_ttft_ms=_ms(pct(ttft, 50)), p99_ttft_ms=_ms(pct(ttft, 99)),
        mean_tpot_ms=_ms(mean(tpot)), median_tpot_ms=_ms(pct(tpot, 50)), p99_tpot_ms=_ms(pct(tpot, 99)),
        mean_itl_ms=_ms(mean(itl)), median_itl_ms=_ms(pct(itl, 50)), p90_itl_ms=_ms(pct(itl, 90)),
        p99_itl_ms=_ms(pct(itl, 99)), max_itl_ms=_ms(max(itl) if itl else None),
        mean_e2e_latency_ms=_ms(mean(lat)), median_e2e_latency_ms=_ms(pct(lat, 50)), p99_e2e_latency_ms=_ms(pct(lat, 99)),
        accept_length=round(total_out / sum(vcts), 4) if sum(vcts) else None,
        spec_verify_ct=sum(vcts), ms_per_step=_ms(mean(steps)),
        tokens_per_chunk=round(total_out / max(1, sum(r["n_chunks"] for r in ok)), 3),
        cached_tokens=sum(r["meta"].get("cached_tokens", 0) or 0 for r in ok),
        errors=[r["error"] for r in results if r and not r["ok"]][:3],
        per_request=dict(
            prompt=list(range(len(results))),
            ttft_ms=[_ms(r["ttft"]) if r else None for r in results],
            latency_ms=[_ms(r["latency"]) if r else None for r in results],
            completion_tokens=[(r["meta"].get("completion_tokens") if r and r["ok"] else None) for r in results],
            spec_verify_ct=[(r["meta"].get("spec_verify_ct") if r and r["ok"] else None) for r in results],
            n_chunks=[r["n_chunks"] if r else None for r in results],
            finish_reason=[(r["meta"].get("finish_reason") if r and r["ok"] else None) for r in results],
            output_ids_sha1=[ids_sha(r["output_ids"]) if r and r["ok"] else None for r in results]),
    )
    return lv


def run_level(base_url: str, prompts: List[dict], c: int, max_new_tokens: int, deadline_at: Optional[float],
              desc: str = "", progress: bool = True, timeout: float = 600.0):
    """Send prompts with at most c in flight; returns (results in prompt order, wall seconds, partial)."""
    results: List[Optional[dict]] = [None] * len(prompts)
    bar = _bar(len(prompts), desc, progress)
    stop = threading.Event()
    lock = threading.Lock()
    nxt = [0]
    t0 = time.perf_counter()
    t_end = [t0]

    def worker():
        while not stop.is_set():
            with lock:
                i = nxt[0]
                if i >= len(prompts):
                    return
                if deadline_at is not None and time.time() > deadline_at:
                    stop.set()
                    return
                nxt[0] += 1
            r = stream_generate(base_url, request_payload(prompts[i], max_new_tokens), timeout)
            results[i] = r
            with lock:
                t_end[0] = max(t_end[0], time.perf_counter())
            bar.update(1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(c, len(prompts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    partial = any(r is None for r in results)
    return results, t_end[0] - t0, partial


class _PrintBar:
    def __init__(self, total, desc):
        self.total, self.desc, self.n, self.t = total, desc, 0, time.time()
        self.lock = threading.Lock()

    def update(self, k=1):
        with self.lock:
            self.n += k
            if time.time() - self.t > 10 or self.n == self.total:
                self.t = time.time()
                print(f"  {self.desc}: {self.n}/{self.total}", flush=True)

    def close(self):
        pass


class _NoBar:
    def update(self, k=1):
        pass

    def close(self):
        pass


def _bar(total, desc, progress):
    if not progress:
        return _NoBar()
    try:
        from tqdm import tqdm
        tty = sys.stderr.isatty()
        return tqdm(total=total, desc=desc, leave=False, mininterval=0.5 if tty else 15, file=sys.stderr,
                    dynamic_ncols=tty, ncols=None if tty else 100)
    except ImportError:
        return _PrintBar(total, desc)


# ------------------------------------------------------------------------------------------ profile
def read_profile(path: str) -> List[dict]:
    if not path or not os.path.isfile(path):
        return []
    out = []
    for line in open(path):
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written while we read
    return out


def aggregate_profile(recs: List[dict]) -> Optional[dict]:
    """Rounds-weighted mean of the per-record medians (stage_ms, round_ms, host_ms) and of bs_mean."""
    recs = [r for r in recs if r.get("rounds")]
    if not recs:
        return None
    w = sum(r["rounds"] for r in recs)

    def wavg(get):
        vals = [(get(r), r["rounds"]) for r in recs if get(r) is not None]
        ww = sum(k for _, k in vals)
        return round(sum(v * k for v, k in vals) / ww, 4) if ww else None

    out = dict(rounds=w, records=len(recs), pids=len({r.get("pid") for r in recs}),
               bs_mean=wavg(lambda r: r.get("bs_mean")),
               round_ms=wavg(lambda r: (r.get("round_ms") or {}).get("median")),
               host_ms=wavg(lambda r: (r.get("host_ms") or {}).get("median")),
               stage_ms={s: wavg(lambda r, s=s: ((r.get("stage_ms") or {}).get(s) or {}).get("median"))
                         for s in STAGES})
    out["stage_ms"] = {k: v for k, v in out["stage_ms"].items() if v is not None}
    return out


# ------------------------------------------------------------------------------------------ servers
class PopenServer:
    """A launch_server process in its own process group (killed as a group)."""

    def __init__(self, cmd, env, log_path):
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid

    def poll(self):
        return self.proc.poll()

    def stop(self, grace: float = 15.0):
        try:
            pgid = os.getpgid(self.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        if pgid is not None:  # children (scheduler, detokenizer) may outlive the launcher
            t = time.time() + 5
            while time.time() < t:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.3)
            else:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


def popen_launcher(cmd, env, log_path):
    return PopenServer(cmd, env, log_path)


def log_tail(path, n=40):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 16000))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


HEALTH_POLL_S = 1.0


def wait_healthy(base_url: str, server, limit_s: float) -> Optional[str]:
    """None when /health_generate answers 200, else the reason."""
    t0 = time.time()
    while time.time() - t0 < limit_s:
        rc = server.poll()
        if rc is not None:
            return f"server exited with code {rc}"
        try:
            st, _ = http_json(base_url, "GET", "/health_generate", timeout=5)
            if st == 200:
                return None
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(HEALTH_POLL_S)
    return f"not healthy after {limit_s:.0f} s"


# ------------------------------------------------------------------------------------------ environment
def git_info():
    def g(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001
            return ""
    commit = os.environ.get("DDTREE_COMMIT") or g("rev-parse", "--short", "HEAD") or "unknown"  # the device copy may carry a stale .git
    dirty = bool(g("status", "--porcelain", "--untracked-files=no"))
    return commit, dirty


def pkg_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        pass
    try:  # a site-packages overlay without dist-info (the GPU host's kit): read version.py, no import
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec and spec.submodule_search_locations:
            vf = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", open(vf).read())
            return m.group(1) if m else None
    except Exception:  # noqa: BLE001
        return None
    return None


def env_info(python: str) -> dict:
    gpu = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        gpu = out.splitlines() or None
    except Exception:  # noqa: BLE001
        pass
    commit, dirty = git_info()
    vers = {}
    try:  # versions as the server's interpreter sees them (no sglang import: it takes 10+ s)
        code = ("import json,importlib.metadata as m\nd={}\nfor n in ('torch','triton','sglang','transformers',"
                "'sglang-kernel','flashinfer-python'):\n  try: d[n]=m.version(n)\n  except Exception: d[n]=None\n"
                "print(json.dumps(d))")
        vers = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout)
    except Exception:  # noqa: BLE001
        vers = {}
    for n in ("torch", "triton", "sglang"):
        vers[n] = vers.get(n) or pkg_version(n)
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                git_commit=commit, git_dirty=dirty, gpu=gpu, python=platform.python_version(),
                host=platform.node(), versions=vers, argv=sys.argv)


# ------------------------------------------------------------------------------------------ identity
def first_diff(a, b) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity_check(arm_outputs: Dict[str, Dict[int, List]], ref: str) -> dict:
    """arm_outputs[arm][c] = list of output ids (None = failed).  Per arm: compared, mismatched,
    errors, by_concurrency, first examples (prompt, first differing index)."""
    res = {"reference": ref, "arms": {}}
    if ref not in arm_outputs:
        res["note"] = f"reference arm {ref!r} was not measured: no identity check"
        return res
    R = arm_outputs[ref]
    cs = sorted(R)
    if cs:  # the reference against itself across concurrency (batch-shape numerics)
        c0 = cs[0]
        sc = {}
        for c in cs[1:]:
            n = min(len(R[c]), len(R[c0]))
            sc[str(c)] = sum(1 for i in range(n) if R[c][i] is not None and R[c0][i] is not None
                             and R[c][i] != R[c0][i])
        res["reference_vs_own_first_level"] = dict(level=c0, mismatched_by_concurrency=sc)
    for arm, outs in arm_outputs.items():
        if arm == ref:
            continue
        d = dict(compared=0, mismatched=0, errors=0, by_concurrency={}, examples=[])
        for c, ids in sorted(outs.items()):
            if c not in R:
                continue
            m = 0
            for i, x in enumerate(ids):
                y = R[c][i] if i < len(R[c]) else None
                if x is None or y is None:
                    d["errors"] += 1
                    continue
                d["compared"] += 1
                if x != y:
                    m += 1
                    if len(d["examples"]) < 8:
                        d["examples"].append(dict(concurrency=c, prompt=i, first_diff=first_diff(x, y),
                                                  len_arm=len(x), len_ref=len(y)))
            d["by_concurrency"][str(c)] = m
            d["mismatched"] += m
        d["identical"] = d["compared"] > 0 and d["mismatched"] == 0
        res["arms"][arm] = d
    return res


# ------------------------------------------------------------------------------------------ kernel sweep
def kernel_sweep_child(jsonl_path: str, bss, budgets, depths, seed: int = 0, tk=None) -> int:
    """Runs in its own process: GPU tree build vs the CPU heap, one JSON line per case.  ``tk``:
    bench/tree_kernels.py (its input maker and timers; injected by the tests)."""
    try:
        import torch
    except ImportError:
        print("kernel sweep skipped: torch is not importable", flush=True)
        return 2
    if tk is None and not torch.cuda.is_available():
        print("kernel sweep skipped: no CUDA device (the GPU tree build needs one)", flush=True)
        with open(jsonl_path, "a") as f:
            f.write(json.dumps({"skipped": "no CUDA device"}) + "\n")
        return 0
    if tk is None:
        import importlib.util
        spec = importlib.util.spec_from_file_location("tree_kernels", os.path.join(HERE, "tree_kernels.py"))
        tk = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tk)  # puts the checkout and tests/ on sys.path: fine, SGLang is never imported here
    from sglang_ddtree import ddtree
    import triton
    gen = torch.Generator().manual_seed(seed)
    with open(jsonl_path, "a") as f:
        f.write(json.dumps({"info": dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                         torch=torch.__version__, triton=triton.__version__)}) + "\n")
    for D in depths:
        for bs in bss:
            for budget in budgets:
                t0 = time.time()
                (lp, ids, roots), = tk.make_inputs(bs, D, budget, 1, gen)
                out = ddtree.build_tree(lp, ids, budget, root_tokens=roots, validate=False)
                ref = ddtree.build_tree(lp, ids, budget, root_tokens=roots, backend="reference", validate=False)
                exact = all(torch.equal(getattr(out, k).cpu(), getattr(ref, k).cpu())
                            for k in ("tokens", "depth", "parent", "num_nodes", "visibility"))
                gpu_med, gpu_min, gpu_max = tk.graph_time_us(
                    [lambda: ddtree.build_tree(lp, ids, budget, root_tokens=roots, validate=False, out=out)] * tk.REPS)
                reps = 3 if bs * budget >= 8192 else 10
                cpu_med = tk.cpu_time_us(lambda: ddtree.build_tree(lp, ids, budget, root_tokens=roots,
                                                                   backend="reference", validate=False), reps)
                row = dict(bs=bs, budget=budget, D=D, k=min(budget, 32000), V=32000, gpu_us=round(gpu_med, 3),
                           gpu_min_us=round(gpu_min, 3), cpu_heap_us=round(cpu_med, 2),
                           speedup=round(cpu_med / gpu_med, 2), exact=bool(exact), case_s=round(time.time() - t0, 2))
                with open(jsonl_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"sweep D={D:2d} bs={bs:3d} budget={budget:2d}: gpu {gpu_med:8.2f} us  cpu heap "
                      f"{cpu_med:10.1f} us  x{cpu_med / gpu_med:7.1f}  exact={exact}", flush=True)
    return 0


def run_kernel_sweep(python: str, limit_s: float, tmpdir: str) -> dict:
    path = os.path.join(tmpdir, "kernel_sweep.jsonl")
    cmd = [python, os.path.abspath(__file__), "--kernel-sweep-child", path]
    t0 = time.time()
    log = os.path.join(tmpdir, "kernel_sweep.log")
    with open(log, "wb") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "deadline"
    rows, info, skipped = [], None, None
    for line in open(path) if os.path.isfile(path) else []:
        d = json.loads(line)
        if "info" in d:
            info = d["info"]
        elif "skipped" in d:
            skipped = d["skipped"]
        else:
            rows.append(d)
    res = dict(status="ok" if rc == 0 and not skipped else ("skipped" if skipped else f"incomplete (rc={rc})"),
               seconds=round(time.time() - t0, 1), info=info, rows=rows,
               method="bench/tree_kernels.py make_inputs (drafter-like bf16 logits, V 32000, top-k = budget) + "
                      "graph_time_us (CUDA-graph replay of 10 calls, median per call) for the GPU build_tree "
                      "(tree + mask); cpu_time_us (wall clock median) for build_tree(backend='reference') on the "
                      "same CUDA inputs, device->host->device copies included")
    if skipped:
        res["note"] = skipped
    if rc not in (0,):
        res["log_tail"] = log_tail(log, 20)
    return res


# ------------------------------------------------------------------------------------------ main loop
def measure_arm(arm: dict, cmd: List[str], env: dict, base_url: str, prompts: List[dict], levels: List[int],
                per_level, args, deadline_at: Optional[float], launcher, tmpdir: str, profile_path: Optional[str]):
    rec = dict(name=arm["name"], kind=arm["kind"], algo=arm["algo"], budget=arm["budget"],
               num_draft_tokens=arm["num_draft_tokens"], command=cmd, command_str=shlex.join(cmd),
               env={k: v for k, v in env.items() if k.startswith("SGLANG_DDTREE")}, status="failed", levels=[])
    outputs = {}
    log_path = os.path.join(tmpdir, f"server_{arm['name']}.log")
    rec["log"] = log_path
    t0 = time.time()
    server = None
    try:
        server = launcher(cmd, env, log_path)
        limit = args.start_timeout
        if deadline_at is not None:
            limit = min(limit, max(5.0, deadline_at - time.time()))
        why = wait_healthy(base_url, server, limit)
        rec["start_s"] = round(time.time() - t0, 1)
        if why:
            rec["error"] = why
            rec["log_tail"] = log_tail(log_path)
            print(f"[{arm['name']}] FAILED to start: {why}", flush=True)
            return rec, outputs
        print(f"[{arm['name']}] up after {rec['start_s']} s", flush=True)
        # warm-up: the widest batch once (short), then one full-length request
        tw = time.time()
        wn = min(len(prompts), max(levels))
        if args.warmup:
            run_level(base_url, prompts[:wn], max(levels), min(16, args.max_new_tokens), None, progress=False)
            run_level(base_url, prompts[:args.warmup], 1, args.max_new_tokens, None, progress=False)
        rec["warmup_s"] = round(time.time() - tw, 1)
        prof_mark = len(read_profile(profile_path))
        for c in levels:
            if deadline_at is not None and time.time() > deadline_at - 1:
                rec.setdefault("skipped_levels", []).append(c)
                continue
            n = per_level(c)
            reps = []  # (level record, output ids) per repeat
            for rep in range(max(1, args.repeats)):
                if rep and deadline_at is not None and time.time() > deadline_at - 1:
                    break
                try:
                    http_json(base_url, "POST", "/flush_cache", timeout=30)
                except Exception:  # noqa: BLE001
                    pass
                # socket timeout per read: a hung server cannot hold the run much past the deadline
                tmo = 600.0 if deadline_at is None else max(30.0, min(600.0, deadline_at - time.time() + 30))
                res, dur, partial = run_level(base_url, prompts[:n], c, args.max_new_tokens, deadline_at,
                                              desc=f"{arm['name']} c={c}", progress=args.progress, timeout=tmo)
                lv = aggregate_level(c, res, dur, prompts[:n], partial)
                if profile_path:
                    time.sleep(0.2)
                    recs = read_profile(profile_path)
                    lv["stage_profile"] = aggregate_profile(recs[prof_mark:])
                    prof_mark = len(recs)
                    sp = lv["stage_profile"]
                    if sp and lv.get("ms_per_step") is not None and sp.get("round_ms") is not None:
                        sp["outside_ms"] = round(lv["ms_per_step"] - sp["round_ms"], 4)
                reps.append((lv, [r["output_ids"] if r and r["ok"] else None for r in res]))
                if partial:
                    break
            lv, outputs[c] = pick_repeat(reps)
            rec["levels"].append(lv)
            print(f"[{arm['name']}] c={c:3d} n={n}: {lv['output_throughput']} tok/s (repeats "
                  f"{lv['output_throughput_repeats']}), TTFT med {lv['median_ttft_ms']} ms, ITL med "
                  f"{lv['median_itl_ms']} p99 {lv['p99_itl_ms']} ms, accept {lv['accept_length']}, failed "
                  f"{lv['failed']}{' PARTIAL' if lv['partial'] else ''}", flush=True)
        if profile_path:
            rec["stage_profile_all"] = aggregate_profile(read_profile(profile_path)[:])
        rec["status"] = "ok" if rec["levels"] and all(lv["failed"] == 0 and not lv["partial"]
                                                      for lv in rec["levels"]) else "partial"
    except Exception as e:  # noqa: BLE001 - one arm's failure never stops the others
        rec["error"] = repr(e)[:1000]
        rec["log_tail"] = log_tail(log_path)
        print(f"[{arm['name']}] ERROR {e!r}", flush=True)
    except KeyboardInterrupt:
        rec["error"] = "interrupted"
        rec["status"] = "partial" if rec["levels"] else "failed"
        rec["_interrupted"] = True
    finally:
        if server is not None:
            ts = time.time()
            try:
                server.stop()
            except Exception as e:  # noqa: BLE001
                rec["stop_error"] = repr(e)
            rec["stop_s"] = round(time.time() - ts, 1)
        rec["total_s"] = round(time.time() - t0, 1)
    if rec.pop("_interrupted", False):
        raise _ArmInterrupted(rec, outputs)
    return rec, outputs


def pick_repeat(reps):
    """The repeat of a level with the median output throughput (of the complete ones), its outputs,
    every repeat's throughput, and how many requests' outputs differ between repeats."""
    full = [r for r in reps if not r[0]["partial"]] or reps
    ranked = sorted(full, key=lambda r: r[0]["output_throughput"] or 0.0)
    lv, outs = ranked[(len(ranked) - 1) // 2]
    lv = dict(lv, repeats=len(reps), median_of=len(full),
              output_throughput_repeats=[r[0]["output_throughput"] for r in reps],
              repeat_output_mismatches=sum(1 for _, o in reps for i, x in enumerate(o)
                                           if x is not None and i < len(outs) and outs[i] is not None
                                           and x != outs[i]))
    return lv, outs


class _ArmInterrupted(KeyboardInterrupt):
    def __init__(self, rec, outputs):
        super().__init__()
        self.rec, self.outputs = rec, outputs


def resolve_inputs(args):
    """Model paths, config, prompts (text or ids) from the arguments."""
    model, draft, token_ids = args.model_path, args.draft_model_path, args.token_ids
    cfg_path, cfg_keys = None, set()
    if args.pair == "text":  # the text-trained pair (bench/textpair/materialize.py MODELS_DIR)
        model = model or os.path.join(args.models_dir, "text_target")
        draft = draft or os.path.join(args.models_dir, "text_drafter")
        token_ids = True  # tokenized here with the pair's own tokenizer
    elif args.pair:
        model = model or os.path.join(args.models_dir, f"{args.pair}_target")
        draft = draft or os.path.join(args.models_dir, "drafter")
        token_ids = True
    if args.config:
        raw = load_yaml_config(args.config)
        model = model or raw.get("model-path")
        draft = draft or raw.get("speculative-draft-model-path")
        kept = {k: v for k, v in raw.items() if k not in CONFIG_DROP and k != "model-path"}
        cfg_keys = set(kept)
        fd, cfg_path = tempfile.mkstemp(prefix="ab_serve_cfg_", suffix=".yaml")
        import yaml
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(kept, f, sort_keys=False)
        if int(kept.get("max-running-requests", 10 ** 9)) < max(args.concurrency):
            print(f"WARNING: the config's max-running-requests {kept['max-running-requests']} < the largest "
                  f"concurrency {max(args.concurrency)}", flush=True)
    if not model and not args.config and not args.pair:
        # the default pair: the text-trained pair (bench/textpair), materialized in MODELS_DIR
        model = os.path.join(args.models_dir, "text_target")
        draft = draft or os.path.join(args.models_dir, "text_drafter")
        token_ids = True
        args.pair = "text"
    if not model:
        raise SystemExit("give --model-path, --pair or --config")
    if args.prompts:
        prompts = load_prompts_file(args.prompts, args.prompt_template)
        source = os.path.abspath(args.prompts)
    elif args.pair == "text":
        prompts = make_prompts(args.num_prompts, args.prompt_template, files=textpair_heldout_files())
        source = f"generated from the text pair's held-out files of the Python {platform.python_version()} " \
                 "standard library (bench/textpair/corpus_manifest.tsv; code windows and module docstrings)"
    else:
        prompts = make_prompts(args.num_prompts, args.prompt_template)
        source = f"generated from the Python {platform.python_version()} standard library (code windows and " \
                 "pydoc_data topics prose, alternating)"
    prompts = prompts[: args.num_prompts]
    if any("input_ids" in p for p in prompts):
        token_ids = True
    how = None
    if token_ids:
        how = tokenize_prompts(prompts, model, args.max_input_tokens, args.vocab_size)
    return model, draft, token_ids, cfg_path, cfg_keys, prompts, source, how


def run(args, launcher: Callable = popen_launcher) -> dict:
    t_start = time.time()
    deadline_at = t_start + args.deadline if args.deadline else None
    arms = parse_arms(args.arms)
    levels = list(args.concurrency)
    maxc = max(levels)
    model, draft, token_ids, cfg_path, cfg_keys, prompts, source, how = resolve_inputs(args)
    N = len(prompts)

    def per_level(c):
        if args.requests_per_level == "all":
            return N
        if args.requests_per_level == "auto":
            return min(N, max(16, 4 * c))
        return min(N, int(args.requests_per_level))

    tmpdir = args.workdir or tempfile.mkdtemp(prefix="ab_serve_")
    os.makedirs(tmpdir, exist_ok=True)
    python = args.python or sys.executable
    opts = dict(python=python, model_path=model, draft_model_path=draft, maxc=maxc, token_ids=token_ids,
                mem_fraction=args.mem_fraction_static, server_args=args.server_args,
                cuda_graph_bs=[int(x) for x in args.cuda_graph_bs.split(",")] if args.cuda_graph_bs else None)
    doc = dict(
        kind="ab_serve", meta=env_info(python) if not args.no_env_probe else dict(argv=sys.argv),
        settings=dict(model_path=model, draft_model_path=draft, pair=args.pair, config=args.config,
                      arms=[a["name"] for a in arms], concurrency=levels, max_new_tokens=args.max_new_tokens,
                      requests_per_level={str(c): per_level(c) for c in levels}, num_prompts=N,
                      greedy="temperature 0, ignore_eos, stream", token_ids=token_ids, server_args=args.server_args,
                      profile_every=args.profile_every, deadline_s=args.deadline, reference_arm=args.reference_arm,
                      repeats=args.repeats),
        prompts=dict(source=source, count=N, kind="input_ids" if token_ids else "text", tokenized_with=how,
                     sha256_16=prompt_digest(prompts),
                     mean_input_len=round(mean([len(p["input_ids"]) if token_ids else len(p["text"])
                                                for p in prompts]), 1),
                     input_len_unit="tokens" if token_ids else "characters",
                     kinds={k: sum(1 for p in prompts if p.get("kind") == k) for k in ("code", "prose")},
                     sources=[p.get("source") for p in prompts]),
        arms=[], identity=None, kernel_sweep=None,
        definitions=dict(
            output_throughput="total completion tokens of the level / wall time of the level (first send to last byte)",
            ttft="time from sending the request to the first streamed chunk that carries a token",
            itl="gap between consecutive chunks / tokens in the chunk, counted once per token (sglang.bench_serving)",
            accept_length="sum(completion_tokens) / sum(spec_verify_ct) (SGLang's spec_accept_length)",
            ms_per_step="(e2e - TTFT) / (spec_verify_ct, or completion_tokens - 1 without speculation), "
                        "mean over requests: client-side time of one decode round",
            stage_profile="rounds-weighted mean of the per-record medians of sglang_ddtree.profiling records "
                          "written during the level (GPU time between CUDA events); draft includes the top-K; "
                          "outside_ms = ms_per_step - round_ms"))
    if args.save_prompts:
        with open(args.save_prompts, "w") as f:
            for p in prompts:
                f.write(json.dumps({k: p[k] for k in ("text", "input_ids", "source") if k in p}) + "\n")
    outputs: Dict[str, Dict[int, list]] = {}
    reserve = args.reserve_s + (args.sweep_s if args.kernel_sweep else 0)
    print(f"ab_serve: {len(arms)} arms x concurrency {levels}, {N} prompts ({doc['prompts']['kind']}), "
          f"max_new_tokens {args.max_new_tokens}, work dir {tmpdir}", flush=True)
    if args.dry_run:
        for i, arm in enumerate(arms):
            print(f"[{arm['name']}] {shlex.join(build_server_cmd(arm, opts, args.port + 10 * i, cfg_path, cfg_keys))}")
        print(json.dumps({k: v for k, v in doc["prompts"].items() if k != "sources"}))
        if cfg_path:
            os.remove(cfg_path)
        return doc
    try:
        _run_arms(doc, arms, opts, args, levels, per_level, prompts, outputs, deadline_at, reserve, launcher,
                  tmpdir, cfg_path, cfg_keys, t_start)
    except KeyboardInterrupt:  # SIGINT / SIGTERM: the running server was stopped; keep what was measured
        doc["interrupted"] = True
        print("interrupted: writing what was measured", flush=True)
    if args.kernel_sweep and not doc.get("interrupted"):
        left = (deadline_at - time.time() - 5) if deadline_at else args.sweep_s * 4
        if left > 20:
            print(f"kernel sweep (limit {left:.0f} s)", flush=True)
            doc["kernel_sweep"] = run_kernel_sweep(python, left, tmpdir)
        else:
            doc["kernel_sweep"] = dict(status="skipped", note="deadline", rows=[])
    doc["identity"] = identity_check(outputs, args.reference_arm)
    doc["elapsed_s"] = round(time.time() - t_start, 1)
    if args.save_output_ids:
        doc["output_ids"] = {a: {str(c): v for c, v in o.items()} for a, o in outputs.items()}
        if token_ids:  # what bench/ab_divergence.py needs to replay any first divergence
            doc["prompt_ids"] = [p["input_ids"] for p in prompts]
    write_outputs(doc, args.out, plot=not args.no_plot)
    if cfg_path:
        os.remove(cfg_path)
    return doc


def _run_arms(doc, arms, opts, args, levels, per_level, prompts, outputs, deadline_at, reserve, launcher, tmpdir,
              cfg_path, cfg_keys, t_start):
    for i, arm in enumerate(arms):
        arm_deadline = deadline_at - reserve if deadline_at else None
        if arm_deadline is not None and arm_deadline - time.time() < args.min_arm_s:
            doc["arms"].append(dict(name=arm["name"], kind=arm["kind"], algo=arm["algo"], budget=arm["budget"],
                                    status="skipped", error=f"deadline: {arm_deadline - time.time():.0f} s left "
                                                            f"< --min-arm-s {args.min_arm_s}"))
            print(f"[{arm['name']}] SKIPPED (deadline)", flush=True)
            continue
        port = args.port + 10 * i
        cmd = build_server_cmd(arm, opts, port, cfg_path, cfg_keys)
        env = dict(os.environ)
        prof = None
        if arm["kind"].startswith("ddtree") and not args.no_stage_profile:
            prof = os.path.join(tmpdir, f"profile_{arm['name']}.jsonl")
            if os.path.exists(prof):
                os.remove(prof)
            env["SGLANG_DDTREE_PROFILE_FILE"] = prof
            env["SGLANG_DDTREE_PROFILE_EVERY"] = str(args.profile_every)
        print(f"[{arm['name']}] ({i + 1}/{len(arms)}) {shlex.join(cmd)}", flush=True)
        try:
            rec, outs = measure_arm(arm, cmd, env, f"http://127.0.0.1:{port}", prompts, levels, per_level, args,
                                    arm_deadline, launcher, tmpdir, prof)
        except _ArmInterrupted as e:
            doc["arms"].append(e.rec)
            if e.outputs:
                outputs[arm["name"]] = e.outputs
            raise
        doc["arms"].append(rec)
        if outs:
            outputs[arm["name"]] = outs
        doc["identity"] = identity_check(outputs, args.reference_arm)
        doc["elapsed_s"] = round(time.time() - t_start, 1)
        write_outputs(doc, args.out, plot=False)


# ------------------------------------------------------------------------------------------ report
def _f(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _runs(doc):
    return doc["runs"] if doc.get("kind") == "ab_serve_merged" else [doc]


def _valid(lv) -> bool:
    """A complete level that was not marked invalid (``merge --invalid``: a measurement known to be broken)."""
    return bool(lv) and not lv.get("partial") and not lv.get("invalid")


def _level(arm, c):
    for lv in arm.get("levels") or []:
        if lv["concurrency"] == c:
            return lv
    return None


PAIR_TITLES = {"text": "text-trained pair (bench/textpair)", "gqa": "tiny GQA pair", "mla": "tiny MLA + MoE pair"}


def _identity_cell(run, arm_name):
    """'identical (n)', or 'k of n differ' (+ the text pair's classification)."""
    idn = (run.get("identity") or {})
    if arm_name == idn.get("reference"):
        return "reference"
    d = (idn.get("arms") or {}).get(arm_name)
    if not d or not d.get("compared"):
        return "-"
    if not d["mismatched"]:
        return f"identical ({d['compared']})"
    txt = f"{d['mismatched']} of {d['compared']} differ"
    c = ((idn.get("classification") or {}).get("arms") or {}).get(arm_name)
    if c:
        txt += (f": all {c['near_tie']} near ties" if not c["error"] else
                f": {c['near_tie']} near ties, **{c['error']} errors**")
    return txt


def summary_rows(doc: dict) -> List[dict]:
    """One row per (run, arm) of a merged (or single) result: pair, run id, output tok/s per concurrency,
    x base of the same run, accept length, identity."""
    rows = []
    for run in _runs(doc):
        s = run.get("settings") or {}
        arms = run.get("arms") or []
        by = {a["name"]: a for a in arms}
        for a in arms:
            if a.get("status") == "skipped":  # never started (deadline): measured in another run, if at all
                continue
            cells = {}
            for c in s.get("concurrency") or []:
                lv, blv = _level(a, c), _level(by["base"], c) if "base" in by else None
                t = lv.get("output_throughput") if _valid(lv) else None
                bt = blv.get("output_throughput") if _valid(blv) else None
                cells[c] = dict(tput=t, x_base=(t / bt) if t and bt else None,
                                accept=lv.get("accept_length") if lv else None,
                                invalid=bool(lv and lv.get("invalid")))
            rows.append(dict(pair=s.get("pair"), run=run.get("run_id", "1"), arm=a["name"], levels=cells,
                             identity=_identity_cell(run, a["name"]), status=a.get("status")))
    return rows


def render_summary(doc: dict, h: str = "##") -> List[str]:
    """Per pair: every arm of every run, output tok/s (x the same run's base) at each concurrency,
    accepted tokens per round, and the token-identity verdict.  The README's results table."""
    rows = summary_rows(doc)
    L = []
    for pair in dict.fromkeys(r["pair"] for r in rows):
        pr = [r for r in rows if r["pair"] == pair]
        levels = sorted({c for r in pr for c in r["levels"]})
        nruns = len({r["run"] for r in pr})
        L += [f"{h} {PAIR_TITLES.get(pair, pair)}", "",
              "| arm | " + ("run | " if nruns > 1 else "") + " | ".join(f"c={c}" for c in levels)
              + " | accepted / round | outputs vs base |",
              "|---|" + ("---|" if nruns > 1 else "") + "---:|" * len(levels) + "---:|---|"]
        for r in pr:
            cells = []
            for c in levels:
                v = r["levels"].get(c) or {}
                if v.get("invalid"):
                    cells.append("invalid")
                elif v.get("tput") is None:
                    cells.append("-")
                elif r["arm"] == "base":
                    cells.append(f"{v['tput']:.0f}")
                elif v.get("x_base") is None:
                    cells.append(f"{v['tput']:.0f} (-)")
                else:
                    cells.append(f"{v['tput']:.0f} ({v['x_base']:.2f}x)")
            acc = [r["levels"][c].get("accept") for c in levels if (r["levels"].get(c) or {}).get("accept")]
            acc_txt = f"{min(acc):.2f}-{max(acc):.2f}" if acc and min(acc) != max(acc) else (f"{acc[0]:.2f}" if acc else "-")
            L.append(f"| {r['arm']} | " + (f"{r['run']} | " if nruns > 1 else "") + " | ".join(cells)
                     + f" | {acc_txt} | {r['identity']} |")
        L.append("")
    return L


def render_markdown(doc: dict) -> str:
    L = []
    runs = _runs(doc)
    if doc.get("kind") == "ab_serve_merged":
        L += ["# A/B serving benchmark", "", f"{len(runs)} runs merged by `python bench/ab_serve.py --merge`. "
              "Output tokens per second at each concurrency (x the base arm of the same run: runs are never "
              "compared with each other), accepted tokens per verify round, and whether every output equals "
              "the base arm's. Details of each run follow the summary.", ""]
        L += ["## Summary", ""] + render_summary(doc, h="###")
    for run in runs:
        L += _render_run(run, top=doc.get("kind") != "ab_serve_merged")
    ks = doc.get("kernel_sweep") if doc.get("kind") == "ab_serve_merged" else None
    if ks:
        L += _render_sweep(ks)
    return "\n".join(L).rstrip() + "\n"


def _render_run(doc, top=True):
    s, m, p = doc["settings"], doc.get("meta", {}), doc["prompts"]
    title = (s.get("pair") == "text" and "the text-trained pair (bench/textpair)"
             or s.get("pair") and f"tiny {s['pair']} pair" or os.path.basename(str(s.get("model_path"))))
    h = "##" if top else "###"
    v = m.get("versions") or {}
    stamp = (f"{m.get('date', '?')} · GPU {', '.join(m.get('gpu') or ['?'])} · torch {v.get('torch')} · triton "
             f"{v.get('triton')} · sglang {v.get('sglang')} · commit {m.get('git_commit')}"
             f"{' (dirty)' if m.get('git_dirty') else ''}")
    if not doc["arms"]:  # --kernel-sweep-only
        L = [("# " if top else "## ") + "Tree build: GPU kernels vs the CPU heap", "", stamp, "",
             "Command: `" + " ".join(m.get("argv") or []) + "`."]
        if doc.get("kernel_sweep"):
            L += _render_sweep(doc["kernel_sweep"], h)
        return L + [""]
    L = [("# " if top else "## ") + f"A/B serving benchmark: {title}"
         + (f", run {doc['run_id']}" if doc.get("run_id") else ""), ""]
    kinds = {k: n for k, n in (p.get("kinds") or {}).items() if n}
    L += [f"{stamp} · {doc.get('elapsed_s')} s", "",
          f"Target `{s['model_path']}`, drafter `{s['draft_model_path']}`. {p['count']} prompts "
          f"({p['kind']}{'; ' + ', '.join(f'{n} {k}' for k, n in kinds.items()) if kinds else ''}; mean input {p['mean_input_len']} {p.get('input_len_unit', '')}; "
          f"sha256 {p['sha256_16']}), {p['source']}. Greedy ({s['greedy']}), max_new_tokens "
          f"{s['max_new_tokens']}; requests per level {s['requests_per_level']}; each level run "
          f"{s.get('repeats', 1)} time(s), the run with the median output tok/s reported. "
          "Command: `" + " ".join(m.get("argv") or []) + "`.", ""]
    arms = doc["arms"]
    levels = s["concurrency"]
    by = {a["name"]: a for a in arms}
    hdr = "| arm | " + " | ".join(f"c={c}" for c in levels) + " |"
    sep = "|---|" + "---:|" * len(levels)

    def tput(name, c):
        a = by.get(name)
        lv = _level(a, c) if a else None
        return lv.get("output_throughput") if _valid(lv) else None

    L += [f"{h} Output tokens per second (x base, x dflash)", "", hdr, sep]
    for a in arms:
        cells = []
        for c in levels:
            t = tput(a["name"], c)
            if t is None:
                lv = _level(a, c)
                cells.append("-" if lv is None else "partial" if lv.get("partial") else
                             f"invalid: {str(lv.get('invalid'))[:60]}")
                continue
            r = []
            for ref in ("base", "dflash"):
                rt = tput(ref, c)
                if rt and a["name"] != ref:
                    r.append(f"{t / rt:.2f}x")
                elif a["name"] == ref:
                    r.append("1.00x")
                else:
                    r.append("-")
            cells.append(f"{t:.0f} ({' / '.join(r)})")
        L.append(f"| {a['name']} | " + " | ".join(cells) + " |")
    def level_table(title, cell):
        """One row per arm, one column per concurrency; cell(level record) -> text."""
        L.extend(["", f"{h} {title}", "", hdr, sep])
        for a in arms:
            L.append(f"| {a['name']} | " + " | ".join(
                "-" if not lv else cell(lv) for lv in (_level(a, c) for c in levels)) + " |")

    repeated = any((lv.get("repeats") or 1) > 1 for a in arms for lv in a.get("levels") or [])
    if repeated:
        level_table("Every repeat's output tok/s (the median one is reported above)",
                    lambda lv: " / ".join(f"{x:.0f}" for x in lv.get("output_throughput_repeats") or []
                                          if x is not None) or "-")
    level_table("Latency: TTFT median / p99, ITL median / p99 (ms)",
                lambda lv: f"{_f(lv['median_ttft_ms'])} / {_f(lv['p99_ttft_ms'])} · "
                           f"{_f(lv['median_itl_ms'], 2)} / {_f(lv['p99_itl_ms'], 2)}")
    level_table("Accepted tokens per verify round; client ms per decode round",
                lambda lv: f"{_f(lv['accept_length'], 2)} · {_f(lv['ms_per_step'], 2)} ms")
    idn = doc.get("identity") or {}
    L += ["", f"{h} Token identity against `{idn.get('reference')}` (same prompt, same concurrency)", ""]
    if idn.get("note"):
        L += [idn["note"], ""]
    if idn.get("arms"):
        L += ["| arm | requests compared | mismatching | errors | by concurrency | first mismatches (c, prompt, index) |",
              "|---|---:|---:|---:|---|---|"]
        for name, d in idn["arms"].items():
            ex = ", ".join(f"({e['concurrency']}, {e['prompt']}, {e['first_diff']})" for e in d["examples"][:4])
            L.append(f"| {name} | {d['compared']} | {'**' + str(d['mismatched']) + '**' if d['mismatched'] else 0} | "
                     f"{d['errors']} | {d['by_concurrency']} | {ex or '-'} |")
        rs = idn.get("reference_vs_own_first_level")
        if rs:
            L += ["", f"`{idn['reference']}` against itself at c={rs['level']} (mismatching requests per level): "
                      f"{rs['mismatched_by_concurrency']}."]
    if repeated:
        rep = {a["name"]: sum(lv.get("repeat_output_mismatches") or 0 for lv in a.get("levels") or [])
               for a in arms}
        L += ["", "Outputs that differ between the repeats of one arm and level (same server): "
                  + ", ".join(f"{k} {v}" for k, v in rep.items()) + "."]
    cls = idn.get("classification")
    if cls:
        L += _render_classification(cls, h)
    # stage split
    rows = []
    for a in arms:
        for lv in a.get("levels") or []:
            sp = lv.get("stage_profile")
            if sp:
                st = sp["stage_ms"]
                rows.append(f"| {a['name']} | {lv['concurrency']} | {_f(sp['bs_mean'])} | {sp['rounds']} | "
                            + " | ".join(_f(st.get(k), 3) for k in STAGES)
                            + f" | {_f(sp['round_ms'], 3)} | {_f(sp['host_ms'], 3)} | {_f(lv.get('ms_per_step'), 3)} | "
                              f"{_f(sp.get('outside_ms'), 3)} |")
    L += ["", f"{h} Round time split of the DDTREE arms (ms, GPU time between CUDA events, per-record medians "
              "weighted by rounds)", ""]
    if rows:
        L += ["draft includes the drafter's top-K head; tree = build_tree + mask; host = the worker call's host wall "
              "time; client = ms per decode round seen by the client; outside = client - round (scheduler, "
              "output processing, HTTP).", "",
              "| arm | c | bs mean | rounds | " + " | ".join(STAGES) + " | round | host | client | outside |",
              "|---|---:|---:|---:|" + "---:|" * (len(STAGES) + 4)] + rows
    else:
        L += ["No stage records (no DDTREE arm measured, or --no-stage-profile)."]
    bad = [a for a in arms if a.get("status") != "ok"]
    if bad:
        L += ["", f"{h} Arms not fully measured", ""]
        for a in bad:
            L.append(f"- `{a['name']}`: {a.get('status')}: {a.get('error', '')}"
                     + (f" (skipped levels {a['skipped_levels']})" if a.get("skipped_levels") else ""))
            if a.get("log_tail"):
                L += ["", "```", "\n".join(a["log_tail"].splitlines()[-12:]), "```"]
    L += ["", f"{h} Server command lines", ""]
    for a in arms:
        if a.get("command_str"):
            env = " ".join(f"{k}=..." for k in (a.get("env") or {}))
            L.append(f"- `{a['name']}` (up in {a.get('start_s')} s): `{(env + ' ') if env else ''}{a['command_str']}`")
    if doc.get("kernel_sweep"):
        L += _render_sweep(doc["kernel_sweep"], h)
    L += ["", f"{h} Definitions", ""] + [f"- {k}: {v}" for k, v in (doc.get("definitions") or {}).items()]
    return L + [""]


def _render_classification(cls, h):
    """bench/ab_divergence.py's verdict on every mismatch (text pair: bf16 near ties vs errors)."""
    cal = cls.get("calibration") or {}
    L = ["", f"{h} Why outputs differ: every first divergence classified", "", cls["method"] + "."
         + (f" Noise quantiles over {cal['positions']} positions: {cal['quantiles']}." if cal else ""), "",
         "| compared | requests | diverged | near ties | errors |", "|---|---:|---:|---:|---:|"]
    rows = list(cls["arms"].items())
    r = cls.get("reference_vs_own_first_level")
    if r:
        rows.append((f"{cls['reference']} (c>1) vs {cls['reference']} (c={r['level']})", r))
    for name, d in rows:
        L.append(f"| {name} | {d['compared']} | {d['diverged']} | {d['near_tie']} | "
                 f"{'**' + str(d['error']) + '**' if d['error'] else 0} |")
    for pair in cls.get("cpu_vs_gpu") or []:
        L += ["", f"`{pair['cpu']}` and `{pair['gpu']}` (the CPU heap and the GPU kernels build the same trees): "
                  f"{pair['identical']} of {pair['compared']} outputs identical; by concurrency "
                  f"{pair['identical_by_concurrency']}."]
    errs = [x for _, d in rows for x in d["rows"] if not x.get("near_tie")]
    if errs:
        L += ["", "Errors (a token outside the noise band of the target's top logit):", "",
              "| arm | c | prompt | index | reference token | arm token | logit gap | below top | target top-2 gap |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for x in errs[:20]:
            L.append(f"| {x['arm']} | {x['concurrency']} | {x['prompt']} | {x['pos']} | {x.get('ref_tok', '-')} | "
                     f"{x.get('out_tok', '-')} | {x.get('gap', x.get('note', '-'))} | {x.get('below_top', '-')} | "
                     f"{x.get('top2_gap', '-')} |")
    gaps = sorted(x.get("below_top", x["gap"]) for _, d in rows for x in d["rows"] if x.get("near_tie"))
    if gaps:
        L += ["", f"Near ties: {len(gaps)}; the lower token's distance below the top fp32 logit "
                  f"{gaps[0]}-{gaps[-1]} (median {gaps[len(gaps) // 2]})."]
    return L


def _render_sweep(ks, h="##"):
    L = ["", f"{h} Kernel level: GPU tree build vs the CPU heap (same inputs, same card)", ""]
    if ks.get("status") != "ok":
        L += [f"Status: {ks.get('status')}. {ks.get('note', '')}", ""]
    info = ks.get("info") or {}
    if ks.get("rows"):
        L += [f"{info.get('gpu', '')} · torch {info.get('torch')} · triton {info.get('triton')}. {ks.get('method', '')}.", "",
              "| D | bs | budget | GPU build+mask (us) | CPU heap (us) | speed-up | identical |",
              "|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in ks["rows"]:
            L.append(f"| {r['D']} | {r['bs']} | {r['budget']} | {r['gpu_us']:.2f} | {r['cpu_heap_us']:.0f} | "
                     f"{r['speedup']:.0f}x | {'yes' if r['exact'] else '**NO**'} |")
    return L


def write_outputs(doc: dict, out: str, plot: bool = True):
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    with open(out + ".json", "w") as f:  # a merged report is written compact (it is committed whole)
        json.dump(doc, f, **({"separators": (",", ":")} if doc.get("kind") == "ab_serve_merged" else {"indent": 1}))
    with open(out + ".md", "w") as f:
        f.write(render_markdown(doc))
    if plot:
        try:
            sys.path.insert(0, HERE)
            import ab_plot
            ab_plot.plot(doc, out + ".png")
            print(f"wrote {out}.png", flush=True)
        except ImportError as e:
            print(f"no plot ({e}); run `python bench/ab_plot.py {out}.json` where matplotlib is installed", flush=True)
        except Exception as e:  # noqa: BLE001 - the numbers are written already
            print(f"plot failed: {e!r}", flush=True)
        finally:
            if sys.path and sys.path[0] == HERE:
                sys.path.pop(0)
    print(f"wrote {out}.json, {out}.md", flush=True)


def merge(out: str, paths: List[str], invalid: Optional[List[List[str]]] = None):
    """One report from several runs.  invalid: [source file name, arm, concurrency, reason] entries that
    mark a measured level as broken (kept in the JSON, left out of every ratio)."""
    runs, sources, sweep = [], [], None  # sources[i]: the file name runs[i] came from
    for p in paths:
        d = json.load(open(p))
        for r in _runs(d):
            if r.get("kernel_sweep") and (r["kernel_sweep"].get("rows")) and sweep is None:
                sweep = r["kernel_sweep"]
            if r.get("arms"):  # a --kernel-sweep-only run contributes its sweep only
                runs.append(r)
                sources.append(os.path.basename(p))
    unknown = sorted({src for src, *_ in invalid or []} - set(sources))
    if unknown:
        raise SystemExit(f"--invalid names files that were not merged: {unknown}")
    for src, arm, c, why in invalid or []:
        lv = next((_level(a, int(c)) for s, r in zip(sources, runs) if s == src for a in r["arms"]
                   if a["name"] == arm and _level(a, int(c))), None)
        if lv is None:
            raise SystemExit(f"--invalid {src} {arm} {c}: no such level")
        lv["invalid"] = why
    count = {}
    for r in runs:  # run ids per pair: text-1, text-2, ...
        pair = (r.get("settings") or {}).get("pair") or "run"
        count[pair] = count.get(pair, 0) + 1
        r["run_id"] = str(count[pair])
    doc = dict(kind="ab_serve_merged", runs=runs, kernel_sweep=sweep, sources=[os.path.basename(p) for p in paths],
               per_request_file=os.path.basename(out) + ".per_request.json.gz (keys: run index/arm/concurrency)")
    per_request = {}
    for k, r in enumerate(runs):  # the sweep is reported once, at the end; output ids stay in the run files
        r.pop("kernel_sweep", None)
        r.pop("output_ids", None)
        r.pop("prompt_ids", None)
        for a in r.get("arms") or []:  # per-request columns: a gzip file beside the report (it stays small)
            for lv in a.get("levels") or []:
                if "per_request" in lv:
                    per_request[f"{k}/{a['name']}/{lv['concurrency']}"] = lv.pop("per_request")
    if per_request:
        import gzip
        with gzip.open(out + ".per_request.json.gz", "wt") as f:
            json.dump(per_request, f, separators=(",", ":"))
    write_outputs(doc, out, plot=True)
    return doc


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--draft-model-path")
    ap.add_argument("--pair", choices=("text", "gqa", "mla"),
                    help="a test-bed pair: text (the stdlib-trained pair, the default when no model is "
                         "given: MODELS_DIR/text_target + text_drafter from bench/textpair/materialize.py), "
                         "or the toy gqa / mla pairs (MODELS_DIR/<pair>_target + drafter); token ids")
    ap.add_argument("--models-dir", default="/tmp/models")
    ap.add_argument("--config", help="an SGLang YAML config (configs/*.yaml): its speculative/host/port keys are dropped")
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--prompts", help="JSON list / JSON lines: strings, {text|prompt} or {input_ids}")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--requests-per-level", default="auto", help="auto = min(N, max(16, 4c)), all = N, or a number")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each level (radix cache flushed before each); "
                                                           "the one with the median output tok/s is reported")
    ap.add_argument("--max-input-tokens", type=int, default=512, help="token-id prompts are cut to this (tail kept)")
    ap.add_argument("--vocab-size", type=int, default=None, help="fold token ids into the vocabulary (ids mode)")
    ap.add_argument("--token-ids", action="store_true", help="send input_ids (tokenized here) + --skip-tokenizer-init")
    ap.add_argument("--prompt-template", default="{prompt}", help='e.g. a chat format around "{prompt}"')
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ab_h200"))
    ap.add_argument("--server-args", default="", help="extra flags for every server (appended last: they win)")
    ap.add_argument("--python", default=None, help="interpreter that runs launch_server (default: this one)")
    ap.add_argument("--port", type=int, default=31000, help="arm i listens on port + 10 i")
    ap.add_argument("--mem-fraction-static", type=float, default=0.6)
    ap.add_argument("--cuda-graph-bs", default=None, help="decode CUDA-graph batch sizes, e.g. 1,2,4,8,16,32,64 "
                                                          "(default: SGLang's list up to max concurrency)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run; arms that no longer fit are skipped")
    ap.add_argument("--min-arm-s", type=float, default=75.0, help="do not start an arm with less time than this left")
    ap.add_argument("--reserve-s", type=float, default=10.0, help="kept free at the end of the deadline")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--warmup", type=int, default=2, help="full-length requests at c=1 after a short "
                                                          "max-concurrency batch (0: no warm-up)")
    ap.add_argument("--profile-every", type=int, default=16, help="SGLANG_DDTREE_PROFILE_EVERY for DDTREE arms")
    ap.add_argument("--no-stage-profile", action="store_true")
    ap.add_argument("--reference-arm", default="base")
    ap.add_argument("--kernel-sweep", action="store_true", help="also time GPU build_tree vs the CPU heap (bs 1..256)")
    ap.add_argument("--sweep-s", type=float, default=120.0, help="time reserved for --kernel-sweep under --deadline")
    ap.add_argument("--kernel-sweep-only", action="store_true", help="only the kernel sweep (no servers)")
    ap.add_argument("--workdir", default=None, help="server logs and profile files (default: a temp dir)")
    ap.add_argument("--save-prompts", default=None, help="write the prompts used as JSON lines")
    ap.add_argument("--save-output-ids", action="store_true", help="keep every output id list in the JSON")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the server command lines and the prompt summary")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--no-env-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report-only", metavar="JSON", help="rewrite JSON's markdown (and nothing else)")
    ap.add_argument("--merge", nargs="+", metavar=("OUT", "JSON"), help="OUT a.json b.json ...: one report")
    ap.add_argument("--invalid", nargs=4, action="append", metavar=("FILE", "ARM", "C", "REASON"),
                    help="with --merge: mark one measured level of FILE (a merged file's name) as broken")
    ap.add_argument("--summary", metavar="JSON", help="print the summary tables of a result (the README's table)")
    ap.add_argument("--kernel-sweep-child", metavar="JSONL", help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.kernel_sweep_child:
        return kernel_sweep_child(args.kernel_sweep_child, SWEEP_BS, SWEEP_BUDGETS, SWEEP_DEPTHS)
    if args.report_only:
        doc = json.load(open(args.report_only))
        out = args.report_only[:-5] if args.report_only.endswith(".json") else args.report_only
        with open(out + ".md", "w") as f:
            f.write(render_markdown(doc))
        print(f"wrote {out}.md")
        return 0
    if args.summary:
        print("\n".join(render_summary(json.load(open(args.summary)), h="####")).rstrip())
        return 0
    if args.merge:
        if len(args.merge) < 2:
            raise SystemExit("--merge OUT a.json [b.json ...]")
        merge(args.merge[0], args.merge[1:], args.invalid)
        return 0
    if args.kernel_sweep_only:
        tmp = args.workdir or tempfile.mkdtemp(prefix="ab_sweep_")
        os.makedirs(tmp, exist_ok=True)
        doc = dict(kind="ab_serve", meta=env_info(args.python or sys.executable),
                   settings=dict(model_path=None, draft_model_path=None, pair=None, concurrency=[], arms=[],
                                 max_new_tokens=None, requests_per_level={}, greedy="-"),
                   prompts=dict(source="-", count=0, kind="-", mean_input_len=0, sha256_16="-"),
                   arms=[], identity=None,
                   kernel_sweep=run_kernel_sweep(args.python or sys.executable, args.deadline or 1800, tmp))
        write_outputs(doc, args.out, plot=not args.no_plot)
        return 0
    def _term(signum, frame):  # `timeout` / a job killer: stop the running server, write the results
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _term)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
