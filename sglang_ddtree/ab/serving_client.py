"""``--client bench_serving``: SGLang's own load generator, ``python -m sglang.bench_serving --backend
sglang``, drives every level; the A/B keeps its arms, its servers (one at a time) and adds the
output-identity check on top.

Per arm: the server is launched as a user would (``--model-path``, host, port, the arm's
speculative flags, its attention backend from ``--arm-attention`` -- default every arm on
``flashinfer``, the best backend the GPU host's kit has (a DDTREE arm keeps it for its prefill and
no-speculation rounds and verifies on triton) -- and ``--server-args`` for every arm), waited for on ``/health_generate``, warmed up by one uncounted bench_serving pass at the
largest concurrency (16 output tokens), then for each concurrency c and each repeat (``--repeats``,
radix cache flushed by bench_serving's ``--flush-cache`` after its own one-request warm-up), one pass:

    python -m sglang.bench_serving --backend sglang --host 127.0.0.1 --port P --model M --tokenizer M
        --dataset-name D ... --num-prompts n_c --max-concurrency c --request-rate inf --seed S
        --output-file F --flush-cache --warmup-requests 1 --ready-check-timeout-sec 0 --disable-tqdm

run in one persistent client process per arm (:class:`PersistentClient`: ``import sglang.bench_serving``
once, then every pass of the arm in-process through its entry point ``cli_main()`` with exactly these
arguments, so the same argparse Namespace; ``--bench-serving-per-pass``: a process per pass, which pays
bench_serving's ``import sglang`` and set-up each time: ~10 s a pass on a CPU host, 21-28 s on the H200
host in s26, passes of 3-8 s of load taking 26-35 s), and
the JSON line it appends to F is parsed (its 0.5.16 field names: output_throughput,
request_throughput, median/p99 ttft/itl/tpot/e2e, completed, duration, total_input_tokens,
total_output_tokens, accept_length, ...; failed = n_c - completed).  A level reports the median of
its repeats' output tok/s and the latencies of that repeat.  After the levels, the identity
requests (``--identity-prompts`` natural prompts as token ids, greedy, ``--identity-new-tokens``
new tokens, ``--identity-concurrency`` in flight, through ``/generate`` with ``input_ids``: the
A/B's own client) are sent and every arm's outputs are compared with the reference arm's
(``base``) token for token: identical, or the first differing position per request.

Workloads (``--workload``; ``--serving-input-len`` / ``--serving-output-len`` /
``--serving-range-ratio`` override a preset):

- ``random``: ``--dataset-name random-ids --tokenize-prompt``: random token ids, 512 in / 256 out
  (range ratio 1: every request exactly so);
- ``long``: the same with 8192 in / 256 out (the servers' context must hold 8448 tokens);
- ``mix``: random ids, input 256-4096, output 16-256 (range ratio 1/16, bench_serving draws each
  length uniformly between ratio x len and len);
- ``varied``: random ids, input 256-512, output 128-256 (range ratio 0.5: issue 52 item 5's chain
  pair workload, finishes spread where ``random`` runs lock-step waves);
- ``ids``: the pair's own prompts as token ids (``--prompts``: token-id items as they are, text items
  through the model's tokenizer.json), output 64-256 (range ratio 1/4): the chain pair on its chain
  prompts (issue 52 item 5), where drafters accept long blocks.  bench_serving's file datasets read
  text only, so this pass runs ``python -m sglang_ddtree.ab.bs_ids`` (:mod:`.bs_ids`: bench_serving
  itself, its ``custom`` dataset also reading a JSON-lines file of ``{"input_ids": [...]}`` rows,
  output lengths drawn from ``--random-output-len`` / ``--random-range-ratio`` with ``--seed``);
- ``natural``: the pair's natural prompts (``--prompts`` if given, else the text pair's held-out
  standard-library windows for ``--pair text``, else the A/B's standard-library prompts) written as
  a ShareGPT-format JSON (``--dataset-name sharegpt --dataset-path F --sharegpt-output-len 256``):
  bench_serving sends their text, the server tokenizes it (the prompt lengths bench_serving reports
  come from the same tokenizer; ``sglang.bench_serving`` cannot send token ids for file datasets:
  0.5.16's sharegpt / custom loaders assert ``not --tokenize-prompt``).  A level of n requests sends
  the pool's first n prompts (in an order bench_serving shuffles with the seed).  The pool is not a cap: a level
  larger than it cycles the prompts (``natural_texts``; the report gives the distinct count per
  level), so one pass then sends some prompt texts more than once (their prefixes hit the radix
  cache within the pass, alike in every arm).

Level sizes: ``--requests-per-level`` gives the first count per level (``auto``: max(16, 4c));
with ``--min-level-seconds S`` (default 20; 0: off) the first arm to run a level (the reference
arm, it runs first) sizes it with uncounted calibration passes: the first pass at a level never
counts (it may be the server's first traffic: in s26 64 requests took 13.3 s cold, then 112 took
3.2 s, so sizing from the first pass alone left the level at 3.2 s); after every pass shorter than
S the count becomes ceil(n x S x ``--level-seconds-margin`` / duration), rounded up to a multiple
of c (plus one more wave of c from the third calibration pass on; a margin under
:data:`MIN_SIZING_MARGIN` counts as that: a level aimed at exactly S lands on either side of it by
run-to-run noise, and the repeats below S are flagged), and the level runs again, until
a pass lasts >= S: that pass is the first repeat (at most :data:`MAX_CALIBRATION_PASSES` uncounted
passes; the level keeps them as ``calibration_passes``, the first also as ``calibration``).  Every
later arm runs that same count (the same requests); an arm whose first pass lasts less than S
(faster than the sizer) runs each repeat as ceil(``MIN_SIZING_MARGIN`` x S / duration) passes of
them back to back (at most :data:`MAX_PASSES`; :func:`merge_passes`: tokens and durations summed,
latencies from the median pass; the level says ``passes_per_repeat``), so every arm measures the
same requests for >= S without lengthening the slower arms' levels.

Ratios are only taken within one run (one card, one call).  bench_serving imports the ``datasets``
package at import time (sglang/benchmark/datasets/mmmu.py); where it is missing (the GPU host's
kit) a one-line stand-in (:data:`DATASETS_STANDIN`) is written under the work dir and put first on
the bench_serving process's PYTHONPATH (only then).
"""
from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

from . import bs_ids, client, regime_log
from .client import http_json
from .environment import env_info
from .prompts import load_prompts_file, make_prompts, prompt_digest, textpair_prompts
from .servers import log_tail, parse_arm, parse_arms, popen_launcher, wait_healthy
from .stats import first_diff, identity_check

SERVING_DEFAULT_ARMS = "base,dflash,ddtree"
MAX_CALIBRATION_PASSES = 4     # uncounted sizing passes per level (the first arm's), at most
MIN_SIZING_MARGIN = 1.05       # sizing aims at least this far over --min-level-seconds (run-to-run noise)
MAX_PASSES = 8                 # passes of the level's requests in one repeat, at most (an arm faster than the sizer)
# every arm on the best backend the GPU host's kit has (no FA3 kernels there): a DDTREE arm then keeps
# flashinfer for its prefill and its no-speculation rounds (SGLang's decode step) and verifies on
# triton (spec_algo.split_for_prefill_backend), as a user who launches base with it would launch it
DEFAULT_ARM_ATTENTION = "*=flashinfer"

# workload -> bench_serving dataset and lengths
WORKLOADS = {
    "random": dict(dataset="random-ids", input_len=512, output_len=256, range_ratio=1.0),
    "long": dict(dataset="random-ids", input_len=8192, output_len=256, range_ratio=1.0),
    "mix": dict(dataset="random-ids", input_len=4096, output_len=256, range_ratio=0.0625),
    "varied": dict(dataset="random-ids", input_len=512, output_len=256, range_ratio=0.5),
    "natural": dict(dataset="sharegpt", input_len=None, output_len=256, range_ratio=None),
    "ids": dict(dataset="custom", input_len=None, output_len=256, range_ratio=0.25),
}
# file datasets (their prompts from --prompts; no --serving-input-len) and the module a pass runs
FILE_DATASETS = ("sharegpt", "custom")
BENCH_MODULE = "sglang.bench_serving"
IDS_MODULE = bs_ids.__name__

# the stand-in for the `datasets` package (only load_dataset is imported, by datasets bench_serving never uses here)
DATASETS_STANDIN = ("def load_dataset(*a, **k): raise ImportError('the datasets package is not installed "
                    "(sglang_ddtree.ab stand-in)')\n")

# the fields of bench_serving's result line a level keeps (SGLang 0.5.16 sglang/benchmark/serving.py)
RESULT_FIELDS = ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                 "input_throughput", "output_throughput", "total_throughput",
                 "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
                 "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_e2e_latency_ms", "median_e2e_latency_ms",
                 "p99_e2e_latency_ms", "concurrency", "accept_length", "max_output_tokens_per_s",
                 "max_concurrent_requests", "max_concurrency", "dataset_name", "random_input_len",
                 "random_output_len", "random_range_ratio", "sharegpt_output_len")


# ------------------------------------------------------------------------------------------ arms
def parse_serving_arm(name: str) -> dict:
    """The A/B's arms (:func:`servers.parse_arm`; ``ddtree`` is ``--speculative-algorithm DDTREE-GPU``
    and the drafter, nothing else: what a user gets by default).  Arms pinned to a budget
    (``_pin<B>``) need a per-request field bench_serving cannot put in the sampling params: refused."""
    arm = parse_arm(name.strip())
    if arm.get("pin") is not None:
        raise ValueError(f"arm {name!r}: pinned arms need custom_params in the sampling params, which "
                         "sglang.bench_serving does not send; use --client ab")
    return arm


def parse_serving_arms(spec: str) -> List[dict]:
    """:func:`servers.parse_arms` with :func:`parse_serving_arm` (the reference also sizes the levels)."""
    return parse_arms(spec, parse=parse_serving_arm)


def parse_arm_attention(spec: str) -> Dict[str, str]:
    """'base=flashinfer,dflash=flashinfer' -> {arm name: backend} ('*': every arm without its own
    entry); '' or 'none': no arm gets the flag."""
    out = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part or part == "none":
            continue
        k, sep, v = part.partition("=")
        if not sep or not k.strip() or not v.strip():
            raise ValueError(f"--arm-attention {spec!r}: expected ARM=BACKEND pairs, got {part!r}")
        out[k.strip()] = v.strip()
    return out


def arm_backend(attention: Optional[Dict[str, str]], name: str) -> Optional[str]:
    """The attention backend :func:`parse_arm_attention`'s map gives arm ``name`` (its own, else '*')."""
    attention = attention or {}
    return attention.get(name, attention.get("*"))


def serving_server_cmd(arm: dict, opts: dict, port: int) -> List[str]:
    """The launch_server command line of one arm, as a user writes it: the model, host and port, the
    arm's attention backend (when ``opts["attention"]`` names one for it), its speculative flags,
    then ``opts["server_args"]`` (every arm, last: they win)."""
    cmd = [opts.get("python") or sys.executable, "-m", "sglang.launch_server", "--model-path", opts["model_path"],
           "--host", "127.0.0.1", "--port", str(port)]
    backend = arm_backend(opts.get("attention"), arm["name"])
    if backend:
        cmd += ["--attention-backend", backend]
    if arm["algo"]:
        if not opts.get("draft_model_path"):
            raise ValueError(f"arm {arm['name']} needs --draft-model-path")
        cmd += ["--speculative-algorithm", arm["algo"], "--speculative-draft-model-path", opts["draft_model_path"]]
        if arm.get("num_draft_tokens") is not None:
            cmd += ["--speculative-num-draft-tokens", str(arm["num_draft_tokens"])]
    cmd += shlex.split(opts.get("server_args") or "")
    return cmd


# ------------------------------------------------------------------------------------------ workload
def workload_settings(name: str, input_len=None, output_len=None, range_ratio=None) -> dict:
    if name not in WORKLOADS:
        raise ValueError(f"--workload {name!r}: one of {', '.join(WORKLOADS)}")
    w = dict(WORKLOADS[name], name=name)
    if input_len is not None:
        if w["dataset"] in FILE_DATASETS:
            raise ValueError(f"--serving-input-len: the {name} workload's lengths are the prompts' own")
        w["input_len"] = int(input_len)
    if output_len is not None:
        w["output_len"] = int(output_len)
    if range_ratio is not None:
        if w["dataset"] == "sharegpt":
            raise ValueError("--serving-range-ratio: not for the natural workload")
        w["range_ratio"] = float(range_ratio)
    return w


def bench_serving_cmd(python: str, port: int, model: str, workload: dict, c: int, n: int, output_file: str,
                      seed: int = 42, dataset_path: Optional[str] = None, output_len: Optional[int] = None,
                      warmup_requests: int = 1, tokenizer: Optional[str] = None) -> List[str]:
    """One ``python -m sglang.bench_serving`` run: n requests, at most c in flight, all sent at once
    (``--request-rate inf``), greedy (its default temperature 0, ignore_eos on), the result line
    appended to ``output_file``.  ``output_len`` overrides the workload's (the warm-up pass)."""
    out_len = int(output_len if output_len is not None else workload["output_len"])
    module = IDS_MODULE if workload["dataset"] == "custom" else BENCH_MODULE
    cmd = [python, "-m", module, "--backend", "sglang", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--tokenizer", tokenizer or model, "--dataset-name", workload["dataset"],
           "--num-prompts", str(int(n)), "--max-concurrency", str(int(c)), "--request-rate", "inf",
           "--seed", str(int(seed)), "--output-file", output_file, "--flush-cache",
           "--warmup-requests", str(int(warmup_requests)), "--ready-check-timeout-sec", "0", "--disable-tqdm"]
    if workload["dataset"] == "sharegpt":
        if not dataset_path:
            raise ValueError("the natural workload needs its dataset file")
        cmd += ["--dataset-path", dataset_path, "--sharegpt-output-len", str(out_len)]
    elif workload["dataset"] == "custom":
        if not dataset_path:
            raise ValueError("the ids workload needs its dataset file")
        cmd += ["--dataset-path", dataset_path, "--random-output-len", str(out_len),
                "--random-range-ratio", repr(float(workload["range_ratio"]))]
    else:
        cmd += ["--random-input-len", str(int(workload["input_len"])), "--random-output-len", str(out_len),
                "--random-range-ratio", repr(float(workload["range_ratio"])), "--tokenize-prompt"]
    return cmd


def natural_texts(args, n: int) -> tuple:
    """(n prompt texts, source): ``--prompts`` (token-id items decoded with the target's
    tokenizer.json), else the text pair's held-out windows (``--pair text``), else the A/B's
    standard-library prompts.  Fewer than n items are cycled."""
    if args.prompts:
        items = load_prompts_file(args.prompts, args.prompt_template)
        tok = None
        texts = []
        for it in items:
            if "text" in it:
                texts.append(it["text"])
                continue
            if tok is None:
                from tokenizers import Tokenizer
                tok = Tokenizer.from_file(os.path.join(args._model, "tokenizer.json"))
            texts.append(tok.decode(it["input_ids"], skip_special_tokens=False))
        source = os.path.abspath(args.prompts)
    elif args.pair == "text":
        texts = [p["text"] for p in textpair_prompts(n, args.prompt_template)]
        source = "the text pair's held-out standard-library files (bare code windows and docstrings)"
    else:
        texts = [p["text"] for p in make_prompts(n, args.prompt_template)]
        source = "the standard library (code windows and prose with a task line, alternating)"
    if not texts:
        raise ValueError("no natural prompts")
    return [texts[i % len(texts)] for i in range(n)], source


def write_sharegpt(texts: List[str], path: str) -> str:
    """A ShareGPT-format JSON bench_serving's ``sharegpt`` loader reads (the reply is a placeholder:
    ``--sharegpt-output-len`` fixes every output length)."""
    data = [{"id": f"p{i}", "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok ok ok ok"}]}
            for i, t in enumerate(texts)]
    with open(path, "w") as f:
        json.dump(data, f)
    return path


# ------------------------------------------------------------------------------------------ result line
def parse_result_file(path: str) -> dict:
    """The last JSON line bench_serving appended to ``path``, reduced to :data:`RESULT_FIELDS`."""
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no result line")
    return parse_result_line(lines[-1])


def parse_result_line(line: str) -> dict:
    raw = json.loads(line)
    missing = [k for k in ("output_throughput", "completed", "duration", "median_ttft_ms", "median_itl_ms")
               if k not in raw]
    if missing:
        raise ValueError(f"not a bench_serving result line (missing {missing})")
    return {k: raw.get(k) for k in RESULT_FIELDS}


# ------------------------------------------------------------------------------------------ the client process
def standin_pythonpath(python: str, workdir: str, env: Optional[dict] = None) -> Optional[str]:
    """When ``python`` cannot import ``datasets``, write the stand-in under ``workdir`` and return its
    folder (to go first on the bench_serving process's PYTHONPATH); else None."""
    env = dict(os.environ if env is None else env)
    r = subprocess.run([python, "-c", "import datasets"], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        return None
    d = os.path.join(workdir, "standin")
    os.makedirs(os.path.join(d, "datasets"), exist_ok=True)
    with open(os.path.join(d, "datasets", "__init__.py"), "w") as f:
        f.write(DATASETS_STANDIN)
    return d


def client_env(base_env: Optional[dict], standin: Optional[str]) -> dict:
    env = dict(os.environ if base_env is None else base_env)
    if standin:
        env["PYTHONPATH"] = standin + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")   # sglang.bench_serving's deprecation notice
    return env


def run_bench_serving(cmd: List[str], env: dict, cwd: str, timeout: float, log_path: str) -> dict:
    """Run one bench_serving command in a process of its own (``--bench-serving-per-pass``; it pays
    ``import sglang`` every pass); ``{ok, result | error, rc, seconds}`` (its output appended to
    ``log_path``)."""
    out_file = _fresh_output_file(cmd)
    t0 = time.time()
    try:
        with open(log_path, "ab") as log:
            log.write(("\n$ " + shlex.join(cmd) + "\n").encode())
            log.flush()
            r = subprocess.run(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        rc = r.returncode
    except subprocess.TimeoutExpired:
        return dict(ok=False, rc=None, error=f"timed out after {timeout:.0f} s", seconds=round(time.time() - t0, 1),
                    log_tail=log_tail(log_path, 20))
    return _pass_result(rc, out_file, t0, log_path)


def _fresh_output_file(cmd: List[str]) -> str:
    out_file = cmd[cmd.index("--output-file") + 1]
    if os.path.exists(out_file):
        os.remove(out_file)
    return out_file


def _pass_result(rc, out_file: str, t0: float, log_path: str, prefix: str = "") -> dict:
    res = dict(rc=rc, seconds=round(time.time() - t0, 1))
    try:
        res["result"] = parse_result_file(out_file)
        res["ok"] = rc == 0
        if rc != 0:
            res["error"] = f"{prefix}exit code {rc}"
    except (OSError, ValueError) as e:
        res.update(ok=False, error=f"{prefix}exit code {rc}; {e}", log_tail=log_tail(log_path, 20))
    return res


# The persistent client's process: imports sglang.bench_serving once, then runs one pass per request
# line on stdin ({"argv": [the arguments after `-m sglang.bench_serving`]}) by calling its entry point
# cli_main() with sys.argv set to them: the argparse Namespace is the one the command line builds, and
# run_benchmark(that Namespace) runs as under `python -m`.  State bench_serving 0.5.16 keeps between
# calls, and why none of it needs a reset: the module global `args` (run_benchmark reassigns it first
# thing), random / numpy seeds (run_benchmark re-seeds from --seed: the same requests as a fresh
# process), the event loop (asyncio.run makes a new one per pass), aiohttp sessions (one per request),
# datasets.common.get_available_tokens (lru_cache(1) keyed by the tokenizer, which is loaded afresh per
# pass), set_ulimit (idempotent).  Its output goes where the per-pass processes' went (the arm's client
# log: this process's stdout / stderr); each pass's status line ({"rc", "seconds"}) goes to the fd in
# argv[1].  SystemExit (argparse errors, bench_serving's sys.exit(1)) becomes the pass's exit code, an
# exception exit code 1 (traceback in the log); KeyboardInterrupt ends the process.  A pass whose
# command runs IDS_MODULE first calls that module's install() (idempotent: bench_serving's custom
# dataset also reads token-id files), as its __main__ does.
WORKER_SRC = r'''
import json, os, sys, time, traceback, warnings
proto = os.fdopen(int(sys.argv[1]), "w", buffering=1)
t0 = time.time()
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import sglang.bench_serving as bs
except Exception:
    traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    proto.write(json.dumps({"ready": False, "error": traceback.format_exc()[-1500:]}) + "\n")
    sys.exit(1)
print("persistent bench_serving client: imported %s in %.1f s" % (bs.__file__, time.time() - t0), flush=True)
proto.write(json.dumps({"ready": True, "import_s": round(time.time() - t0, 2)}) + "\n")
while True:
    line = sys.stdin.readline()
    if not line:
        break
    if not line.strip():
        continue
    req = json.loads(line)
    t1 = time.time()
    sys.argv = ["sglang.bench_serving"] + list(req["argv"])
    rc = 0
    try:
        if req.get("install"):
            __import__(req["install"], fromlist=["install"]).install()
        bs.cli_main()
    except SystemExit as e:
        rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except Exception:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush(); sys.stderr.flush()
    proto.write(json.dumps({"rc": rc, "seconds": round(time.time() - t1, 2)}) + "\n")
'''


class PerPassClient:
    """``--bench-serving-per-pass``: every pass a ``python -m sglang.bench_serving`` process (:func:`run_bench_serving`)."""
    mode = "per-pass"

    def __init__(self, env: dict, cwd: str, log_path: str):
        self.env, self.cwd, self.log_path = env, cwd, log_path
        self.starts = self.passes = 0
        self.import_s = None

    def run(self, cmd: List[str], timeout: float) -> dict:
        self.passes += 1
        self.starts += 1
        return run_bench_serving(cmd, self.env, self.cwd, timeout, self.log_path)

    def close(self):
        pass

    def info(self) -> dict:
        return dict(mode=self.mode, processes=self.starts, passes=self.passes, import_s=self.import_s)


class _Timeout(Exception):
    pass


class PersistentClient(PerPassClient):
    """One arm's bench_serving client: one process (:data:`WORKER_SRC`, started with the pass
    command's interpreter on the first pass) that imports ``sglang.bench_serving`` once and runs every
    pass of the arm (warm-up, calibration, levels x repeats) in-process, with the arguments the
    per-pass command line has (:func:`bench_serving_cmd`), writing the same result line to the same
    ``--output-file``.  A pass that runs past its timeout kills the process (as subprocess.run's
    timeout did); the next pass starts a new one."""
    mode = "persistent"

    def __init__(self, env: dict, cwd: str, log_path: str):
        super().__init__(env, cwd, log_path)
        self.proc = None
        self._rfd = None
        self._buf = b""

    def _log(self, text: str):
        with open(self.log_path, "ab") as log:
            log.write(text.encode())

    def _read(self, deadline: float) -> Optional[dict]:
        """The next status line from the process (None: it exited); _Timeout past ``deadline``."""
        import select
        while b"\n" not in self._buf:
            left = deadline - time.time()
            if left <= 0:
                raise _Timeout()
            ready, _, _ = select.select([self._rfd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._rfd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _start(self, python: str, deadline: float) -> Optional[str]:
        r, w = os.pipe()
        try:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([python, "-c", WORKER_SRC, str(w)], env=self.env, cwd=self.cwd,
                                             stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                             pass_fds=(w,))
        except OSError:
            os.close(r)
            raise
        finally:
            os.close(w)
        self._rfd, self._buf = r, b""
        self.starts += 1
        msg = self._read(deadline)
        if not msg or not msg.get("ready"):
            rc = self.proc.wait()
            self._reset()
            return f"the bench_serving client process did not start (exit code {rc})"
        self.import_s = msg.get("import_s")
        return None

    def _reset(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None and self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self._rfd is not None:
            os.close(self._rfd)
        self.proc, self._rfd, self._buf = None, None, b""

    def run(self, cmd: List[str], timeout: float) -> dict:
        if cmd[1] != "-m" or cmd[2] not in (BENCH_MODULE, IDS_MODULE):
            raise ValueError(f"not a bench_serving command line: {cmd[:3]}")
        self.passes += 1
        out_file = _fresh_output_file(cmd)
        t0 = time.time()
        deadline = t0 + timeout
        self._log("\n$ " + shlex.join(cmd) + f"\n# (in the persistent client, pass {self.passes})\n")
        try:
            if self.proc is None or self.proc.poll() is not None:
                self._reset()
                why = self._start(cmd[0], deadline)
                if why:
                    return dict(ok=False, rc=None, error=why, seconds=round(time.time() - t0, 1),
                                log_tail=log_tail(self.log_path, 20))
            try:
                req = {"argv": cmd[3:], **({"install": IDS_MODULE} if cmd[2] == IDS_MODULE else {})}
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
                msg = self._read(deadline)
            except BrokenPipeError:
                msg = None
        except _Timeout:
            self._reset()
            self._log(f"# timed out after {timeout:.0f} s: the client process killed\n")
            return dict(ok=False, rc=None, error=f"timed out after {timeout:.0f} s", seconds=round(time.time() - t0, 1),
                        log_tail=log_tail(self.log_path, 20))
        if msg is None:     # the process died mid-pass
            rc = self.proc.wait()
            self._reset()
            return _pass_result(rc, out_file, t0, self.log_path, prefix="client process died, ")
        return _pass_result(int(msg.get("rc", 1)), out_file, t0, self.log_path)

    def close(self):
        """Kill the process: it holds nothing unwritten between passes (every result line is closed by
        then), and an interpreter that imported sglang takes ~2 s to exit on its own."""
        self._reset()


def make_client(args, env: dict, cwd: str, log_path: str):
    """The arm's bench_serving client: :class:`PersistentClient`, or :class:`PerPassClient` with
    ``--bench-serving-per-pass``."""
    cls = PerPassClient if getattr(args, "bench_serving_per_pass", False) else PersistentClient
    return cls(env, cwd, log_path)


# ------------------------------------------------------------------------------------------ levels
def scaled_count(n: int, c: int, duration: float, min_s: float, margin: float, cap: int = 100000) -> int:
    """The request count that makes a level of ``n`` requests lasting ``duration`` s last at least
    ``min_s * margin`` s, as a multiple of c (never fewer than n)."""
    if duration <= 0:
        return n
    m = math.ceil(n * min_s * margin / duration)
    m = int(math.ceil(m / c) * c)
    return max(n, min(cap, m))


PASS_SUMS = ("duration", "completed", "total_input_tokens", "total_output_tokens")


def merge_passes(passes: List[dict]) -> dict:
    """One repeat from back-to-back passes of the same requests (:data:`MAX_PASSES`): durations,
    requests and tokens summed, the rates (throughputs, mean in flight) weighted by duration (the
    summed counts over the summed duration), acceptance weighted by output tokens; the latency
    percentiles from the pass with the median output throughput; ``passes`` their count,
    ``window`` from the first start to the last end."""
    res = [p["result"] for p in passes]
    out = dict(ok=all(p.get("ok") for p in passes), passes=len(passes),
               seconds=round(sum(p.get("seconds") or 0.0 for p in passes), 1),
               command=passes[0].get("command"), window=[passes[0]["window"][0], passes[-1]["window"][1]])
    ranked = sorted(res, key=lambda r: r.get("output_throughput") or 0.0)
    m = dict(ranked[(len(ranked) - 1) // 2])
    for k in PASS_SUMS:
        if all(r.get(k) is not None for r in res):
            m[k] = sum(r[k] for r in res)
    d = sum(r.get("duration") or 0.0 for r in res) or float("nan")
    # a rate over the passes = their rates weighted by duration (= summed counts / summed duration)
    for k in ("output_throughput", "input_throughput", "total_throughput", "request_throughput", "concurrency"):
        if all(r.get(k) is not None for r in res):
            m[k] = sum(r[k] * (r.get("duration") or 0.0) for r in res) / d
    acc = [(r["accept_length"], (r.get("output_throughput") or 0.0) * (r.get("duration") or 0.0))
           for r in res if r.get("accept_length") is not None]
    if acc and sum(w for _, w in acc):
        m["accept_length"] = sum(a * w for a, w in acc) / sum(w for _, w in acc)
    for k in ("max_concurrent_requests", "max_output_tokens_per_s"):
        if all(r.get(k) is not None for r in res):
            m[k] = max(r[k] for r in res)
    out["result"] = m
    return out


def level_summary(c: int, n: int, reps: List[dict], min_s: float) -> dict:
    """A level from its repeats: output_throughput = the median of the repeats'; the other numbers
    from the repeat with the median throughput (the lower middle one for an even count).  A repeat of
    several passes (:func:`merge_passes`) counts ``n`` requests a pass."""
    good = [r for r in reps if r.get("ok")]
    lv = dict(concurrency=c, num_prompts=n, repeats=len(reps),
              output_throughput_repeats=[r["result"]["output_throughput"] if r.get("result") else None for r in reps],
              repeat_seconds=[r.get("seconds") for r in reps])
    errs = [r.get("error") for r in reps if not r.get("ok")]
    if errs:
        lv["errors"] = errs
    if not good:
        lv.update(output_throughput=None, failed=n, completed=0, partial=True)
        return lv
    ranked = sorted(good, key=lambda r: r["result"]["output_throughput"] or 0.0)
    mid = ranked[(len(ranked) - 1) // 2]["result"]
    # bench_serving's "concurrency" is the mean number in flight (sum of e2e / duration): kept under its own name
    lv.update({k: v for k, v in mid.items() if k not in ("max_concurrency", "concurrency")})
    lv["mean_in_flight"] = mid.get("concurrency")
    lv["output_throughput"] = statistics.median([r["result"]["output_throughput"] or 0.0 for r in good])
    k = ranked[(len(ranked) - 1) // 2].get("passes") or 1
    if k > 1:
        lv["passes_per_repeat"] = k
    lv["failed"] = max(0, n * k - int(mid.get("completed") or 0))
    lv["partial"] = len(good) < len(reps) or lv["failed"] > 0
    lv["short"] = bool(min_s) and any((r["result"].get("duration") or 0) < min_s for r in good)
    return lv


# ------------------------------------------------------------------------------------------ the run
def token_id_prompts(args, model: str, n: Optional[int]) -> tuple:
    """(prompts as ``{"input_ids"}``, source, how tokenized): ``--prompts`` (its first n items, all for
    None), else the text pair's held-out windows (``--pair text``), else the A/B's standard-library
    prompts (n of them; ``--num-prompts`` for None); text through the model's tokenizer.json."""
    from .prompts import tokenize_prompts
    if args.prompts:
        prompts = load_prompts_file(args.prompts, args.prompt_template)[:n]
        source = os.path.abspath(args.prompts)
    elif args.pair == "text":
        prompts = textpair_prompts(int(n or args.num_prompts), args.prompt_template)
        source = "the text pair's held-out standard-library files"
    else:
        prompts = make_prompts(int(n or args.num_prompts), args.prompt_template)
        source = "the standard library (code windows and prose)"
    if not prompts:
        raise ValueError(f"no prompts from {source}")
    how = tokenize_prompts(prompts, model, args.max_input_tokens, args.vocab_size)
    return [dict(input_ids=p["input_ids"]) for p in prompts], source, how


def identity_inputs(args, model: str) -> tuple:
    """The identity requests' prompts (token ids, the same for every arm) and their source."""
    return token_id_prompts(args, model, int(args.identity_prompts))


def resolve_model(args) -> tuple:
    if args.config:
        raise SystemExit("--client bench_serving launches every arm as a user would: give --model-path / --pair, "
                         "not --config")
    model, draft = args.model_path, args.draft_model_path
    pair = args.pair
    if pair == "text" or (not model and not pair):
        model = model or os.path.join(args.models_dir, "text_target")
        draft = draft or os.path.join(args.models_dir, "text_drafter")
        pair = "text"
    elif pair:
        model = model or os.path.join(args.models_dir, f"{pair}_target")
        draft = draft or os.path.join(args.models_dir, "drafter")
    return model, draft, pair


def parse_workloads(spec: str) -> List[str]:
    """``random`` or ``random,natural,...`` -> the workload names, each once, each one of
    :data:`WORKLOADS`; ValueError otherwise."""
    names = [x.strip() for x in str(spec).split(",") if x.strip()]
    bad = [x for x in names if x not in WORKLOADS]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"--workload {spec!r}: one or more of {', '.join(WORKLOADS)}, comma-separated, each once")
    return names


def workload_out(out: str, name: str, several: bool) -> str:
    """A workload's report path: ``out`` itself for a run of one workload, ``out_<name>`` for several."""
    return f"{out}_{name}" if several else out


def run(args, launcher: Callable = popen_launcher) -> dict:
    """The whole bench_serving A/B: every arm's server in turn, its levels, its identity requests;
    JSON + markdown written after every arm (``args.out``).  Several workloads (``--workload
    random,natural``): each arm's server is started once and serves every workload's levels in turn
    (a server start is 1.5-3 minutes of a 10-minute device call), each workload with its own report
    (``<out>_<workload>``, the same format as a run of that workload alone), its own level sizing and
    its own ``--resume`` state; the identity requests, which do not depend on the workload, run once
    per server and go into every report.  Returns the report (the first workload's for several)."""
    t_start = time.time()
    deadline_at = t_start + args.deadline if args.deadline else None
    from .servers import DEFAULT_ARMS
    arms = parse_serving_arms(SERVING_DEFAULT_ARMS if args.arms == DEFAULT_ARMS else args.arms)
    attention = parse_arm_attention(args.arm_attention)
    names = parse_workloads(args.workload)
    model, draft, pair = resolve_model(args)
    args.pair, args._model = pair, model
    levels = list(args.concurrency)
    python = args.python or sys.executable
    tmpdir = args.workdir or tempfile.mkdtemp(prefix="ab_serving_")
    os.makedirs(tmpdir, exist_ok=True)
    id_prompts, id_source, id_how = identity_inputs(args, model)
    opts = dict(python=python, model_path=model, draft_model_path=draft, attention=attention,
                server_args=args.server_args)
    standin = standin_pythonpath(python, tmpdir)
    cenv = client_env(None, standin)
    machine = machine_id()
    meta = env_info(python) if not args.no_env_probe else dict(argv=sys.argv)
    loads = [_Load(args, name, len(names) > 1, model, draft, pair, arms, attention, levels, tmpdir, id_prompts,
                   id_source, id_how, standin, machine, meta) for name in names]
    if getattr(args, "resume", False):
        named = {a["name"] for a in arms}
        # arms of a state this run does not name come first (e.g. base from the call before)
        extra = [n for L in loads for n in L.kept if n not in named]
        arms = [parse_serving_arm(n) for n in dict.fromkeys(extra)] + arms
        # breadth first: the arms a cut left with some complete levels run after those with none (the
        # lease may end before all are done, and a cell with every arm, one of them partial, says more
        # than one arm completed; s39: the last 200 s re-ran a cut arm's level instead of DFLASH's
        # first); the first arm keeps its place (it sizes the levels)
        cut = {n for L in loads for n in L.levels_kept}
        arms = arms[:1] + [a for a in arms[1:] if a["name"] not in cut] + [a for a in arms[1:] if a["name"] in cut]
        for L in loads:
            L.doc["settings"]["arms"] = [a["name"] for a in arms]
    maxc = max(levels)
    print(f"ab_serving: {len(arms)} arms x concurrency {levels}, workload {', '.join(names)}, work dir {tmpdir}"
          f"{', datasets stand-in on' if standin else ''}", flush=True)
    if args.dry_run:
        from .runner import requests_per_level
        for i, arm in enumerate(arms):
            print(f"[{arm['name']}] {shlex.join(serving_server_cmd(arm, opts, args.port + 10 * i))}")
        for L in loads:
            for c in levels:
                n = requests_per_level(args.requests_per_level, c, 1 << 30)
                print(f"[{L.name + ' ' if len(loads) > 1 else ''}c={c}] {shlex.join(bench_serving_cmd(python, args.port, model, L.workload, c, n, 'OUT.jsonl', args.serving_seed, L.dataset_for(n)))}")
        return loads[0].doc
    try:
        for i, arm in enumerate(arms):
            port = args.port + 10 * i
            todo = [L for L in loads if arm["name"] not in L.kept]
            share_at = arm_share_end(arms[i:], loads, deadline_at, time.time()) \
                if todo and getattr(args, "arm_shares", False) else None
            recs = dict(zip((L.name for L in todo),
                            _measure_arm(arm, opts, port, args, levels, maxc, todo, python, cenv, tmpdir,
                                         deadline_at, launcher, id_prompts, share_at))) if todo else {}
            for L in loads:
                if arm["name"] in L.kept:
                    rec = dict(L.kept[arm["name"]][0], resumed=True)
                else:
                    rec = recs[L.name]
                    rec["git_commit"] = L.doc["meta"].get("git_commit")
                    rec["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                L.doc["arms"].append(rec)
                L.save(t_start)
    except KeyboardInterrupt:
        for L in loads:
            L.doc["interrupted"] = True
        print("interrupted: writing what was measured", flush=True)
    for L in loads:
        L.save(t_start, final=True)
    return loads[0].doc


class _Load:
    """One workload of a run: its bench_serving settings and dataset, its level sizing (``counts``,
    shared by every arm), its report ``doc`` and identity outputs, its ``--resume`` state."""

    def __init__(self, args, name, several, model, draft, pair, arms, attention, levels, tmpdir, id_prompts,
                 id_source, id_how, standin, machine, meta):
        self.name = name
        self.workload = workload_settings(name, args.serving_input_len, args.serving_output_len,
                                          args.serving_range_ratio)
        self.out = workload_out(args.out, name, several)
        self.id_prompts = id_prompts
        self._args, self._tmpdir = args, tmpdir
        self.natural = dict(files={}, source=None) if self.workload["dataset"] == "sharegpt" else None
        self.ids = dict(file=None, source=None) if self.workload["dataset"] == "custom" else None
        self._model = model
        self.counts: Dict[int, int] = {}        # the calibrated request count per level (every arm's)
        self.outputs: Dict[str, Dict[int, list]] = {}
        self.state_path = os.path.join(tmpdir, state_file(name))
        self.doc = dict(
            kind="ab_serving", meta=dict(meta),
            settings=dict(client="bench_serving", model_path=model, draft_model_path=draft, pair=pair,
                          arms=[a["name"] for a in arms], arm_attention=attention, concurrency=levels,
                          workload=self.workload, repeats=args.repeats, seed=args.serving_seed,
                          level_warmup_waves=int(args.level_warmup_waves),
                          min_level_seconds=args.min_level_seconds, level_seconds_margin=args.level_seconds_margin,
                          requests_per_level_spec=args.requests_per_level, requests_per_level={},
                          server_args=args.server_args, reference_arm=args.reference_arm, deadline_s=args.deadline,
                          identity=dict(prompts=len(id_prompts), new_tokens=args.identity_new_tokens,
                                        concurrency=args.identity_concurrency, source=id_source, tokenized_with=id_how,
                                        sha256_16=prompt_digest(id_prompts), greedy="temperature 0, ignore_eos, stream")),
            arms=[], identity=None,
            definitions=dict(
                output_throughput="bench_serving's output_throughput (total output tokens / benchmark duration), "
                                  "the median of the level's repeats",
                latencies="bench_serving's TTFT / ITL / TPOT of the repeat with the median throughput "
                          "(ITL: chunk gap / tokens in the chunk, once per token)",
                short="a repeat of the level lasted less than --min-level-seconds",
                identity="the identity requests' output ids against the reference arm's, token for token"))
        self.doc["settings"]["datasets_standin"] = bool(standin)
        self.doc["meta"]["machine"] = machine
        self.key = resume_key(self.doc["settings"], machine)
        self.kept: Dict[str, tuple] = {}
        self.levels_kept: Dict[str, list] = {}   # arms cut by a deadline: the levels they completed
        if getattr(args, "resume", False):
            kept, kept_counts, why, self.levels_kept = load_resume(self.state_path, self.key)
            if why:
                self.doc["resume_refused"] = why
                print(f"ab_serving: --resume ({name}): nothing kept ({why})", flush=True)
            else:
                self.kept = kept
                for arm_name, (rec, outs) in kept.items():
                    self.outputs[arm_name] = {int(c): v for c, v in outs.items()}
                self.counts.update(kept_counts)
                self.doc["resumed"] = dict(arms=sorted(kept), state=self.state_path,
                                           note="arms measured by an earlier call on the same machine (same GPU "
                                                "and settings); their levels ran the same request counts")
                if self.levels_kept:
                    self.doc["resumed"]["levels"] = {a: [lv["concurrency"] for lv in lvs]
                                                     for a, lvs in self.levels_kept.items()}
                print(f"ab_serving: --resume ({name}): kept {sorted(kept)} and the complete levels "
                      f"{self.doc['resumed'].get('levels', {})} from {self.state_path}", flush=True)

    def dataset_for(self, n):
        if self.ids is not None:     # one file of every prompt; bench_serving cycles it (bs_ids)
            if self.ids["file"] is None:
                prompts, self.ids["source"], how = token_id_prompts(self._args, self._model, None)
                self.ids["file"] = bs_ids.write_ids_rows([p["input_ids"] for p in prompts],
                                                         os.path.join(self._tmpdir, f"ids_{self.name}.jsonl"))
                lens = [len(p["input_ids"]) for p in prompts]
                self.ids.update(prompts=len(prompts), tokenized_with=how, input_len=[min(lens), max(lens)])
            return self.ids["file"]
        if self.natural is None:
            return None
        if n not in self.natural["files"]:
            texts, self.natural["source"] = natural_texts(self._args, n)
            self.natural["files"][n] = write_sharegpt(texts, os.path.join(self._tmpdir, f"natural_{n}.json"))
            self.natural.setdefault("distinct", {})[str(n)] = len(set(texts))
        return self.natural["files"][n]

    def save(self, t_start, final: bool = False):
        """After an arm: the resume state, then the report with the request counts, the identity
        verdicts and the natural prompts' source so far.  ``final`` (the run's end): the report only,
        with the output ids when ``--save-output-ids`` (bench/ab_divergence.py's inputs)."""
        from .report import write_outputs
        args = self._args
        if not final:
            save_resume(self.state_path, self.key, self.doc["arms"], self.outputs, self.counts)
        self.doc["settings"]["requests_per_level"] = {str(c): n for c, n in sorted(self.counts.items())}
        self.doc["identity"] = identity_report(self.outputs, args.reference_arm, self.id_prompts)
        self.doc["elapsed_s"] = round(time.time() - t_start, 1)
        if self.natural is not None:
            self.doc["settings"]["natural"] = dict(source=self.natural["source"], distinct=self.natural.get("distinct"))
        if self.ids is not None:
            self.doc["settings"]["ids"] = {k: v for k, v in self.ids.items() if k != "file"}
        if final and args.save_output_ids:   # output_ids[arm][c], prompt_ids
            self.doc["output_ids"] = {a: {str(c): v for c, v in o.items()} for a, o in self.outputs.items()}
            self.doc["prompt_ids"] = [p["input_ids"] for p in self.id_prompts]
        write_outputs(self.doc, self.out, plot=False)


def state_file(workload: str) -> str:
    """In --workdir: what --resume reads back for one workload (arms, output ids, counts)."""
    return f"serving_state_{workload}.json"


# the settings an arm's numbers depend on: --resume keeps an arm only when every one is the same
RESUME_SETTINGS = ("client", "model_path", "draft_model_path", "pair", "arm_attention", "concurrency", "workload",
                   "repeats", "level_warmup_waves", "seed", "min_level_seconds", "level_seconds_margin", "requests_per_level_spec",
                   "server_args", "reference_arm", "identity")


def machine_id() -> dict:
    """This host and its GPUs' UUIDs (``nvidia-smi``; empty without one): a resumed report takes arms
    only from the same machine (the device tool's rule: compare timings on the same warm machine)."""
    import platform
    uuids: List[str] = []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0:
            uuids = [x.strip() for x in out.stdout.splitlines() if x.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return dict(host=platform.node(), gpus=uuids)


def resume_key(settings: dict, machine: dict) -> dict:
    return dict({k: settings.get(k) for k in RESUME_SETTINGS}, machine=machine)


def save_resume(path: str, key: dict, arms: List[dict], outputs: Dict[str, Dict[int, list]],
                counts: Dict[int, int]) -> None:
    """The state after an arm: the key, every arm record so far, their identity outputs, the level counts."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(key=key, arms=arms, outputs={a: {str(c): v for c, v in o.items()} for a, o in outputs.items()},
                       counts={str(c): n for c, n in counts.items()}), f)
    os.replace(tmp, path)


def level_complete(lv: dict) -> bool:
    """A level that ran every repeat (``short`` ones too: a complete run reports them so)."""
    return not lv.get("partial") and bool(lv.get("output_throughput_repeats"))


def load_resume(path: str, key: dict) -> Tuple[Dict[str, tuple], Dict[int, int], Optional[str], Dict[str, list]]:
    """({arm: (record, outputs)} of the state's complete arms (status ok), in its order, {c: requests
    per level}, None, {arm: its complete levels} of the arms not complete) or ({}, {}, why nothing is
    kept, {}): no state, another machine, other settings."""
    if not os.path.exists(path):
        return {}, {}, f"no {os.path.basename(path)} in the work dir", {}
    try:
        with open(path) as f:
            st = json.load(f)
    except (OSError, ValueError) as e:
        return {}, {}, f"unreadable state: {e}", {}
    old = st.get("key") or {}
    if old.get("machine") != key.get("machine") or not (key.get("machine") or {}).get("gpus"):
        return {}, {}, f"another machine ({old.get('machine')} vs {key.get('machine')})", {}
    diff = sorted(k for k in key if k != "machine" and old.get(k) != key.get(k))
    if diff:
        return {}, {}, f"other settings: {diff}", {}
    outs = st.get("outputs") or {}
    recs = st.get("arms") or []
    kept = {r["name"]: (r, outs.get(r["name"]) or {}) for r in recs if r.get("status") == "ok"}
    levels = {r["name"]: [lv for lv in r.get("levels") or [] if level_complete(lv)] for r in recs
              if r.get("status") != "ok"}
    return (kept, {int(c): int(n) for c, n in (st.get("counts") or {}).items()}, None,
            {a: lvs for a, lvs in levels.items() if lvs})


def identity_report(outputs: Dict[str, Dict[int, list]], ref: str, prompts: List[dict]) -> dict:
    """:func:`stats.identity_check` (compared / mismatched per arm) plus, per arm, every request's
    verdict: None = identical, else the first differing position (or 'failed')."""
    res = identity_check(outputs, ref)
    R = outputs.get(ref) or {}
    for arm, outs in outputs.items():
        if arm == ref or arm not in res["arms"]:
            continue
        per = []
        for c, ids in sorted(outs.items()):
            ref_ids = R.get(c) or []
            for i, x in enumerate(ids):
                y = ref_ids[i] if i < len(ref_ids) else None
                per.append("failed" if x is None or y is None else first_diff(x, y))
        res["arms"][arm]["first_divergence"] = per
    return res


def arm_share_end(arms_left: list, loads: list, deadline_at: Optional[float], now: float) -> Optional[float]:
    """``--arm-shares``: when the first of ``arms_left`` (the arm about to start, then the rest in
    order) must end its levels: ``now`` + an equal share of the time left among the arms of
    ``arms_left`` that some load has not kept (``--resume``).  None without a deadline."""
    if deadline_at is None:
        return None
    k = sum(1 for a in arms_left if any(a["name"] not in L.kept for L in loads))
    return now + max(0.0, deadline_at - now) / max(1, k)


def _measure_arm(arm, opts, port, args, levels, maxc, loads, python, cenv, tmpdir, deadline_at, launcher,
                 id_prompts, share_at: Optional[float] = None) -> List[dict]:
    """One arm: its server started once, every workload of ``loads`` measured on it in turn (warm-up
    pass, levels, stage split), then the identity requests once.  ``share_at``: its levels end by
    then (``--arm-shares``; the identity requests still have until ``deadline_at``).  -> one record
    per load."""
    from .runner import _profiles_by_window, profile_env, requests_per_level
    cmd = serving_server_cmd(arm, opts, port)
    env = dict(os.environ)
    env.update(arm.get("env") or {})
    prof = profile_env(arm, env, tmpdir, args.profile_every) if getattr(args, "serving_profile", False) else None
    log_path = os.path.join(tmpdir, f"server_{arm['name']}.log")
    client_log = os.path.join(tmpdir, f"bench_serving_{arm['name']}.log")
    recs = [dict(name=arm["name"], kind=arm["kind"], algo=arm["algo"], budget=arm["budget"], command=cmd,
                 command_str=shlex.join(cmd), env={k: v for k, v in (arm.get("env") or {}).items()},
                 attention_backend=arm_backend(opts.get("attention"), arm["name"]), status="failed", levels=[],
                 log=log_path, client_log=client_log) for _ in loads]
    print(f"[{arm['name']}] {shlex.join(cmd)}", flush=True)
    if deadline_at is not None and deadline_at - time.time() < args.min_arm_s:
        for rec in recs:
            rec.update(status="skipped", error="deadline")
        return recs
    t0 = time.time()
    server = None
    bsc = make_client(args, cenv, tmpdir, client_log)
    rlog = regime_log.RegimeLog(log_path)    # its regime controller's report lines, if it has one

    def flush():   # one short request: its decode launch logs the regime line due (regime_log.await_line)
        client.run_level(f"http://127.0.0.1:{port}", id_prompts[:1], 1, 2, deadline_at, progress=False, timeout=60)

    def left(default=3600.0):
        return default if deadline_at is None else max(5.0, deadline_at - time.time())

    sizing_margin = max(args.level_seconds_margin, MIN_SIZING_MARGIN)   # what a sizing pass scales to
    # the levels stop this much before the deadline: the identity requests after them are the arm's
    # lossless verdict (s40: a level started with 16 s left, and the identity found no time at all)
    levels_until = None if deadline_at is None else deadline_at - args.identity_reserve_s
    if share_at is not None:
        levels_until = min(levels_until, share_at - args.identity_reserve_s)
        share_s = round(share_at - time.time(), 1)
        print(f"[{arm['name']}] --arm-shares: its levels end {share_s:.0f} s from now "
              f"(identity requests after them)", flush=True)
        for rec in recs:
            rec["share_s"] = share_s

    try:
        server = launcher(cmd, env, log_path)
        why = wait_healthy(f"http://127.0.0.1:{port}", server, min(args.start_timeout, left()))
        start_s = round(time.time() - t0, 1)
        for r in recs:
            r["start_s"] = start_s
        if why:
            for r in recs:
                r.update(error=why, log_tail=log_tail(log_path))
            print(f"[{arm['name']}] FAILED to start: {why}", flush=True)
            return recs
        print(f"[{arm['name']}] up after {start_s} s", flush=True)
        for L, rec in zip(loads, recs):
            if len(loads) > 1:
                print(f"[{arm['name']}] workload {L.name}", flush=True)
            done = {lv["concurrency"]: lv for lv in L.levels_kept.get(arm["name"], [])}
            if args.warmup and not set(levels) <= done.keys():
                # one uncounted pass at the largest concurrency, short outputs
                wn = requests_per_level(args.requests_per_level, maxc, 1 << 30)
                wc = bench_serving_cmd(python, port, opts["model_path"], L.workload, maxc, min(wn, maxc),
                                       os.path.join(tmpdir, f"warmup_{arm['name']}_{L.name}.jsonl"),
                                       args.serving_seed, L.dataset_for(min(wn, maxc)), output_len=16)
                w = bsc.run(wc, left())
                rec["warmup"] = dict(ok=w.get("ok"), seconds=w.get("seconds"), error=w.get("error"),
                                     output_throughput=(w.get("result") or {}).get("output_throughput"))
                if rlog.reports():      # a regime controller: the warm-up's last window closed and logged
                    regime_log.await_line(rlog, time.time(), flush, deadline_at)
            for c in levels:
                if c in done:           # completed by an earlier call on this machine (--resume)
                    rec["levels"].append(dict(done[c], resumed=True))
                    rec.setdefault("resumed_levels", []).append(c)
                    continue
                if levels_until is not None and time.time() > levels_until - 5:
                    rec.setdefault("skipped_levels", []).append(c)
                    continue
                sizing = c not in L.counts and bool(args.min_level_seconds)   # this arm sizes the level
                if c not in L.counts:
                    L.counts[c] = requests_per_level(args.requests_per_level, c, 1 << 30)
                n = L.counts[c]
                if args.level_warmup_waves > 0:
                    # one uncounted pass of W waves at this concurrency, every arm alike: a server that
                    # learns online (regime=auto, the widths' estimates) is then measured past its
                    # first seconds at this load (the reference arm's calibration passes follow it)
                    nw = int(args.level_warmup_waves) * c
                    w = _one_run(args, bsc, port, opts, L.workload, c, nw, L.dataset_for, tmpdir, arm, "lwarm", left())
                    warm = rec.setdefault("level_warmups", {})[str(c)] = dict(
                        num_prompts=nw, ok=w.get("ok"), seconds=w.get("seconds"), error=w.get("error"),
                        duration=(w.get("result") or {}).get("duration"),
                        output_throughput=(w.get("result") or {}).get("output_throughput"))
                else:
                    warm = None
                calibration, reps, passes, sizer = [], [], 1, sizing
                if sizing and warm and warm.get("ok") and (warm.get("duration") or 0.0) > 0.0:
                    # the level's warm-up pass was the server's first traffic at this level, which the
                    # first calibration pass exists to absorb: it sizes the level, and the next pass
                    # counts unless it is short (s40: base's calibration passes took 25 s of its 359)
                    calibration.append(dict(num_prompts=nw, seconds=warm["duration"], ok=True, warmup=True,
                                            output_throughput=warm.get("output_throughput")))
                    n = scaled_count(nw, c, warm["duration"], args.min_level_seconds, sizing_margin)
                while len(reps) < max(1, args.repeats):
                    if (reps or calibration) and levels_until is not None and time.time() > levels_until - 5:
                        break
                    expect = expected_pass_s(reps, calibration, n, warm)
                    if expect and levels_until is not None and levels_until - time.time() < REPEAT_FIT * expect:
                        # a repeat cut by the deadline is device time for nothing: leave it (the level is
                        # partial; --resume runs it again in the next call, keeping the complete ones)
                        rec.setdefault("unstarted_repeats", []).append(c)
                        break
                    tag = f"calib{len(calibration)}" if sizing else f"r{len(reps)}"
                    r = _one_run(args, bsc, port, opts, L.workload, c, n, L.dataset_for, tmpdir, arm, tag, left())
                    if sizing:
                        dur = (r.get("result") or {}).get("duration") or 0.0
                        short = bool(r.get("ok")) and dur < args.min_level_seconds
                        # the first pass never counts (the server's first traffic at this level: it may be
                        # much slower than the next, 2026-12-04 s26: 13.3 s for 64 requests cold, then
                        # 3.2 s for 112); a short pass is re-scaled from and run again
                        if not calibration or (short and len(calibration) < MAX_CALIBRATION_PASSES):
                            calibration.append(dict(num_prompts=n, seconds=dur, ok=r.get("ok"),
                                                    output_throughput=(r.get("result") or {}).get("output_throughput")))
                            if short:   # from the third pass on, one more wave: a pass's fixed cost (ramp-up,
                                # the last wave's tail) makes linear scaling from a warm pass fall a little short
                                n = scaled_count(n, c, dur, args.min_level_seconds, sizing_margin) \
                                    + (c if len(calibration) >= 3 else 0)
                            if not r.get("ok"):
                                sizing = False
                            continue
                        sizing = False         # long enough (or out of calibration passes): the first repeat
                    dur = (r.get("result") or {}).get("duration") or 0.0
                    if not (reps or sizer) and passes == 1 and r.get("ok") and 0.0 < dur < args.min_level_seconds:
                        # faster than the arm that sized the level: each repeat runs the same requests
                        # several times back to back, so it lasts --min-level-seconds with every arm
                        # measuring the same requests (s39: trees at 3.5x base ran 8 s levels)
                        passes = min(MAX_PASSES, math.ceil(MIN_SIZING_MARGIN * args.min_level_seconds / dur))
                    if passes > 1:
                        got = [r]
                        while len(got) < passes and got[-1].get("ok"):
                            if levels_until is not None and levels_until - time.time() < REPEAT_FIT * dur:
                                break
                            got.append(_one_run(args, bsc, port, opts, L.workload, c, n, L.dataset_for, tmpdir,
                                                arm, f"{tag}p{len(got)}", left()))
                        if len(got) < passes:          # cut: not a repeat of this level
                            rec.setdefault("unstarted_repeats", []).append(c)
                            break
                        r = merge_passes(got)
                    reps.append(r)
                L.counts[c] = n
                lv = level_summary(c, n, reps, args.min_level_seconds)
                lv["command"] = reps[0].get("command") if reps else None
                if reps and all(r.get("window") for r in reps):   # the counted repeats, for --serving-profile
                    lv["_window"] = (reps[0]["window"][0], reps[-1]["window"][1])
                if len(reps) < max(1, args.repeats):     # cut by the deadline: not a complete level
                    lv.update(partial=True, missing_repeats=max(1, args.repeats) - len(reps))
                if calibration:
                    lv["calibration"] = calibration[0]
                    lv["calibration_passes"] = calibration
                rec["levels"].append(lv)
                print(f"[{arm['name']}] c={c:3d} n={n}: {lv.get('output_throughput')} tok/s (repeats "
                      f"{lv['output_throughput_repeats']}), TTFT med {lv.get('median_ttft_ms')} ms, ITL med "
                      f"{lv.get('median_itl_ms')} ms, accept {lv.get('accept_length')}, failed {lv.get('failed')}"
                      f"{' SHORT' if lv.get('short') else ''}{' ERRORS ' + str(lv['errors'])[:300] if lv.get('errors') else ''}"
                      f"{' (calibration ' + ', '.join(str(x['num_prompts']) + ' in ' + _f(x['seconds']) + ' s' for x in calibration) + ')' if calibration else ''}",
                      flush=True)
                if lv.get("_window") and rlog.reports():   # a server with a regime controller: its share
                    regime_log.await_line(rlog, lv["_window"][1], flush, deadline_at)
                    lv["regime"] = regime_log.level_regime(rlog.reports(), lv["_window"])
                    print(f"[{arm['name']}] c={c:3d} regime {regime_log.summary(lv['regime'])}", flush=True)
            if prof is not None:   # each level's split of its counted repeats (a flush request closes the last record)
                _profiles_by_window(rec["levels"], prof, f"http://127.0.0.1:{port}", id_prompts, deadline_at)
            for lv in rec["levels"]:
                lv.pop("_window", None)
        # the identity requests: the same token-id prompts for every arm (and workload), greedy, through /generate
        ic = int(args.identity_concurrency)
        if deadline_at is not None and deadline_at - time.time() < 1.0:
            # no time left: not run, and said so (not 16 requests "failed" in 0 s, s40)
            ident = dict(n=len(id_prompts), concurrency=ic, seconds=0.0, partial=True, failed=0,
                         not_run="deadline")
        else:
            res, dur, partial = client.run_level(f"http://127.0.0.1:{port}", id_prompts, ic,
                                                 args.identity_new_tokens, deadline_at,
                                                 desc=f"{arm['name']} identity", progress=False,
                                                 timeout=min(600.0, left() + 30))
            ident = dict(n=len(id_prompts), concurrency=ic, seconds=round(dur, 2), partial=bool(partial),
                         failed=sum(1 for r in res if not (r and r.get("ok"))))
        for L, rec in zip(loads, recs):
            if not ident.get("not_run"):
                L.outputs[arm["name"]] = {ic: [r["output_ids"] if r and r.get("ok") else None for r in res]}
            rec["identity_requests"] = dict(ident)
            rec["status"] = "ok" if rec["levels"] and all(not lv.get("partial") for lv in rec["levels"]) \
                and not rec.get("skipped_levels") and not rec["identity_requests"]["failed"] \
                and not rec["identity_requests"].get("not_run") else "partial"
    except Exception as e:  # noqa: BLE001 - one arm's failure never stops the others
        for r in recs:
            if r["status"] == "failed":
                r.update(error=repr(e)[:1000], log_tail=log_tail(log_path))
        print(f"[{arm['name']}] ERROR {e!r}", flush=True)
    finally:
        bsc.close()
        info = bsc.info()
        stop_error = None
        if server is not None:
            try:
                server.stop()
            except Exception as e:  # noqa: BLE001
                stop_error = repr(e)
        total_s = round(time.time() - t0, 1)
        final = rlog.reports()
        for r in recs:
            r["client"] = info
            r["total_s"] = total_s
            if stop_error:
                r["stop_error"] = stop_error
            if final:                           # the regime controller's totals over the server's life
                r["regime_final"] = final[-1].d
    return recs


def _one_run(args, bsc, port, opts, workload, c, n, dataset_for, tmpdir, arm, tag, timeout):
    out = os.path.join(tmpdir, f"bs_{arm['name']}_{workload['name']}_c{c}_{tag}.jsonl")
    cmd = bench_serving_cmd(opts["python"], port, opts["model_path"], workload, c, n, out, args.serving_seed,
                            dataset_for(n))
    t0 = time.time()
    r = bsc.run(cmd, timeout)
    r["command"] = shlex.join(cmd)
    r["window"] = [t0, time.time()]
    return r


REPEAT_FIT = 1.15       # a repeat starts only with this x its expected wall time left before the deadline


def expected_pass_s(reps: list, calibration: list, n: int, warmup: Optional[dict] = None) -> Optional[float]:
    """The wall time the level's next pass of ``n`` requests should take: the previous repeat's, else
    the last calibration pass's scaled to ``n`` (s39: a first repeat of 352 requests started with 23 s
    left after a 64-request calibration of 5.6 s, and the deadline failed all 352), else the level's
    warm-up pass (``--level-warmup-waves``) scaled to ``n`` (s40: an arm that did not size the level
    started 1152 requests with 16 s left after a 320-request warm-up of 9.5 s), else None."""
    last = reps[-1] if reps else None
    if last is not None and last.get("window"):
        return last["window"][1] - last["window"][0]
    for p in (calibration[-1] if calibration else None, warmup):
        if p and p.get("ok", True) and p.get("seconds") and p.get("num_prompts"):
            return p["seconds"] * n / p["num_prompts"]
    return None


# ------------------------------------------------------------------------------------------ report
def _f(v, nd=1):
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _level(arm, c):
    return next((lv for lv in arm.get("levels") or [] if lv["concurrency"] == c), None)


def _tput(arm, c):
    lv = _level(arm, c) if arm else None
    return lv.get("output_throughput") if lv and not lv.get("partial") else None


def identity_verdict(doc: dict, name: str) -> str:
    idn = doc.get("identity") or {}
    if name == idn.get("reference"):
        return "reference"
    d = (idn.get("arms") or {}).get(name)
    if not d or not d.get("compared"):
        rec = next((a for a in doc.get("arms") or [] if a.get("name") == name), None) or {}
        why = (rec.get("identity_requests") or {}).get("not_run")
        return f"not run ({why})" if why else "-"
    if not d["mismatched"]:
        return f"identical ({d['compared']} of {d['compared']})"
    cls = ((idn.get("classification") or {}).get("arms") or {}).get(name)
    txt = f"{d['mismatched']} of {d['compared']} differ"
    if cls:
        txt += f" ({cls['near_tie']} near ties, {cls['error']} errors)"
    return txt


def render_markdown(doc: dict) -> str:
    s, m = doc["settings"], doc.get("meta") or {}
    v = m.get("versions") or {}
    w = s["workload"]
    levels = sorted(s["concurrency"])     # run in the order given (the most wanted first), shown ascending
    arms = doc["arms"]
    by = {a["name"]: a for a in arms}
    title = "the text-trained pair (bench/textpair)" if s.get("pair") == "text" else os.path.basename(
        str(s.get("model_path")))
    L = [f"# A/B under sglang.bench_serving: {title}, workload {w['name']}", "",
         f"{m.get('date', '?')} · GPU {', '.join(m.get('gpu') or ['?'])} · torch {v.get('torch')} · triton "
         f"{v.get('triton')} · sglang {v.get('sglang')} · commit {m.get('git_commit')}"
         f"{' (dirty)' if m.get('git_dirty') else ''} · {doc.get('elapsed_s')} s", ""]
    if doc.get("resumed"):
        old = [a for a in arms if a.get("resumed")]
        L += ["Resumed (`--resume`): " + ", ".join(
            f"`{a['name']}` measured by an earlier call at {a.get('measured_at', '?')} (commit {a.get('git_commit')})"
            for a in old) + f" on this machine (GPU {', '.join((m.get('machine') or {}).get('gpus') or ['?'])}), "
              "same settings and request counts.", ""]
    if w["dataset"] == "sharegpt":
        nat = s.get("natural") or {}
        wl = (f"natural prompts ({nat.get('source')}; distinct per level {nat.get('distinct')}) as a ShareGPT file, "
              f"`--dataset-name sharegpt --sharegpt-output-len {w['output_len']}` (text; the server tokenizes)")
    elif w["dataset"] == "custom":
        ids = s.get("ids") or {}
        wl = (f"the pair's own prompts as token ids ({ids.get('prompts')} from {ids.get('source')}, "
              f"{'-'.join(str(x) for x in ids.get('input_len') or [])} tokens, cycled in order), "
              f"`--dataset-name custom` through `python -m {IDS_MODULE}` (bench_serving, its custom dataset "
              f"also reading token-id rows), output {max(int(w['output_len'] * w['range_ratio']), 1)}-"
              f"{w['output_len']} tokens (range ratio {w['range_ratio']})")
    else:
        lo = max(int(w["input_len"] * w["range_ratio"]), 1)
        wl = (f"`--dataset-name {w['dataset']} --tokenize-prompt` (token ids), input {lo}-{w['input_len']}, output "
              f"{max(int(w['output_len'] * w['range_ratio']), 1)}-{w['output_len']} tokens "
              f"(range ratio {w['range_ratio']})")
    L += [f"Target `{s['model_path']}`, drafter `{s['draft_model_path']}`. Load: SGLang's own client, "
          f"`python -m sglang.bench_serving --backend sglang`, {wl}, greedy (temperature 0, ignore_eos), all requests "
          f"sent at once with at most c in flight (`--max-concurrency c --request-rate inf`), seed {s.get('seed')}. "
          f"Requests per level {s.get('requests_per_level')} (first count {s.get('requests_per_level_spec')}, scaled by "
          f"the first arm so a level lasts >= {s.get('min_level_seconds')} s x {s.get('level_seconds_margin')}); each "
          f"level run {s.get('repeats')} times, the median output tok/s reported"
          + (f", each arm's level preceded by one uncounted pass of {s['level_warmup_waves']} x c requests "
             "(`--level-warmup-waves`)" if s.get("level_warmup_waves") else "")
          + ". Every arm launched with only its own "
          f"flags (attention backends {s.get('arm_attention') or 'none'}; every arm also gets `{s.get('server_args') or ''}`). "
          "Command: `" + " ".join(m.get("argv") or []) + "`.", ""]
    hdr = "| arm | " + " | ".join(f"c={c}" for c in levels) + " | outputs vs base |"
    sep = "|---|" + "---:|" * len(levels) + "---|"
    L += ["## Output tokens per second (x base / x dflash), median of repeats", "", hdr, sep]
    for a in arms:
        cells = []
        for c in levels:
            t, lv = _tput(a, c), _level(a, c)
            cut = t is None and lv is not None and bool(lv.get("output_throughput"))
            if cut:     # a level the deadline cut after complete repeats: their median, marked partial
                t = lv["output_throughput"]
            if t is None:
                cells.append("-" if lv is None else "failed")
                continue
            r = []
            for ref in ("base", "dflash"):
                rt = _tput(by.get(ref), c)
                r.append("1.00x" if a["name"] == ref else f"{t / rt:.2f}x" if rt else "-")
            note = "" if not cut else \
                f" partial ({lv['repeats']} of {lv['repeats'] + lv['missing_repeats']} repeats)" \
                if lv.get("missing_repeats") else f" partial ({lv.get('failed')} failed)"
            cells.append(f"{t:.0f} ({' / '.join(r)}){' short' if lv.get('short') else ''}{note}")
        L.append(f"| {a['name']} | " + " | ".join(cells) + f" | {identity_verdict(doc, a['name'])} |")

    def table(title, cell):
        L.extend(["", f"## {title}", "", "| arm | " + " | ".join(f"c={c}" for c in levels) + " |",
                  "|---|" + "---:|" * len(levels)])
        for a in arms:
            L.append(f"| {a['name']} | " + " | ".join(
                "-" if lv is None else cell(lv) for lv in (_level(a, c) for c in levels)) + " |")

    table("Every repeat's output tok/s", lambda lv: " / ".join(_f(x, 0) for x in lv.get("output_throughput_repeats") or []))
    table("Latency (ms): TTFT median / p99, ITL median / p99, TPOT median / p99",
          lambda lv: " / ".join(_f(lv.get(k)) for k in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                                                          "median_tpot_ms", "p99_tpot_ms")))
    table("Requests: completed / sent, duration (s), request/s, accept length (server)",
          lambda lv: f"{lv.get('completed')}/" + (f"{lv.get('num_prompts')}" if not lv.get('passes_per_repeat') else
                                                    f"{lv['num_prompts'] * lv['passes_per_repeat']} "
                                                    f"({lv['passes_per_repeat']} passes)") + ", "
                     f"{_f(lv.get('duration'))} s, "
                     f"{_f(lv.get('request_throughput'), 2)}, {_f(lv.get('accept_length'), 2)}")
    ra = [a for a in arms if regime_log.has_regime_controller(a)]
    if ra:   # arms with a regime controller only (sglang_ddtree/ab/regime_log.py)
        L.extend(["", "## Regime (the server's regime controller over each level's counted repeats, from its log): "
                  "spec share of plain + spec busy time, decided switches (trips: plain decoding only to measure it in a new state, and their share of busy time), exploration share of busy time", "",
                  "| arm | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---:|" * len(levels)])
        for a in ra:
            L.append(f"| {a['name']} | " + " | ".join(
                regime_log.summary(lv["regime"]) if lv and lv.get("regime") else "-"
                for lv in (_level(a, c) for c in levels)) + " |")
        tot = [f"- `{a['name']}` whole server (its last report): {regime_log.total_summary(a['regime_final'])}"
               for a in ra if a.get("regime_final")]
        L += [""] + tot if tot else []
    if any(lv.get("stage_profile") for a in arms for lv in a.get("levels") or []):
        def split(lv):
            sp = lv.get("stage_profile")
            if not sp:
                return "-"
            bw = sp.get("by_width") or {}
            widths = ", ".join(f"w{k}: {v['rounds']} x {_f(v.get('round_ms'), 2)}" for k, v in sorted(
                bw.items(), key=lambda kv: int(kv[0])))
            return (f"{sp['rounds']} rounds, bs {_f(sp.get('bs_mean'))}, GPU {_f(sp.get('round_ms'), 2)}, host "
                    f"{_f(sp.get('host_ms'), 2)}, ITL {_f(lv.get('median_itl_ms'), 2)}" + (f"; {widths}" if widths else ""))
        table("Round split (`--serving-profile`: the server's own records; ms, per-record medians weighted by "
              "rounds: GPU = the round between CUDA events, host = the worker call's host time, per verify width "
              "w: rounds x GPU ms)", split)
    idn = doc.get("identity") or {}
    ist = s.get("identity") or {}
    L += ["", "## Identity: greedy outputs against the reference arm's, token for token", "",
          f"{ist.get('prompts')} prompts ({ist.get('source')}; token ids, {ist.get('tokenized_with')}, sha256 "
          f"{ist.get('sha256_16')}), {ist.get('new_tokens')} new tokens, {ist.get('concurrency')} in flight, "
          f"through `/generate` with `input_ids` after the arm's levels. Per request: `=` identical, else the first "
          "differing position.", "", "| arm | verdict | per request |", "|---|---|---|"]
    for a in arms:
        d = (idn.get("arms") or {}).get(a["name"]) or {}
        per = " ".join("=" if x is None else str(x) for x in d.get("first_divergence") or [])
        L.append(f"| {a['name']} | {identity_verdict(doc, a['name'])} | {per or '-'} |")
    bad = [a for a in arms if a.get("status") != "ok"]
    if bad:
        L += ["", "## Arms not fully measured", ""]
        for a in bad:
            L.append(f"- `{a['name']}`: {a.get('status')}: {a.get('error', '')}"
                     + "".join(f" c={lv['concurrency']}: {str(lv.get('errors'))[:200]}" for lv in a.get("levels") or []
                               if lv.get("errors")))
    L += ["", "## Server command lines", ""]
    for a in arms:
        env = " ".join(f"{k}={v}" for k, v in (a.get("env") or {}).items())
        L.append(f"- `{a['name']}` (up in {a.get('start_s')} s{', an earlier call' if a.get('resumed') else ''}): "
                 f"`{(env + ' ') if env else ''}{a.get('command_str')}`")
    ex = next((lv for a in arms for lv in a.get("levels") or [] if lv.get("command")), None)
    if ex is not None:
        L += ["", f"The client, one level (c={ex['concurrency']}, the first repeat): `{ex['command']}`"]
    L += ["", "## Definitions", ""] + [f"- {k}: {v}" for k, v in (doc.get("definitions") or {}).items()]
    return "\n".join(L).rstrip() + "\n"
