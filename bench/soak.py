"""Soak test of a DDTREE-GPU HTTP server (issue 11): a long mixed load, then checks that nothing broke.

    # on the GPU host (bench/device/run_stages.sh stage soak_text):
    python bench/soak.py run --model-path T --draft-model-path D --out RAW_PREFIX [--requests 1000 --concurrency 64]
    # here (CPU), after the raw file came back: classify greedy divergences with the fp32 target
    python bench/soak.py report RAW_PREFIX.raw.json.gz --out bench/results/soak_h200

The load (``make_plan``, seeded, deterministic): ``--requests`` requests sent by ``--concurrency``
client threads against one server; each request is drawn independently:
  * prompts of 1..3,500 tokens (log-uniform), windows of the text pair's held-out standard-library
    files; 25 % reuse an earlier request's prompt start (radix-cache hits, some exact repeats);
  * greedy (60 %) or sampled (temperature 0.7-1.0, some with top_p 0.9 and / or top_k 40);
  * streaming or not (50 / 50); max_new_tokens 1..512 (log-uniform); ``ignore_eos`` or not;
  * 15 % with stop strings, 15 % with stop token ids;
  * 5 % aborted mid-stream (half by closing the connection after a few chunks, half through
    ``/abort_request`` with the request's rid);
  * 5 % bad requests (token ids outside the vocabulary, negative or non-integer ids, a negative
    temperature, top_p > 1, negative max_new_tokens, a prompt longer than the context,
    ``return_logprob``, malformed JSON), interleaved with the rest.
Before the load, ``warmup_plan``'s requests (every sampling mode, then a full batch of long prompts)
compile what a cold host compiles on first use; the load's window starts after them.
During the load a monitor thread samples GPU memory (nvidia-smi) and ``/v1/loads`` every
``--monitor-period`` s (0.25).
After it: the server must answer ``/health_generate``; once idle, ``/v1/loads`` must show no
running request and 0 used KV tokens; GPU memory after the warm-up must stay flat.  Then a plain
(no speculation) server with the same flags replays every greedy request that completed without
abort, at the same concurrency: every DDTREE-GPU greedy output must equal plain decoding's, or its
first divergence must be a bf16 near tie of the target (``report``: the fp32 replay of
``bench/ab_divergence.py`` on the text pair, with its calibrated noise).

Pass (``report``'s ``ok``): zero 5xx, zero unexpected errors, every bad request answered 4xx (or an
error event / abort message on a stream), every abort ended as an abort, server alive, KV usage 0
when idle, GPU memory flat (growth after warm-up <= ``MEM_FLAT_MIB``), zero greedy errors.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ab_serve as AB  # noqa: E402

MEM_FLAT_MIB = 512       # allowed GPU memory growth from the end of warm-up to the end of the load
WARMUP_FRACTION = 0.2    # the first 20 % of the load's monitor samples are warm-up (allocator caches fill)
BAD_KINDS = ("id_vocab", "id_negative", "id_huge", "id_string", "temperature", "top_p", "max_new_tokens",
             "too_long", "logprob", "malformed", "id_vocab_stream")
STOP_STRINGS = ("\n\n", "return", "):", "self.", "#")


# ------------------------------------------------------------------------------------------ plan
def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi], log-uniform: floor(exp(U(log lo, log(hi + 1))))."""
    return int(min(hi, max(lo, math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def make_plan(n: int, stream_ids: List[int], vocab: int, context_len: int, seed: int = 0,
              max_prompt: int = 3500, max_new: int = 512) -> List[dict]:
    """n request specs (JSON-able dicts).  ``stream_ids``: a long token stream to cut prompts from."""
    if len(stream_ids) < max_prompt + 1:
        raise ValueError(f"the prompt stream has {len(stream_ids)} tokens, need > {max_prompt}")
    rng = random.Random(seed)
    plan, starts = [], []
    n_bad = max(1, round(0.05 * n))
    n_abort = max(1, round(0.05 * n))
    kinds = ["bad"] * n_bad + ["abort"] * n_abort + ["ok"] * (n - n_bad - n_abort)
    rng.shuffle(kinds)
    for i, kind in enumerate(kinds):
        rid = f"soak-{seed}-{i}"
        if kind == "bad":
            plan.append(dict(i=i, rid=rid, kind="bad", bad=BAD_KINDS[len([p for p in plan if p["kind"] == "bad"])
                                                                    % len(BAD_KINDS)]))
            continue
        plen = log_uniform_int(rng, 1, max_prompt)
        if starts and rng.random() < 0.25:       # reuse an earlier prompt start: radix-cache hit
            start, prev_len = rng.choice(starts)
            if rng.random() < 0.3:
                plen = prev_len                  # an exact repeat
        else:
            start = rng.randrange(0, len(stream_ids) - plen)
        plen = min(plen, len(stream_ids) - start)
        starts.append((start, plen))
        greedy = rng.random() < 0.6
        sp = {"max_new_tokens": log_uniform_int(rng, 1, max_new)}
        if greedy:
            sp["temperature"] = 0.0
        else:
            sp["temperature"] = round(rng.uniform(0.7, 1.0), 2)
            r = rng.random()
            if r < 0.3:
                sp["top_p"] = 0.9
            elif r < 0.6:
                sp["top_k"] = 40
            elif r < 0.8:
                sp.update(top_p=0.9, top_k=40)
        sp["max_new_tokens"] = min(sp["max_new_tokens"], context_len - plen - 1)
        r = rng.random()
        if r < 0.15:
            sp["stop"] = rng.sample(STOP_STRINGS, 2)
        elif r < 0.30:
            sp["stop_token_ids"] = [stream_ids[(start + plen + k) % len(stream_ids)] for k in (3, 17)]
        if rng.random() < 0.5:
            sp["ignore_eos"] = True
        stream = kind == "abort" or rng.random() < 0.5
        spec = dict(i=i, rid=rid, kind=kind, start=start, prompt_len=plen, greedy=greedy, stream=stream,
                    sampling_params=sp)
        if kind == "abort":
            sp["max_new_tokens"] = max(sp["max_new_tokens"], 64)
            sp["ignore_eos"] = True
            sp.pop("stop", None)
            sp.pop("stop_token_ids", None)
            spec["abort_how"] = "disconnect" if rng.random() < 0.5 else "abort_request"
            spec["abort_after_chunks"] = rng.randint(1, 6)
        plan.append(spec)
    return plan


def warmup_plan(stream_ids: List[int], context_len: int, concurrency: int) -> List[dict]:
    """Requests sent before the measured load, outside its memory window: every sampling mode of the
    plan (greedy; temperature alone, with top-p, top-k, both) at batch 1 and then ``concurrency``
    at once with long prompts, so one-time JIT compiles (flashinfer's renorm kernels under
    sgl-kernel compile ~90 s on a cold host) and the allocator's first large batches happen here."""
    modes = [{"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.9},
             {"temperature": 0.8, "top_k": 40}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40}]
    plen = min(3000, context_len - 80, len(stream_ids) // 2)
    plan = []
    for k in range(len(modes) + concurrency):
        sp = dict(modes[k % len(modes)], max_new_tokens=64, ignore_eos=True)
        start = (k * 7919) % (len(stream_ids) - plen)
        plan.append(dict(i=-1 - k, rid=f"soak-warmup-{k}", kind="ok", start=start,
                         prompt_len=16 if k < len(modes) else plen, greedy=sp["temperature"] == 0.0,
                         stream=False, sampling_params=sp))
    return plan


def bad_payload(kind: str, vocab: int, context_len: int, good_ids: List[int]):
    """(body bytes, stream?) of one bad request."""
    p = {"input_ids": list(good_ids[:16]) or [5], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    stream = False
    if kind == "id_vocab":
        p["input_ids"] = p["input_ids"] + [vocab]
    elif kind == "id_vocab_stream":
        p["input_ids"] = p["input_ids"] + [vocab + 7]
        stream = True
    elif kind == "id_negative":
        p["input_ids"] = [-1] + p["input_ids"]
    elif kind == "id_huge":
        p["input_ids"] = p["input_ids"] + [10 ** 9]
    elif kind == "id_string":
        p["input_ids"] = p["input_ids"] + ["x"]
    elif kind == "temperature":
        p["sampling_params"]["temperature"] = -1.0
    elif kind == "top_p":
        p["sampling_params"].update(temperature=0.8, top_p=1.5)
    elif kind == "max_new_tokens":
        p["sampling_params"]["max_new_tokens"] = -5
    elif kind == "too_long":
        p["input_ids"] = [5] * (context_len + 10)
    elif kind == "logprob":
        p["return_logprob"] = True
    elif kind == "malformed":
        return b'{"input_ids": [1, 2, 3], "sampling_params": {', False
    else:
        raise ValueError(kind)
    if stream:
        p["stream"] = True
    return json.dumps(p).encode(), stream


# ------------------------------------------------------------------------------------------ client
def _post_raw(base_url: str, path: str, body: bytes, timeout: float):
    c = AB._conn(base_url, timeout)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def send_one(base_url: str, spec: dict, stream_ids: List[int], vocab: int, context_len: int,
             timeout: float = 600.0) -> dict:
    """Run one planned request; returns its record (status, outputs, finish reason, error)."""
    t0 = time.time()
    rec = dict(i=spec["i"], kind=spec["kind"], status=None, error=None, output_ids=None, finish=None)
    try:
        if spec["kind"] == "bad":
            body, stream = bad_payload(spec["bad"], vocab, context_len, stream_ids)
            rec["bad"] = spec["bad"]
            if stream:
                st, data = _post_raw(base_url, "/generate", body, timeout)
                rec["status"] = st
                rec["error"] = data[:300].decode("utf-8", "replace")
                rec["rejected"] = st >= 400 or b'"error"' in data or b'"abort"' in data
            else:
                st, data = _post_raw(base_url, "/generate", body, timeout)
                rec["status"] = st
                txt = data[:400].decode("utf-8", "replace")
                rec["error"] = txt
                fin = None
                if st == 200:
                    try:
                        fin = ((json.loads(data).get("meta_info") or {}).get("finish_reason") or {}).get("type")
                    except Exception:  # noqa: BLE001
                        fin = None
                rec["finish"] = fin
                rec["rejected"] = 400 <= st < 500 or (st == 200 and fin == "abort")
            return rec
        ids = stream_ids[spec["start"]: spec["start"] + spec["prompt_len"]]
        payload = {"rid": spec["rid"], "input_ids": ids, "sampling_params": spec["sampling_params"]}
        if not spec["stream"]:
            st, data = _post_raw(base_url, "/generate", json.dumps(payload).encode(), timeout)
            rec["status"] = st
            if st != 200:
                rec["error"] = data[:300].decode("utf-8", "replace")
                return rec
            d = json.loads(data)
            rec["output_ids"] = d.get("output_ids")
            mi = d.get("meta_info") or {}
            fr = mi.get("finish_reason")
            rec["finish"] = fr.get("type") if isinstance(fr, dict) else fr
            rec["meta"] = {k: mi.get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens",
                                                  "spec_verify_ct") if k in mi}
            return rec
        # streaming (and the aborted requests)
        c = AB._conn(base_url, timeout)
        try:
            c.request("POST", "/generate", body=json.dumps(dict(payload, stream=True)),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            rec["status"] = r.status
            if r.status != 200:
                rec["error"] = r.read()[:300].decode("utf-8", "replace")
                return rec
            last, n_chunks = None, 0
            for data in AB.iter_sse_data(r):
                n_chunks += 1
                last = data
                if spec["kind"] == "abort" and n_chunks == spec["abort_after_chunks"]:
                    if spec["abort_how"] == "disconnect":
                        rec["aborted_by"] = "disconnect"
                        rec["chunks_seen"] = n_chunks
                        return rec
                    st, _ = AB.http_json(base_url, "POST", "/abort_request", {"rid": spec["rid"]}, timeout=30)
                    rec["abort_status"] = st
                    rec["aborted_by"] = "abort_request"
            rec["chunks_seen"] = n_chunks
            if last is None:
                rec["error"] = "empty stream"
                return rec
            d = json.loads(last)
            if "error" in d:
                rec["error"] = json.dumps(d["error"])[:300]
                return rec
            mi = d.get("meta_info") or {}
            fr = mi.get("finish_reason")
            rec["finish"] = fr.get("type") if isinstance(fr, dict) else fr
            rec["output_ids"] = d.get("output_ids")
            rec["meta"] = {k: mi.get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens",
                                                  "spec_verify_ct") if k in mi}
            return rec
        finally:
            c.close()
    except Exception as e:  # noqa: BLE001 - recorded per request
        rec["error"] = repr(e)[:300]
        return rec
    finally:
        rec["latency_s"] = round(time.time() - t0, 3)


def run_load(base_url: str, plan: List[dict], stream_ids, vocab, context_len, concurrency: int) -> List[dict]:
    out = [None] * len(plan)
    nxt = [0]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                k = nxt[0]
                nxt[0] += 1
            if k >= len(plan):
                return
            out[k] = send_one(base_url, plan[k], stream_ids, vocab, context_len)
    th = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    [t.start() for t in th]
    [t.join() for t in th]
    return out


class Monitor(threading.Thread):
    """Samples GPU memory (MiB, nvidia-smi) and /v1/loads every ``period`` s."""

    def __init__(self, base_url: str, gpu: str, period: float = 1.0):
        super().__init__(daemon=True)
        self.base_url, self.gpu, self.period = base_url, gpu, period
        self.samples, self.stop_ev = [], threading.Event()

    def sample(self) -> dict:
        s = dict(t=round(time.time(), 2))
        try:
            o = subprocess.run(["nvidia-smi", "-i", self.gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
            s["gpu_mib"] = int(o[0]) if o else None
        except Exception:  # noqa: BLE001
            s["gpu_mib"] = None
        try:
            st, data = AB.http_json(self.base_url, "GET", "/v1/loads?include=core", timeout=5)
            ld = (json.loads(data).get("loads") or [{}])[0] if st == 200 else {}
            s.update(running=ld.get("num_running_reqs"), waiting=ld.get("num_waiting_reqs"),
                     used_tokens=ld.get("num_used_tokens"), token_usage=ld.get("token_usage"))
        except Exception as e:  # noqa: BLE001
            s["loads_error"] = repr(e)[:100]
        return s

    def run(self):
        while not self.stop_ev.is_set():
            self.samples.append(self.sample())
            self.stop_ev.wait(self.period)


def wait_idle(mon: Monitor, limit_s: float = 60.0) -> dict:
    t0 = time.time()
    s = mon.sample()
    while time.time() - t0 < limit_s:
        s = mon.sample()
        if s.get("running") == 0 and s.get("waiting") == 0 and s.get("used_tokens") == 0:
            break
        time.sleep(1)
    s["waited_s"] = round(time.time() - t0, 1)
    return s


def prompt_stream(model_path: str) -> List[int]:
    """The token stream prompts are cut from: the text pair's held-out stdlib files (this host's
    stdlib), tokenized with the target's tokenizer.json, files separated by </s> (id 2)."""
    import sysconfig
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
    root = sysconfig.get_paths()["stdlib"]
    ids = []
    for rel in AB.textpair_heldout_files():
        p = os.path.join(root, rel)
        if os.path.isfile(p):
            ids += tok.encode(open(p, encoding="utf-8", errors="replace").read()).ids + [2]
        if len(ids) > 400_000:
            break
    return ids


def server_cmd(args, algo: Optional[str], port: int) -> List[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
           "--host", "127.0.0.1", "--port", str(port), "--attention-backend", "triton",
           "--mem-fraction-static", str(args.mem_fraction), "--context-length", str(args.context_len),
           "--max-total-tokens", str(args.max_total_tokens),
           "--max-running-requests", str(args.concurrency), "--cuda-graph-max-bs-decode", str(args.concurrency),
           "--disable-prefill-cuda-graph", "--random-seed", "0", "--grammar-backend", "none",
           "--skip-server-warmup", "--log-level", "info"]
    if algo:
        cmd += ["--speculative-algorithm", algo, "--speculative-draft-model-path", args.draft_model_path]
        if args.budget > 0:            # 0: the plugin's default (the adaptive budget), as a user launches it
            cmd += ["--speculative-num-draft-tokens", str(args.budget + 1)]
    return cmd + (args.server_args.split() if args.server_args else [])


def soak_env(args) -> dict:
    """The soak server's environment: this one, plus ``DDTREE_SWITCHES`` when ``--switches`` gives
    them (the A/B's launcher then puts the switches plugin on the server's PYTHONPATH and checks that
    the worker logged them: ``sglang_ddtree/ab/servers.py``)."""
    env = dict(os.environ)
    if args.switches:
        from sglang_ddtree import switches
        try:
            fields = json.loads(args.switches)
        except ValueError as e:
            raise SystemExit(f"--switches {args.switches!r}: not JSON ({e})")
        if not isinstance(fields, dict) or not fields:
            raise SystemExit(f"--switches {args.switches!r}: a JSON object of switches, e.g. '{{\"regime\": \"auto\"}}'")
        switches.Switches(**fields)    # unknown fields: TypeError now, not a server that ignores them
        env[switches.ENV] = json.dumps(fields, sort_keys=True)
    return env


def cmd_run(args) -> int:
    t_start = time.time()
    stream_ids = prompt_stream(args.model_path)
    cfg = json.load(open(os.path.join(args.model_path, "config.json")))
    vocab = int(cfg["vocab_size"])
    plan = make_plan(args.requests, stream_ids, vocab, args.context_len, seed=args.seed)
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    doc = dict(kind="soak", env=AB.env_info(sys.executable), settings=dict(
        requests=args.requests, concurrency=args.concurrency, budget=args.budget, seed=args.seed,
        switches=json.loads(args.switches) if args.switches else None,
        context_len=args.context_len, model_path=args.model_path, draft_model_path=args.draft_model_path,
        algo=args.algo, vocab=vocab, mem_flat_mib=MEM_FLAT_MIB), plan=plan)
    phases = [("soak", args.algo)] + ([] if args.no_reference else [("reference", None)])
    for phase, algo in phases:
        port = args.port + (0 if phase == "soak" else 50)
        base = f"http://127.0.0.1:{port}"
        log = f"{args.out}.{phase}.log"
        srv = AB.popen_launcher(server_cmd(args, algo, port), soak_env(args) if algo else dict(os.environ), log)
        try:
            why = AB.wait_healthy(base, srv, args.start_limit)
            if why:
                doc[phase] = dict(error=f"server did not start: {why}", log_tail=AB.log_tail(log))
                break
            ph = dict(start_s=round(time.time() - t_start, 1))
            if phase == "soak":
                t0 = time.time()
                wp = warmup_plan(stream_ids, args.context_len, args.concurrency)
                n_modes = len(wp) - args.concurrency
                warm = run_load(base, wp[:n_modes], stream_ids, vocab, args.context_len, 1)
                warm += run_load(base, wp[n_modes:], stream_ids, vocab, args.context_len, args.concurrency)
                ph["warmup"] = dict(requests=len(wp), s=round(time.time() - t0, 1),
                                    first_s=[r["latency_s"] for r in warm[:n_modes]],
                                    errors=[r["error"] for r in warm if r["error"] or r["status"] != 200])
                mon = Monitor(base, gpu, period=args.monitor_period)
                mon.start()
                t0 = time.time()
                recs = run_load(base, plan, stream_ids, vocab, args.context_len, args.concurrency)
                ph["load_s"] = round(time.time() - t0, 1)
                mon.stop_ev.set()
                mon.join(5)
                ph["idle"] = wait_idle(mon)
                st, _ = AB.http_json(base, "GET", "/health_generate", timeout=30)
                ph["health_after"] = st
                ph["server_alive"] = srv.poll() is None and st == 200
                ph["samples"] = mon.samples
                ph["records"] = recs
            else:
                greedy = [s for s, r in zip(plan, doc["soak"]["records"])
                          if s["kind"] == "ok" and s["greedy"] and r and r.get("output_ids") is not None
                          and r.get("finish") != "abort"]
                ref_plan = [dict(s, stream=False, kind="ok") for s in greedy]
                t0 = time.time()
                recs = run_load(base, ref_plan, stream_ids, vocab, args.context_len, args.concurrency)
                ph["load_s"] = round(time.time() - t0, 1)
                ph["records"] = recs
            doc[phase] = ph
        finally:
            srv.stop()
            _write_raw(doc, plan, stream_ids, args.out)   # after each phase: a later kill keeps it
    summ = evaluate(doc, classification=None)
    print(json.dumps({k: v for k, v in summ.items() if k != "rows"}, indent=1))
    return 0


def _write_raw(doc, plan, stream_ids, out):
    for r, s in zip(doc.get("soak", {}).get("records") or [], plan):
        if s["kind"] != "bad" and r is not None:
            r["prompt_ids"] = stream_ids[s["start"]: s["start"] + s["prompt_len"]]
    with gzip.open(out + ".raw.json.gz", "wt") as f:
        json.dump(doc, f)


# ------------------------------------------------------------------------------------------ checks
def evaluate(doc: dict, classification: Optional[dict]) -> dict:
    """The pass/fail verdicts of one soak document (plus the greedy classification, once made)."""
    plan = doc["plan"]
    soak = doc.get("soak") or {}
    recs = soak.get("records") or []
    res = dict(requests=len(plan), completed=0, status_5xx=0, unexpected_errors=[], bad_total=0,
               bad_rejected=0, bad_not_rejected=[], aborts=0, aborts_ok=0, aborts_not_ok=[],
               ids_out_of_vocab=0, over_length=0)
    vocab = doc["settings"]["vocab"]
    for s, r in zip(plan, recs):
        if r is None:
            res["unexpected_errors"].append(dict(i=s["i"], error="no record"))
            continue
        st = r.get("status") or 0
        if st >= 500:
            res["status_5xx"] += 1
        if s["kind"] == "bad":
            res["bad_total"] += 1
            if r.get("rejected") and st < 500:
                res["bad_rejected"] += 1
            else:
                res["bad_not_rejected"].append(dict(i=s["i"], bad=s["bad"], status=st, body=(r.get("error") or "")[:160]))
            continue
        if s["kind"] == "abort":
            res["aborts"] += 1
            # disconnect: the client left; abort_request: the stream must end (finish "abort", or a normal
            # finish when the request completed before the abort arrived), with no error but the abort's
            ok = r.get("aborted_by") == "disconnect" or (
                r.get("aborted_by") == "abort_request" and st == 200 and r.get("abort_status") == 200 and (
                    not r.get("error") or "abort" in str(r.get("error")).lower()))
            if ok:
                res["aborts_ok"] += 1
            if not ok:
                res["aborts_not_ok"].append(dict(i=s["i"], how=s["abort_how"], status=st, finish=r.get("finish"),
                                                 error=(r.get("error") or "")[:160]))
            continue
        if r.get("error") or st != 200 or r.get("output_ids") is None:
            res["unexpected_errors"].append(dict(i=s["i"], status=st, error=(r.get("error") or "")[:200]))
            continue
        res["completed"] += 1
        out = r["output_ids"]
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in out):
            res["ids_out_of_vocab"] += 1
        if len(out) > s["sampling_params"]["max_new_tokens"]:
            res["over_length"] += 1
    # GPU memory: the load runs from the first sample with a running request to the last sample; its
    # first WARMUP_FRACTION is warm-up (the allocator's caches fill on the first large batches); after
    # it the used memory may grow by at most MEM_FLAT_MIB
    samples = [x for x in soak.get("samples") or [] if x.get("gpu_mib") is not None]
    mem = [x["gpu_mib"] for x in samples]
    if mem:
        start = next((k for k, x in enumerate(samples) if (x.get("running") or 0) > 0), 0)
        active = mem[start:]
        w_idx = min(len(active) - 1, int(math.ceil(len(active) * WARMUP_FRACTION)))
        w = active[w_idx]
        res["gpu_mib"] = dict(first=mem[0], load_start=active[0], after_warmup=w,
                              peak_after_warmup=max(active[w_idx:]), last=mem[-1], samples=len(mem),
                              load_samples=len(active))
        res["gpu_memory_flat"] = res["gpu_mib"]["peak_after_warmup"] - w <= MEM_FLAT_MIB
    else:
        res["gpu_memory_flat"] = None
    idle = soak.get("idle") or {}
    res["idle"] = {k: idle.get(k) for k in ("running", "waiting", "used_tokens", "token_usage", "waited_s")}
    res["kv_zero_when_idle"] = idle.get("used_tokens") == 0 and idle.get("running") == 0
    res["server_alive"] = bool(soak.get("server_alive"))
    res["load_s"] = soak.get("load_s")
    # greedy identity against plain decoding
    ref = (doc.get("reference") or {}).get("records")
    if ref is not None:
        by_i = {r["i"]: r for r in ref if r is not None}
        cmp = dict(compared=0, identical=0, diverged=0, missing=0)
        for s, r in zip(plan, recs):
            if s["kind"] != "ok" or not s["greedy"] or r is None or r.get("output_ids") is None or r.get("finish") == "abort":
                continue
            b = by_i.get(s["i"])
            if b is None or b.get("output_ids") is None:
                cmp["missing"] += 1
                continue
            cmp["compared"] += 1
            if b["output_ids"] == r["output_ids"]:
                cmp["identical"] += 1
            else:
                cmp["diverged"] += 1
        res["greedy_vs_plain"] = cmp
    if classification is not None:
        res["classification"] = {k: classification[k] for k in ("compared", "diverged", "near_tie", "error", "length")}
        res["classification"]["noise"] = classification.get("noise")
    res["warmup"] = soak.get("warmup")   # absent in soaks recorded before the warm-up phase existed
    res["ok"] = bool(not (res["warmup"] or {}).get("errors")
                     and res["status_5xx"] == 0 and not res["unexpected_errors"] and not res["bad_not_rejected"]
                     and not res["aborts_not_ok"] and res["server_alive"] and res["kv_zero_when_idle"]
                     and res["gpu_memory_flat"] and res["ids_out_of_vocab"] == 0 and res["over_length"] == 0
                     and ref is not None and res["greedy_vs_plain"]["missing"] == 0
                     and classification is not None and classification["error"] == 0)
    return res


def classify(doc: dict, noise: Optional[float] = None) -> dict:
    """fp32 replay of every greedy first divergence (bench/ab_divergence.py's target and rule)."""
    import ab_divergence as AD
    plan, recs = doc["plan"], doc["soak"]["records"]
    by_i = {r["i"]: r for r in doc["reference"]["records"] if r is not None}
    target = AD.Target()
    prompt_ids, pairs = [], []
    for s, r in zip(plan, recs):
        if s["kind"] != "ok" or not s["greedy"] or r is None or r.get("output_ids") is None or r.get("finish") == "abort":
            continue
        b = by_i.get(s["i"])
        if b is None or b.get("output_ids") is None:
            continue
        prompt_ids.append(r["prompt_ids"])
        pairs.append(("ddtree", doc["settings"]["concurrency"], len(prompt_ids) - 1, b["output_ids"], r["output_ids"]))
    if noise is None:
        seqs = [p + o for p, (_, _, _, o, _) in zip(prompt_ids, pairs) if o][:AD.CALIBRATION_REQUESTS]
        starts = [len(p) for p, (_, _, _, o, _) in zip(prompt_ids, pairs) if o][:AD.CALIBRATION_REQUESTS]
        cal = target.calibrate(seqs, starts)
        noise = cal["noise"]
    else:
        cal = None
    res = AD.classify_pairs(pairs, prompt_ids, target, noise)
    res["noise"] = noise
    res["calibration"] = cal
    return res


def render_md(doc: dict, summ: dict) -> str:
    s, e = doc["settings"], doc["env"]
    L = [f"# Soak: {s['algo']} HTTP server, {s['requests']} requests at concurrency {s['concurrency']}", "",
         f"Made by `bench/soak.py` on {e.get('date')}, commit {e.get('git_commit')}, GPU {e.get('gpu')}, "
         f"versions {json.dumps(e.get('versions'))}.",
         f"Text pair (bench/textpair), "
         + (f"budget {s['budget']} (verify width {s['budget'] + 1})" if s["budget"] > 0 else
            "the default budget (no --speculative-num-draft-tokens: the adaptive widths)")
         + (f", switches {json.dumps(s['switches'], sort_keys=True)}" if s.get("switches") else "")
         + f", context {s['context_len']}, "
         f"seed {s['seed']}. The load: see the module docstring of `bench/soak.py`.", "",
         f"**Verdict: {'PASS' if summ['ok'] else 'FAIL'}**", "", "| check | result |", "|---|---|"]
    kinds = {}
    for p in doc["plan"]:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    ok_specs = [p for p in doc["plan"] if p["kind"] == "ok"]
    L += [f"| requests (ok / aborted / bad) | {kinds.get('ok', 0)} / {kinds.get('abort', 0)} / {kinds.get('bad', 0)} |",
          f"| greedy / sampled, streamed, stop strings, stop ids | {sum(p['greedy'] for p in ok_specs)} / "
          f"{sum(not p['greedy'] for p in ok_specs)}, {sum(p['stream'] for p in ok_specs)}, "
          f"{sum('stop' in p['sampling_params'] for p in ok_specs)}, "
          f"{sum('stop_token_ids' in p['sampling_params'] for p in ok_specs)} |",
          f"| prompt tokens (min / median / max) | {_mmm([p['prompt_len'] for p in ok_specs])} |",
          f"| max_new_tokens (min / median / max) | {_mmm([p['sampling_params']['max_new_tokens'] for p in ok_specs])} |",
          f"| warm-up before the load: requests, s (first request of each sampling mode, s), errors | " + (
              f"{summ['warmup']['requests']}, {summ['warmup']['s']} ({', '.join(map(str, summ['warmup']['first_s']))}), "
              f"{len(summ['warmup']['errors'])}" if summ.get("warmup") else "none (recorded before the warm-up phase)") + " |",
          f"| load duration | {summ['load_s']} s |",
          f"| completed normally | {summ['completed']} of {kinds.get('ok', 0)} |",
          f"| HTTP 5xx | {summ['status_5xx']} |",
          f"| unexpected errors | {len(summ['unexpected_errors'])} |",
          f"| bad requests answered 4xx / error | {summ['bad_rejected']} of {summ['bad_total']} |",
          f"| aborts ended cleanly | {summ['aborts_ok']} of {summ['aborts']} |",
          f"| output ids outside the vocabulary / over max_new_tokens | {summ['ids_out_of_vocab']} / {summ['over_length']} |",
          f"| server alive after the load | {summ['server_alive']} |",
          f"| idle: running, waiting, used KV tokens | {summ['idle'].get('running')}, {summ['idle'].get('waiting')}, "
          f"{summ['idle'].get('used_tokens')} (after {summ['idle'].get('waited_s')} s) |",
          f"| GPU MiB: idle server / load start / after warm-up / peak after / last | " + (
              " / ".join(str(summ['gpu_mib'][k]) for k in ('first', 'load_start', 'after_warmup', 'peak_after_warmup', 'last'))
              if summ.get("gpu_mib") else "-") + f" (flat: growth <= {MEM_FLAT_MIB} MiB: {summ['gpu_memory_flat']}) |"]
    g = summ.get("greedy_vs_plain")
    if g:
        L.append(f"| greedy outputs vs plain decoding (same flags, same concurrency) | {g['identical']} identical, "
                 f"{g['diverged']} diverged of {g['compared']} (missing {g['missing']}) |")
    c = summ.get("classification")
    if c:
        L.append(f"| divergences classified (fp32 target, noise {c['noise']}) | {c['near_tie']} near ties, "
                 f"{c['error']} errors ({c['length']} length) |")
    if summ["bad_not_rejected"] or summ["unexpected_errors"] or summ["aborts_not_ok"]:
        L += ["", "## Failures", "", "```", json.dumps(dict(bad=summ["bad_not_rejected"], errors=summ["unexpected_errors"][:20],
                                                          aborts=summ["aborts_not_ok"]), indent=1), "```"]
    bad = [r for r in doc["soak"]["records"] if r and r.get("kind") == "bad"]
    if bad:
        L += ["", "## Bad requests (one of each kind)", "", "| kind | status | answer |", "|---|---:|---|"]
        seen = set()
        for r in bad:
            if r["bad"] in seen:
                continue
            seen.add(r["bad"])
            L.append(f"| {r['bad']} | {r['status']} | {(r.get('error') or '').replace('|', '/')[:120]} |")
    return "\n".join(L) + "\n"


def _mmm(xs):
    xs = sorted(xs)
    return f"{xs[0]} / {xs[len(xs) // 2]} / {xs[-1]}" if xs else "-"


def cmd_report(args) -> int:
    with gzip.open(args.raw, "rt") as f:
        doc = json.load(f)
    cls = classify(doc, noise=args.noise) if doc.get("reference") and doc["reference"].get("records") else None
    summ = evaluate(doc, cls)
    out = dict(kind="soak", env=doc["env"], settings=doc["settings"], summary=summ,
               divergences=(cls or {}).get("rows"), calibration=(cls or {}).get("calibration"),
               gpu_samples=[{k: x.get(k) for k in ("t", "gpu_mib", "running", "used_tokens")}
                            for x in doc["soak"].get("samples") or []])
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(render_md(doc, summ))
    print(render_md(doc, summ))
    return 0 if summ["ok"] else 1


def cmd_probe(args) -> int:
    """Does a token id outside the vocabulary kill the server?  A plain server (no speculation) with
    the plugin left out (SGLANG_PLUGINS=<other plugins>: plain SGLang 0.5.16), then the same with the
    plugin loaded: one bad request each (id = vocab), then a good one and /health_generate."""
    cfg = json.load(open(os.path.join(args.model_path, "config.json")))
    vocab = int(cfg["vocab_size"])
    doc = dict(kind="bad_id_probe", env=AB.env_info(sys.executable), vocab=vocab, runs=[])
    for label, plugins in (("plain_sglang", args.without_plugin), ("with_plugin", None)):
        port = args.port + len(doc["runs"]) * 20
        base = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        if plugins is not None:
            env["SGLANG_PLUGINS"] = plugins
        log = f"{args.out}.probe_{label}.log"
        args.concurrency = 8
        srv = AB.popen_launcher(server_cmd(args, None, port), env, log)
        run = dict(label=label, sglang_plugins=plugins)
        try:
            why = AB.wait_healthy(base, srv, args.start_limit)
            if why:
                run["error"] = why
                doc["runs"].append(run)
                continue
            good = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            bad = dict(good, input_ids=[5, 6, vocab])
            try:
                st, data = _post_raw(base, "/generate", json.dumps(bad).encode(), 120)
                run["bad_status"], run["bad_body"] = st, data[:300].decode("utf-8", "replace")
            except Exception as e:  # noqa: BLE001
                run["bad_status"], run["bad_body"] = None, repr(e)[:300]
            time.sleep(3)
            try:
                st, data = _post_raw(base, "/generate", json.dumps(good).encode(), 60)
                run["good_after_status"] = st
            except Exception as e:  # noqa: BLE001
                run["good_after_status"], run["good_after_error"] = None, repr(e)[:200]
            try:
                run["health_after"] = AB.http_json(base, "GET", "/health_generate", timeout=20)[0]
            except Exception as e:  # noqa: BLE001
                run["health_after"] = repr(e)[:200]
            run["server_process_alive"] = srv.poll() is None
            run["alive"] = run["server_process_alive"] and run.get("health_after") == 200 and run.get("good_after_status") == 200
            run["log_tail"] = AB.log_tail(log, 12)
        finally:
            srv.stop()
        doc["runs"].append(run)
    with open(args.out + ".probe.json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(args.out + ".probe.md", "w") as f:
        f.write(render_probe_md(doc))
    print(json.dumps([{k: v for k, v in r.items() if k != "log_tail"} for r in doc["runs"]], indent=1))
    return 0


def render_probe_md(doc: dict) -> str:
    """The bad-id probe's table (``python bench/soak.py probe-report JSON`` re-renders it)."""
    e = doc["env"]
    L = [f"# Does a token id outside the vocabulary kill the server?", "",
         f"Made by `bench/soak.py probe` on {e.get('date')}, commit {e.get('git_commit')}, GPU {e.get('gpu')}, "
         f"versions {json.dumps(e.get('versions'))}. A plain server (no speculation), once with the plugin "
         f"left out and once with it; one request whose `input_ids` end with id {doc['vocab']} (= the "
         f"vocabulary size), then a valid request and `/health_generate`.", "",
         "| server | bad request | answer | valid request after | health after | alive |", "|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        L.append(f"| {r['label']} | {r.get('bad_status')} | {str(r.get('bad_body', ''))[:110].replace('|', '/')} | "
                 f"{r.get('good_after_status')} | {r.get('health_after')} | {r.get('alive')} |")
    return "\n".join(L) + "\n"


def cmd_probe_report(args) -> int:
    doc = json.load(open(args.json))
    with open(args.out, "w") as f:
        f.write(render_probe_md(doc))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model-path", required=True)
    r.add_argument("--draft-model-path", required=True)
    r.add_argument("--algo", default="DDTREE-GPU")
    r.add_argument("--budget", type=int, default=16,
                   help="tree budget (--speculative-num-draft-tokens B+1); 0: none given, the plugin's default")
    r.add_argument("--switches", default="",
                   help="JSON object of sglang_ddtree switches for the soak server (DDTREE_SWITCHES through the "
                        "switches plugin), e.g. '{\"regime\": \"auto\"}' for the candidate default")
    r.add_argument("--requests", type=int, default=1000)
    r.add_argument("--concurrency", type=int, default=64)
    r.add_argument("--context-len", type=int, default=4096)
    r.add_argument("--mem-fraction", type=float, default=0.35)
    r.add_argument("--max-total-tokens", type=int, default=320000)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--port", type=int, default=31000)
    r.add_argument("--start-limit", type=float, default=240)
    r.add_argument("--server-args", default="")
    r.add_argument("--monitor-period", type=float, default=0.25, help="s between GPU memory / load samples")
    r.add_argument("--no-reference", action="store_true")
    r.add_argument("--out", required=True)
    q = sub.add_parser("probe")
    q.add_argument("--model-path", required=True)
    q.add_argument("--without-plugin", default="ddtree_testbed",
                   help="SGLANG_PLUGINS value that leaves the project's entry point out")
    q.add_argument("--context-len", type=int, default=4096)
    q.add_argument("--mem-fraction", type=float, default=0.15)
    q.add_argument("--max-total-tokens", type=int, default=65536)
    q.add_argument("--port", type=int, default=31200)
    q.add_argument("--start-limit", type=float, default=240)
    q.add_argument("--server-args", default="")
    q.add_argument("--out", required=True)
    pr = sub.add_parser("probe-report")
    pr.add_argument("json")
    pr.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("raw")
    p.add_argument("--out", required=True)
    p.add_argument("--noise", type=float, default=None, help="near-tie bound (default: calibrated on the soak's contexts)")
    a = ap.parse_args(argv)
    return {"run": cmd_run, "probe": cmd_probe, "probe-report": cmd_probe_report, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
