"""``sglang_ddtree.ab --client bench_serving`` (sglang_ddtree/ab/serving_client.py) on the CPU: the
bench_serving command line of each workload and level, its result line, the ``datasets`` stand-in,
the level sizing, and a whole run in which the real ``python -m sglang.bench_serving`` drives a fake
SGLang server that speaks enough of ``/generate``'s streaming protocol."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_ddtree.ab import cli, serving_client as S
from sglang_ddtree.ab.report import render_markdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "bench", "textpair", "tokenizer")


def _has_bench_serving():
    import importlib.util
    return importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("aiohttp") is not None


needs_sglang = pytest.mark.skipif(not _has_bench_serving(), reason="needs SGLang (sglang.bench_serving) and aiohttp")


def _args(*extra):
    return cli.build_parser().parse_args(["--client", "bench_serving", *extra])


# ------------------------------------------------------------------------------------------ command lines
def _opt(cmd, flag):
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("name,dataset,inp,out,ratio", [
    ("random", "random-ids", "512", "256", "1.0"),
    ("long", "random-ids", "8192", "256", "1.0"),
    ("mix", "random-ids", "4096", "256", "0.0625"),
    ("varied", "random-ids", "512", "256", "0.5"),
])
def test_command_line_of_each_random_workload(name, dataset, inp, out, ratio):
    w = S.workload_settings(name)
    for c, n in ((1, 20), (4, 48), (16, 160), (64, 512)):
        cmd = S.bench_serving_cmd("PY", 31000, "/m/t", w, c, n, "/tmp/o.jsonl", seed=7)
        assert cmd[:3] == ["PY", "-m", "sglang.bench_serving"]
        assert _opt(cmd, "--backend") == "sglang" and _opt(cmd, "--port") == "31000"
        assert _opt(cmd, "--host") == "127.0.0.1"
        assert _opt(cmd, "--dataset-name") == dataset
        assert _opt(cmd, "--num-prompts") == str(n) and _opt(cmd, "--max-concurrency") == str(c)
        assert _opt(cmd, "--request-rate") == "inf" and _opt(cmd, "--seed") == "7"
        assert _opt(cmd, "--random-input-len") == inp and _opt(cmd, "--random-output-len") == out
        assert _opt(cmd, "--random-range-ratio") == ratio
        assert "--tokenize-prompt" in cmd and "--flush-cache" in cmd
        assert _opt(cmd, "--output-file") == "/tmp/o.jsonl"
        assert _opt(cmd, "--model") == "/m/t" and _opt(cmd, "--tokenizer") == "/m/t"
        assert "--sharegpt-output-len" not in cmd and "--dataset-path" not in cmd
    warm = S.bench_serving_cmd("PY", 1, "/m", w, 64, 64, "/o", output_len=16)
    assert _opt(warm, "--random-output-len") == "16"


def test_command_line_of_the_natural_workload_and_overrides(tmp_path):
    w = S.workload_settings("natural")
    with pytest.raises(ValueError):
        S.bench_serving_cmd("PY", 1, "/m", w, 1, 8, "/o")      # needs its dataset file
    cmd = S.bench_serving_cmd("PY", 1, "/m", w, 16, 64, "/o", dataset_path="/d/n.json")
    assert _opt(cmd, "--dataset-name") == "sharegpt" and _opt(cmd, "--dataset-path") == "/d/n.json"
    assert _opt(cmd, "--sharegpt-output-len") == "256"
    assert "--tokenize-prompt" not in cmd and "--random-input-len" not in cmd   # 0.5.16's sharegpt asserts it off
    w2 = S.workload_settings("random", input_len=1000, output_len=64, range_ratio=0.5)
    assert (w2["input_len"], w2["output_len"], w2["range_ratio"]) == (1000, 64, 0.5)
    for bad in (dict(input_len=5), dict(range_ratio=0.5)):
        with pytest.raises(ValueError):
            S.workload_settings("natural", **bad)
    with pytest.raises(ValueError):
        S.workload_settings("sharegpt")
    a = _args("--workload", "mix", "--serving-output-len", "128")
    assert a.workload == "mix" and a.serving_output_len == 128 and a.min_level_seconds == 20.0
    assert cli.build_parser().parse_args([]).client == "ab"      # the default client is unchanged


def test_command_line_of_the_ids_workload():
    """The chain pair's own prompts as token ids: bench_serving's arguments, run through
    sglang_ddtree.ab.bs_ids (its custom dataset reading token-id rows), output 64-256."""
    w = S.workload_settings("ids")
    with pytest.raises(ValueError, match="dataset file"):
        S.bench_serving_cmd("PY", 1, "/m", w, 1, 8, "/o")
    with pytest.raises(ValueError, match="prompts' own"):
        S.workload_settings("ids", input_len=100)
    cmd = S.bench_serving_cmd("PY", 31000, "/m/t", w, 16, 160, "/tmp/o.jsonl", seed=7, dataset_path="/w/ids.jsonl")
    assert cmd[:3] == ["PY", "-m", "sglang_ddtree.ab.bs_ids"]
    assert _opt(cmd, "--dataset-name") == "custom" and _opt(cmd, "--dataset-path") == "/w/ids.jsonl"
    assert _opt(cmd, "--random-output-len") == "256" and _opt(cmd, "--random-range-ratio") == "0.25"
    assert "--tokenize-prompt" not in cmd and "--random-input-len" not in cmd and "--sharegpt-output-len" not in cmd
    assert _opt(cmd, "--num-prompts") == "160" and _opt(cmd, "--max-concurrency") == "16"


def test_bs_ids_rows_and_lengths(tmp_path):
    from sglang_ddtree.ab import bs_ids
    lens = bs_ids.output_lengths(400, 256, 0.25, seed=5)
    assert min(lens) >= 64 and max(lens) <= 256 and len(set(lens)) > 50
    assert lens == bs_ids.output_lengths(400, 256, 0.25, seed=5) != bs_ids.output_lengths(400, 256, 0.25, seed=6)
    assert set(bs_ids.output_lengths(50, 3, 0.0, seed=1)) <= {1, 2, 3}
    with pytest.raises(ValueError):
        bs_ids.output_lengths(4, 0, 0.5, seed=1)
    good = tmp_path / "ids.jsonl"
    good.write_text('{"input_ids": [5, 6, 7]}\n\n{"input_ids": [9]}\n')
    assert bs_ids.is_ids_file(str(good)) and bs_ids.read_ids_rows(str(good)) == [[5, 6, 7], [9]]
    text = tmp_path / "conv.jsonl"
    text.write_text(json.dumps({"conversations": [{"value": "hi"}, {"value": "ok"}]}) + "\n")
    assert not bs_ids.is_ids_file(str(text)) and not bs_ids.is_ids_file(str(tmp_path / "absent.jsonl"))
    for bad in ('{"input_ids": []}', '{"input_ids": [1, -2]}', '{"input_ids": [1, true]}', '{"input_ids": "12"}',
                '{"input_ids": [1.5]}'):
        f = tmp_path / "bad.jsonl"
        f.write_text('{"input_ids": [3]}\n' + bad + "\n")
        with pytest.raises(ValueError, match="line 2"):
            bs_ids.read_ids_rows(str(f))


@needs_sglang
def test_ids_workload_sends_the_file_rows_as_token_ids_through_the_real_bench_serving(tmp_path):
    """bench_serving (per pass: `python -m sglang_ddtree.ab.bs_ids`; persistent: the client process
    installs the loader) sends request i the file's row i mod rows as input_ids with the output length
    drawn from the seed; SGLang's own custom loader still reads a conversation file (the hook takes
    token-id files only); and a whole --workload ids run reports where its prompts came from."""
    from sglang_ddtree.ab import bs_ids
    model = _model_dir(tmp_path)
    rows = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]]
    f = bs_ids.write_ids_rows(rows, str(tmp_path / "ids.jsonl"))
    port = _free_port()
    srv = FakeServer(["x", "--port", str(port)], model)
    w = S.workload_settings("ids", output_len=8, range_ratio=0.5)
    env = S.client_env(None, None)
    want = bs_ids.output_lengths(10, 8, 0.5, seed=3)
    bsc = S.PersistentClient(env, str(tmp_path), str(tmp_path / "p.log"))
    try:
        for how in ("per-pass", "persistent"):
            k = len(srv.requests)
            cmd = S.bench_serving_cmd(sys.executable, port, model, w, 1, 10, str(tmp_path / f"{how}.jsonl"), seed=3,
                                      dataset_path=f, warmup_requests=0)
            r = (S.run_bench_serving(cmd, env, str(tmp_path), 300, str(tmp_path / "pp.log")) if how == "per-pass"
                 else bsc.run(cmd, 300))
            assert r["ok"], (how, open(tmp_path / ("pp.log" if how == "per-pass" else "p.log")).read()[-3000:])
            got = srv.requests[k:]
            assert [list(x["ids"]) for x in got] == [rows[i % 4] for i in range(10)], how     # c = 1: in order
            assert [x["max_new"] for x in got] == want and all(x["kind"] == "ids" for x in got)
            assert r["result"]["total_input_tokens"] == sum(len(rows[i % 4]) for i in range(10))
            assert r["result"]["total_output_tokens"] == sum(want)
        # the same process then runs a random-ids pass unchanged
        k = len(srv.requests)
        cmd = S.bench_serving_cmd(sys.executable, port, model, S.workload_settings("random", input_len=20, output_len=4),
                                  2, 4, str(tmp_path / "rnd.jsonl"), seed=3, warmup_requests=0)
        assert bsc.run(cmd, 300)["ok"] and bsc.info()["processes"] == 1
        assert all(x["n_in"] == 20 and x["max_new"] == 4 for x in srv.requests[k:])
    finally:
        bsc.close()
        srv.stop()
    # SGLang's own custom loader behind the hook, for a file that is not token ids
    import argparse
    from sglang.benchmark import datasets as D
    bs_ids.install()
    bs_ids.install()                                        # idempotent
    assert D.DATASET_MAPPING["custom"].reads_token_ids and D.DATASET_MAPPING["custom"].__mro__[1].__name__ == "CustomDataset"
    conv = tmp_path / "conv.jsonl"
    conv.write_text("\n".join(json.dumps({"conversations": [{"value": f"say {i} words"}, {"value": "ok fine"}]})
                              for i in range(3)) + "\n")
    a = argparse.Namespace(dataset_path=str(conv), num_prompts=2, sharegpt_output_len=5, sharegpt_context_len=None,
                           prompt_suffix="", apply_chat_template=False, tokenize_prompt=False, seed=1,
                           random_output_len=9, random_range_ratio=0.5)
    from transformers import AutoTokenizer
    rows_text = D.DATASET_MAPPING["custom"].from_args(a).load(tokenizer=AutoTokenizer.from_pretrained(model))
    assert len(rows_text) == 2 and all(isinstance(r.prompt, str) and r.output_len == 5 for r in rows_text)


@needs_sglang
def test_a_whole_ids_run_reports_its_prompts(tmp_path):
    model = _model_dir(tmp_path)
    prompts = tmp_path / "chain.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [7 + i, 8 + i, 9 + i][: 1 + i % 3]}) for i in range(5)))
    out = str(tmp_path / "rep")
    args = _args("--model-path", model, "--arms", "base", "--workload", "ids", "--concurrency", "2",
                 "--requests-per-level", "6", "--repeats", "1", "--warmup", "0", "--min-level-seconds", "0",
                 "--serving-output-len", "6", "--identity-prompts", "2", "--identity-new-tokens", "4",
                 "--port", str(_free_port()), "--workdir", str(tmp_path / "w"), "--out", out, "--no-env-probe",
                 "--prompts", str(prompts))
    servers = []

    def launcher(cmd, env, log_path):
        servers.append(FakeServer(cmd, model))
        return servers[-1]
    doc = S.run(args, launcher=launcher)
    lv = doc["arms"][0]["levels"][0]
    assert doc["arms"][0]["status"] == "ok" and lv["completed"] == 6 and lv["dataset_name"] == "custom"
    load = [r for r in servers[0].requests if r["max_new"] != 4]
    assert {r["ids"] for r in load} <= {(7,), (8, 9), (9, 10, 11), (10,), (11, 12)} and all(r["kind"] == "ids" for r in load)
    ids = doc["settings"]["ids"]
    assert ids["prompts"] == 5 and ids["input_len"] == [1, 3] and ids["source"] == str(prompts)
    md = open(out + ".md").read()
    assert "the pair's own prompts as token ids (5 from" in md and "output 1-6 tokens (range ratio 0.25)" in md


def test_server_command_is_what_a_user_types():
    opts = dict(python="PY", model_path="/t", draft_model_path="/d",
                attention=S.parse_arm_attention(S.DEFAULT_ARM_ATTENTION), server_args="--context-length 9000")
    arms = {a["name"]: a for a in S.parse_serving_arms(S.SERVING_DEFAULT_ARMS + ",ddtree_b15")}
    assert list(arms)[0] == "base"
    base = S.serving_server_cmd(arms["base"], opts, 100)
    assert base == ["PY", "-m", "sglang.launch_server", "--model-path", "/t", "--host", "127.0.0.1", "--port", "100",
                    "--attention-backend", "flashinfer", "--context-length", "9000"]
    df = S.serving_server_cmd(arms["dflash"], opts, 110)
    assert _opt(df, "--attention-backend") == "flashinfer" and _opt(df, "--speculative-algorithm") == "DFLASH"
    assert "--speculative-num-draft-tokens" not in df
    dd = S.serving_server_cmd(arms["ddtree"], opts, 120)
    assert _opt(dd, "--speculative-algorithm") == "DDTREE-GPU" and _opt(dd, "--speculative-draft-model-path") == "/d"
    # every arm on the kit's best backend (the DDTREE arm's prefill and plain rounds as base's)
    assert _opt(dd, "--attention-backend") == "flashinfer" and "--speculative-num-draft-tokens" not in dd
    own = S.parse_arm_attention("*=flashinfer,ddtree=triton")
    assert S.arm_backend(own, "ddtree") == "triton" and S.arm_backend(own, "base") == "flashinfer"
    assert S.arm_backend(S.parse_arm_attention("base=flashinfer"), "ddtree") is None
    for flag in ("--skip-tokenizer-init", "--mem-fraction-static", "--max-running-requests", "--skip-server-warmup"):
        assert flag not in dd + base + df      # bench_serving needs the server's tokenizer; nothing else is tuned
    assert _opt(S.serving_server_cmd(arms["ddtree_b15"], opts, 1), "--speculative-num-draft-tokens") == "16"
    with pytest.raises(ValueError):
        S.parse_serving_arms("ddtree_auto_pin15")
    with pytest.raises(ValueError):
        S.parse_arm_attention("base:flashinfer")
    assert S.parse_arm_attention("none") == {}


# ------------------------------------------------------------------------------------------ result line
# bench_serving 0.5.16's result keys (sglang/benchmark/serving.py, `result = {...}` in benchmark())
RESULT_KEYS_0516 = (
    "tag", "backend", "dataset_name", "request_rate", "max_concurrency", "sharegpt_output_len", "random_input_len",
    "random_output_len", "random_range_ratio", "server_info", "duration", "completed", "total_input_tokens",
    "total_input_text_tokens", "total_input_vision_tokens", "total_output_tokens", "total_output_tokens_retokenized",
    "request_throughput", "input_throughput", "output_throughput", "total_throughput", "mean_e2e_latency_ms",
    "median_e2e_latency_ms", "std_e2e_latency_ms", "p90_e2e_latency_ms", "p95_e2e_latency_ms", "p99_e2e_latency_ms",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "median_tpot_ms", "std_tpot_ms", "p90_tpot_ms", "p95_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
    "std_itl_ms", "p90_itl_ms", "p95_itl_ms", "p99_itl_ms", "concurrency", "accept_length",
    "max_output_tokens_per_s", "max_concurrent_requests")


def test_parse_a_result_line_with_the_0516_field_names(tmp_path):
    line = {k: None for k in RESULT_KEYS_0516}
    line.update(output_throughput=1234.5, completed=60, duration=21.5, median_ttft_ms=12.0, median_itl_ms=3.5,
                p99_itl_ms=9.0, request_throughput=2.79, accept_length=2.4, total_output_tokens=15360)
    f = tmp_path / "o.jsonl"
    f.write_text(json.dumps(dict(line, output_throughput=1.0)) + "\n" + json.dumps(line) + "\n")
    r = S.parse_result_file(str(f))      # the last line (bench_serving appends)
    assert r["output_throughput"] == 1234.5 and r["completed"] == 60 and r["accept_length"] == 2.4
    assert set(S.RESULT_FIELDS) <= set(RESULT_KEYS_0516)
    with pytest.raises(ValueError):
        S.parse_result_line(json.dumps({"completed": 1}))
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ValueError):
        S.parse_result_file(str(tmp_path / "e.jsonl"))


@needs_sglang
def test_result_keys_match_the_installed_bench_serving():
    """The keys above are those the installed bench_serving writes (read from its source)."""
    import re
    import sglang.benchmark.serving as bs  # noqa: F401 - the import path the source lives under
    src = open(bs.__file__).read()
    block = src[src.index("result = {"):src.index("if args.cache_report:", src.index("result = {"))]
    keys = tuple(re.findall(r'^\s*"([a-z0-9_]+)":', block, re.M))
    assert keys == RESULT_KEYS_0516


# ------------------------------------------------------------------------------------------ levels
def test_level_summary_is_the_median_of_the_repeats():
    def rep(t, done=64, dur=25.0):
        return dict(ok=True, result=dict(output_throughput=t, completed=done, duration=dur, median_ttft_ms=t / 10),
                    seconds=dur)
    lv = S.level_summary(16, 64, [rep(100.0), rep(300.0), rep(200.0)], 20.0)
    assert lv["output_throughput"] == 200.0 and lv["median_ttft_ms"] == 20.0
    assert lv["output_throughput_repeats"] == [100.0, 300.0, 200.0] and not lv["partial"] and not lv["short"]
    lv = S.level_summary(16, 64, [rep(100.0, dur=5.0), dict(ok=False, error="boom")], 20.0)
    assert lv["short"] and lv["partial"] and lv["errors"] == ["boom"]
    lv = S.level_summary(16, 64, [rep(100.0, done=60)], 20.0)
    assert lv["failed"] == 4 and lv["partial"]
    assert S.level_summary(1, 8, [dict(ok=False, error="x")], 20)["output_throughput"] is None


def test_scaled_count():
    assert S.scaled_count(16, 4, 4.0, 20.0, 1.5) == 120      # 16 x 30 / 4 = 120
    assert S.scaled_count(64, 64, 2.0, 20.0, 1.0) == 640
    assert S.scaled_count(100, 16, 50.0, 20.0, 1.5) == 100    # long enough already: never fewer
    assert S.scaled_count(10, 3, 1.0, 20.0, 1.5) % 3 == 0


# ------------------------------------------------------------------------------------------ the datasets stand-in
@needs_sglang
def test_datasets_standin_makes_bench_serving_importable(tmp_path):
    """A folder first on PYTHONPATH whose `datasets` raises ImportError stands for a host without the
    package: bench_serving's import fails there, and works with the stand-in put first."""
    blocker = tmp_path / "blocker" / "datasets"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no datasets here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "blocker"))
    code = "import sglang.bench_serving as b; print('IMPORTED', callable(b.cli_main))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path))
    assert r.returncode != 0 and "no datasets here" in r.stderr
    d = S.standin_pythonpath(sys.executable, str(tmp_path / "w"), env)
    assert d and open(os.path.join(d, "datasets", "__init__.py")).read() == S.DATASETS_STANDIN
    assert S.DATASETS_STANDIN.count("\n") == 1
    r = subprocess.run([sys.executable, "-c", code], env=S.client_env(env, d), capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "IMPORTED True" in r.stdout
    # with the real package importable, no stand-in
    assert S.standin_pythonpath(sys.executable, str(tmp_path / "w2"), dict(os.environ)) is None \
        or subprocess.run([sys.executable, "-c", "import datasets"]).returncode != 0


# ------------------------------------------------------------------------------------------ a fake SGLang server
def _tokens(ids, n, diverge_at=None):
    seed = sum(ids) % 997
    out = [(seed + 7 * k) % 200 + 50 for k in range(n)]
    if diverge_at is not None and n > diverge_at and seed % 2 == 0:
        out[diverge_at] += 1
    return out


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, obj, status=200):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        fake = self.server.fake
        if self.path in ("/health_generate", "/health"):
            return self._json({})
        if self.path == "/server_info":
            return self._json({"internal_states": [{"avg_spec_accept_length": fake.accept}]})
        if self.path == "/v1/models":
            return self._json({"data": [{"id": fake.model}]})
        if self.path == "/model_info":
            return self._json({"model_path": fake.model, "tokenizer_path": fake.model})
        self._json({"error": "not found"}, 404)

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/flush_cache":
            fake.flushes += 1
            return self._json({})
        if self.path != "/generate":
            return self._json({"error": "not found"}, 404)
        ids = body.get("input_ids")
        if ids is None:
            ids = fake.tok.encode(body["text"], add_special_tokens=False) if fake.tok else list(body["text"].encode())
        sp = body.get("sampling_params") or {}
        with fake.lock:
            k = len(fake.requests)
            fake.requests.append(dict(n_in=len(ids), max_new=sp.get("max_new_tokens"), kind="ids" if "input_ids" in body
                                      else "text", temperature=sp.get("temperature"), ignore_eos=sp.get("ignore_eos"),
                                      ids=tuple(ids)))
        out = _tokens(ids, int(sp.get("max_new_tokens", 16)), fake.diverge_at)
        delay = fake.request_seconds(k) if fake.request_seconds else 0.0   # the k-th /generate request's time

        def chunk(k):
            return {"text": " ".join(f"w{t}" for t in out[:k]), "output_ids": out[:k],
                    "meta_info": {"prompt_tokens": len(ids), "completion_tokens": k,
                                  "spec_verify_ct": (k + 1) // 2, "finish_reason": {"type": "length"} if k == len(out) else None}}
        if not body.get("stream"):
            return self._json(chunk(len(out)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        steps = range(2, len(out) + 2, 2)      # two tokens per chunk, like a speculative round
        for k in steps:
            if delay:
                time.sleep(delay / len(steps))
            self.wfile.write(b"data: " + json.dumps(chunk(min(k, len(out)))).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


class FakeServer:
    """A fake SGLang server on the port of the launch_server command line it is given."""

    def __init__(self, cmd, model, diverge_at=None, request_seconds=None):
        self.cmd, self.model, self.diverge_at, self.request_seconds = cmd, model, diverge_at, request_seconds
        self.requests, self.flushes, self.lock, self.accept = [], 0, threading.Lock(), 1.0 if diverge_at is None else 2.5
        try:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(model)
        except Exception:  # noqa: BLE001
            self.tok = None
        self.httpd = ThreadingHTTPServer(("127.0.0.1", int(cmd[cmd.index("--port") + 1])), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def poll(self):
        return None

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _model_dir(tmp_path):
    d = tmp_path / "text_target"
    shutil.copytree(TOKENIZER, d)
    return str(d)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_sglang
def test_whole_run_with_the_real_bench_serving_against_a_fake_server(tmp_path):
    """Two arms, one level each: the real `python -m sglang.bench_serving` sends the load (token ids,
    fixed lengths) to a fake server per arm, the result lines are parsed, the identity requests go
    through /generate with input_ids, and the DDTree arm's planted divergence is reported where it is."""
    model = _model_dir(tmp_path)
    servers = []

    def launcher(cmd, env, log_path):
        s = FakeServer(cmd, model, diverge_at=5 if "DDTREE-GPU" in cmd else None)
        servers.append(s)
        return s

    out = str(tmp_path / "rep")
    args = _args("--model-path", model, "--draft-model-path", "/nonexistent/drafter", "--arms", "base,ddtree",
                 "--concurrency", "4", "--requests-per-level", "12", "--repeats", "1", "--warmup", "0",
                 "--min-level-seconds", "0", "--serving-input-len", "40", "--serving-output-len", "8",
                 "--identity-prompts", "4", "--identity-new-tokens", "12", "--identity-concurrency", "2",
                 "--port", str(_free_port()), "--workdir", str(tmp_path / "w"), "--out", out, "--no-env-probe",
                 "--prompts", str(_prompts_file(tmp_path)), "--max-input-tokens", "64", "--save-output-ids")
    doc = S.run(args, launcher=launcher)
    assert [a["name"] for a in doc["arms"]] == ["base", "ddtree"]
    for a, s in zip(doc["arms"], servers):
        assert a["status"] == "ok", (a.get("error"), a.get("levels"), open(a["client_log"]).read()[-3000:])
        lv = a["levels"][0]
        assert lv["concurrency"] == 4 and lv["num_prompts"] == 12 and lv["completed"] == 12 and lv["failed"] == 0
        assert lv["total_output_tokens"] == 12 * 8 and lv["total_input_tokens"] == 12 * 40
        assert lv["output_throughput"] > 0 and lv["median_itl_ms"] is not None and lv["dataset_name"] == "random-ids"
        load = [r for r in s.requests if r["max_new"] == 8]
        # bench_serving's own warm-up request (min(8, 32) tokens) + the 12 of the level, all token ids
        assert len(load) == 13 and all(r["kind"] == "ids" and r["n_in"] == 40 for r in load)
        assert all(r["temperature"] == 0.0 and r["ignore_eos"] for r in s.requests)
        ident = [r for r in s.requests if r["max_new"] == 12]
        assert len(ident) == 4 and all(r["kind"] == "ids" for r in ident)
        assert s.flushes >= 1     # --flush-cache
    assert doc["arms"][1]["levels"][0]["accept_length"] == 2.5
    idn = doc["identity"]["arms"]["ddtree"]
    assert idn["compared"] == 4 and idn["mismatched"] == sum(1 for x in idn["first_divergence"] if x is not None)
    want = [5 if (sum(ids) % 997) % 2 == 0 else None for ids in doc["prompt_ids"]]
    assert idn["first_divergence"] == want
    md = open(out + ".md").read()
    assert md == render_markdown(json.load(open(out + ".json")))
    assert "| ddtree |" in md and "x base" in md and f"{idn['mismatched']} of 4 differ" in md
    row = next(line for line in md.splitlines() if line.startswith("| ddtree |"))
    assert "x /" in row      # a ratio to base in the throughput table


def _prompts_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    texts = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os\nprint(os.getcwd())\n",
             "The quick brown fox jumps over the lazy dog.", "for i in range(10):\n    print(i)\n"]
    f.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    return f


@needs_sglang
def test_natural_workload_sends_text_whose_length_bench_serving_reports(tmp_path):
    """The natural workload's ShareGPT file: bench_serving sends the text, and the prompt lengths it
    reports are the server's tokenizer's (the fake server tokenizes with the same tokenizer)."""
    model = _model_dir(tmp_path)
    args = _args("--model-path", model, "--workload", "natural", "--prompts", str(_prompts_file(tmp_path)))
    args._model = model
    texts, src = S.natural_texts(args, 7)
    assert len(texts) == 7 and texts[5] == texts[0] and src.endswith("prompts.jsonl")
    path = S.write_sharegpt(texts, str(tmp_path / "nat.json"))
    port = _free_port()
    srv = FakeServer(["x", "--port", str(port)], model)
    try:
        cmd = S.bench_serving_cmd(sys.executable, port, model, S.workload_settings("natural", output_len=6), 2, 7,
                                  str(tmp_path / "o.jsonl"), dataset_path=path, warmup_requests=0)
        r = S.run_bench_serving(cmd, S.client_env(None, None), str(tmp_path), 300, str(tmp_path / "bs.log"))
    finally:
        srv.stop()
    assert r["ok"], open(tmp_path / "bs.log").read()[-3000:]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    want = sum(len(tok.encode(t)) for t in texts)
    assert r["result"]["total_input_tokens"] == want == sum(x["n_in"] for x in srv.requests)
    assert all(x["kind"] == "text" and x["max_new"] == 6 for x in srv.requests) and len(srv.requests) == 7


class _Srv:
    def poll(self):
        return None

    def stop(self):
        pass


def _fake_clients(monkeypatch, duration, itl=1.0):
    """Every arm's bench_serving client replaced: a pass of n requests at concurrency c lasts
    duration(arm port, c, n, pass index of that arm) s (output_throughput 100 n / duration, median
    ITL ``itl`` ms).  Returns the (c, n) of every pass, in order."""
    calls = []

    class Client:
        def __init__(self, args, env, cwd, log_path):
            self.k = 0

        def run(self, cmd, timeout):
            n, c = int(_opt(cmd, "--num-prompts")), int(_opt(cmd, "--max-concurrency"))
            calls.append((c, n))
            dur = duration(int(_opt(cmd, "--port")), c, n, self.k)
            self.k += 1
            return dict(ok=True, rc=0, seconds=dur, result=dict(output_throughput=100.0 * n / dur, completed=n,
                                                                duration=dur, median_ttft_ms=1.0, median_itl_ms=itl))

        def close(self):
            pass

        def info(self):
            return dict(mode="fake", passes=self.k)

    monkeypatch.setattr(S, "make_client", Client)
    monkeypatch.setattr(S.client, "run_level", lambda url, prompts, c, m, *a, **k: (
        [dict(ok=True, output_ids=[1, 2, 3]) for _ in prompts], 0.1, False))
    monkeypatch.setattr(S, "wait_healthy", lambda *a, **k: None)
    return calls


def test_levels_are_sized_once_and_shared_by_every_arm(tmp_path, monkeypatch):
    """The first arm's short first pass scales the level's count; the next arm runs that count."""
    calls = _fake_clients(monkeypatch, lambda port, c, n, k: n / (2.0 * c))   # 2 requests per second per slot
    Srv = _Srv
    model = _model_dir(tmp_path)
    args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "dflash,base", "--concurrency", "1,4",
                 "--repeats", "3", "--warmup", "0", "--min-level-seconds", "20", "--level-seconds-margin", "1.5",
                 "--identity-prompts", "2", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r"),
                 "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)))
    doc = S.run(args, launcher=lambda cmd, env, log: Srv())
    # base first: c=1 probe 16 (8 s) -> 16 x 30 / 8 = 60; c=4 probe 16 (2 s) -> 240; dflash reuses them
    assert doc["settings"]["requests_per_level"] == {"1": 60, "4": 240}
    assert calls == [(1, 16)] + [(1, 60)] * 3 + [(4, 16)] + [(4, 240)] * 3 + [(1, 60)] * 3 + [(4, 240)] * 3
    base, dflash = doc["arms"]
    assert base["levels"][0]["calibration"]["num_prompts"] == 16 and "calibration" not in dflash["levels"][0]
    assert [x["num_prompts"] for x in base["levels"][0]["calibration_passes"]] == [16]
    assert all(lv["duration"] >= 20 for a in doc["arms"] for lv in a["levels"])
    assert doc["identity"]["arms"]["dflash"]["identical"]
    md = open(str(tmp_path / "r") + ".md").read()
    assert "identical (2 of 2)" in md and "| base | 200 (1.00x / 1.00x)" in md


def test_each_arm_warms_each_level_up_uncounted_when_asked(tmp_path, monkeypatch):
    """--level-warmup-waves W: before a level, every arm runs one pass of W x c requests that counts
    in no repeat and no level window (the report says so); the sizing arm scales the level's count
    from it, so it runs no uncounted calibration pass of its own (same counts here: 3 requests in
    1.5 s -> 60 at c=1, 12 in 1.5 s -> 240 at c=4).  Control: without it, the passes are the sizing
    (a 16-request calibration pass per level) and the repeats alone."""
    model = _model_dir(tmp_path)

    def run(*extra):
        calls = _fake_clients(monkeypatch, lambda port, c, n, k: n / (2.0 * c))
        args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "dflash,base", "--concurrency",
                     "1,4", "--repeats", "2", "--warmup", "0", "--min-level-seconds", "20", "--level-seconds-margin",
                     "1.5", "--identity-prompts", "2", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r"),
                     "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)), *extra)
        return calls, S.run(args, launcher=lambda cmd, env, log: _Srv())
    calls, doc = run("--level-warmup-waves", "3")
    assert doc["settings"]["requests_per_level"] == {"1": 60, "4": 240}      # as without (the test above)
    assert calls == ([(1, 3)] + [(1, 60)] * 2 + [(4, 12)] + [(4, 240)] * 2
                     + [(1, 3)] + [(1, 60)] * 2 + [(4, 12)] + [(4, 240)] * 2)
    base = doc["arms"][0]
    assert [(x["num_prompts"], x["seconds"], x.get("warmup")) for x in base["levels"][0]["calibration_passes"]] \
        == [(3, 1.5, True)]
    for a in doc["arms"]:
        assert {c: w["num_prompts"] for c, w in a["level_warmups"].items()} == {"1": 3, "4": 12}
        assert [lv["repeats"] for lv in a["levels"]] == [2, 2]
    assert doc["settings"]["level_warmup_waves"] == 3
    assert "preceded by one uncounted pass of 3 x c requests" in open(str(tmp_path / "r") + ".md").read()
    calls, doc = run()
    assert calls == [(1, 16)] + [(1, 60)] * 2 + [(4, 16)] + [(4, 240)] * 2 + [(1, 60)] * 2 + [(4, 240)] * 2
    assert not any("level_warmups" in a for a in doc["arms"])
    assert "uncounted pass of" not in open(str(tmp_path / "r") + ".md").read()


def test_dry_run_through_the_cli_prints_servers_and_client_commands(tmp_path, capsys):
    """`sglang-ddtree-ab --client bench_serving --dry-run`: runner.run hands over to serving_client,
    the default arms are base, DFLASH and DDTREE-GPU default, and nothing starts."""
    model = _model_dir(tmp_path)
    assert cli.main(["--client", "bench_serving", "--model-path", model, "--draft-model-path", "/d", "--dry-run",
                     "--no-env-probe", "--workload", "long", "--concurrency", "1,64", "--workdir", str(tmp_path / "w"),
                     "--prompts", str(_prompts_file(tmp_path)), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert [ln.split("]")[0][1:] for ln in lines] == ["base", "dflash", "ddtree", "c=1", "c=64"]
    assert "--attention-backend flashinfer" in lines[0] and "--speculative-algorithm DDTREE-GPU" in lines[2]
    assert "--random-input-len 8192" in lines[3] and "--num-prompts 16" in lines[3] and "--num-prompts 256" in lines[4]
    assert not os.path.exists(str(tmp_path / "r") + ".json")


# ------------------------------------------------------------------------------------------ level sizing (s26)
def test_a_cold_first_pass_does_not_size_the_level(tmp_path, monkeypatch):
    """2026-12-04 s26 on the H200 (bench/results/raw/serving_h200_text_natural_s26_harness.json.gz,
    --min-level-seconds 20 --level-seconds-margin 1.0 --warmup 0): base's first pass at c=16, the
    server's first traffic, took 13.25 s for 64 requests (1236 tok/s), the count was scaled from it
    to 112, and warm the 112 took 3.2 s (9140 tok/s): the level ran SHORT.  Sizing now re-scales
    from the short 112-pass (to 20 s x 1.05, the least margin: -> 752, 21.1 s), which then counts as
    the first repeat."""
    base_port = _free_port()

    def duration(port, c, n, k):
        if port == base_port:
            return 13.25 if k == 0 else n * 256 / 9140.0
        return n * 256 / 4492.0          # dflash, slower: runs the same count, longer
    calls = _fake_clients(monkeypatch, duration)
    model = _model_dir(tmp_path)
    args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "base,dflash", "--concurrency", "16",
                 "--repeats", "2", "--warmup", "0", "--min-level-seconds", "20", "--level-seconds-margin", "1.0",
                 "--requests-per-level", "64", "--identity-prompts", "2", "--workdir", str(tmp_path / "w"),
                 "--out", str(tmp_path / "r"), "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)),
                 "--port", str(base_port))
    doc = S.run(args, launcher=lambda cmd, env, log: _Srv())
    assert doc["settings"]["requests_per_level"] == {"16": 752}      # not 112
    assert calls == [(16, 64), (16, 112)] + [(16, 752)] * 2 + [(16, 752)] * 2
    base, dflash = doc["arms"]
    lv = base["levels"][0]
    assert [x["num_prompts"] for x in lv["calibration_passes"]] == [64, 112]
    assert lv["calibration"]["num_prompts"] == 64 and lv["calibration"]["seconds"] == 13.25
    assert lv["num_prompts"] == 752 and lv["repeats"] == 2 and not lv["short"] and lv["duration"] >= 20
    assert not dflash["levels"][0]["short"] and dflash["levels"][0]["num_prompts"] == 752
    md = open(str(tmp_path / "r") + ".md").read()
    assert " short" not in md.split("## Every repeat")[0]


def test_calibration_passes_are_bounded(tmp_path, monkeypatch):
    """A server whose pass lasts 1 s whatever the count: at most MAX_CALIBRATION_PASSES uncounted
    passes, then the repeats run at the last count and the level is flagged short."""
    calls = _fake_clients(monkeypatch, lambda port, c, n, k: 1.0)
    model = _model_dir(tmp_path)
    args = _args("--model-path", model, "--arms", "base", "--concurrency", "4", "--repeats", "2", "--warmup", "0",
                 "--min-level-seconds", "20", "--level-seconds-margin", "1.0", "--requests-per-level", "16",
                 "--identity-prompts", "2", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r"),
                 "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)))
    doc = S.run(args, launcher=lambda cmd, env, log: _Srv())
    lv = doc["arms"][0]["levels"][0]
    ns = [x["num_prompts"] for x in lv["calibration_passes"]]
    # x 20 s x 1.05 (the least margin) / 1 s: 16 -> 336 -> 7056 -> capped at 100000 (+ one wave of 4
    # from the third pass on)
    assert ns == [16, 336, 7056, 100004] and len(ns) == S.MAX_CALIBRATION_PASSES
    assert lv["short"] and lv["repeats"] == 2 and len(calls) == S.MAX_CALIBRATION_PASSES + 2


@needs_sglang
def test_level_sizing_against_a_server_slow_on_its_first_pass(tmp_path):
    """The real bench_serving (the persistent client) against a fake server whose pass duration is
    set per request: the first pass's 9 requests (bench_serving's warm-up one and 8) take 0.7 s each,
    every later one 0.05 s, like a server's cold first traffic.  Sized from the first pass alone
    (before: 8 in ~1.4 s -> 16), the level lasted ~0.2 s and was SHORT; now every counted repeat
    lasts >= --min-level-seconds, and all the arm's passes ran in one client process."""
    model = _model_dir(tmp_path)
    servers = []

    def launcher(cmd, env, log_path):
        servers.append(FakeServer(cmd, model, request_seconds=lambda k: 0.7 if k < 9 else 0.05))
        return servers[-1]

    args = _args("--model-path", model, "--arms", "base", "--concurrency", "4", "--requests-per-level", "8",
                 "--repeats", "2", "--warmup", "0", "--min-level-seconds", "2", "--level-seconds-margin", "1.2",
                 "--serving-input-len", "40", "--serving-output-len", "8", "--identity-prompts", "2",
                 "--identity-new-tokens", "4", "--port", str(_free_port()), "--workdir", str(tmp_path / "w"),
                 "--out", str(tmp_path / "r"), "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)),
                 "--max-input-tokens", "64")
    doc = S.run(args, launcher=launcher)
    a = doc["arms"][0]
    assert a["status"] == "ok", (a.get("error"), a.get("levels"), open(a["client_log"]).read()[-3000:])
    lv = a["levels"][0]
    n = doc["settings"]["requests_per_level"]["4"]
    assert n == lv["num_prompts"] > 16 and lv["completed"] == n          # before: 16
    assert not lv["short"] and lv["duration"] >= 2 and lv["repeats"] == 2
    cal = lv["calibration_passes"]
    assert [x["num_prompts"] for x in cal[:2]] == [8, 16] and cal[0]["seconds"] > 1.0 and cal[1]["seconds"] < 1.0
    assert a["client"]["mode"] == "persistent" and a["client"]["processes"] == 1
    assert a["client"]["passes"] == len(cal) + 2


@needs_sglang
def test_persistent_client_runs_passes_as_the_command_line_does(tmp_path):
    """One client process, several passes: each sends the requests a `python -m sglang.bench_serving`
    process sends (the same token ids: bench_serving re-seeds per pass) and writes the same result
    line; an argparse error is that pass's exit code 2 and the process lives on; a pass past its
    timeout kills the process, the next pass starts another."""
    model = _model_dir(tmp_path)
    port = _free_port()
    srv = FakeServer(["x", "--port", str(port)], model)
    w = S.workload_settings("random", input_len=24, output_len=4)
    env = S.client_env(None, None)

    def cmd(tag, n=6):
        return S.bench_serving_cmd(sys.executable, port, model, w, 2, n, str(tmp_path / f"{tag}.jsonl"), seed=3)

    def load(since):      # the pass's requests (after bench_serving's warm-up one)
        return [r["ids"] for r in srv.requests[since + 1:]]
    log = str(tmp_path / "bs.log")
    bsc = S.PersistentClient(env, str(tmp_path), log)
    try:
        k0 = len(srv.requests)
        ref = S.run_bench_serving(cmd("sub"), env, str(tmp_path), 300, str(tmp_path / "sub.log"))
        sub_ids = load(k0)
        results, ids = [], []
        for tag in ("p0", "p1"):
            k = len(srv.requests)
            results.append(bsc.run(cmd(tag), 300))
            ids.append(load(k))
        assert ref["ok"] and all(r["ok"] for r in results), open(log).read()[-3000:]
        # the same requests (their arrival order at 2 in flight varies)
        assert len(sub_ids) == 6 and [sorted(x) for x in ids] == [sorted(sub_ids)] * 2
        keep = ("completed", "total_input_tokens", "total_output_tokens", "dataset_name", "random_input_len",
                "max_concurrency")
        assert all({k: r["result"][k] for k in keep} == {k: ref["result"][k] for k in keep} for r in results)
        bad = cmd("bad")
        bad[bad.index("--request-rate") + 1] = "not-a-number"
        r = bsc.run(bad, 120)
        assert not r["ok"] and r["rc"] == 2 and bsc.info()["processes"] == 1
        srv.request_seconds = lambda k: 30.0
        r = bsc.run(cmd("slow"), 4)
        assert not r["ok"] and r["error"] == "timed out after 4 s" and bsc.proc is None
        srv.request_seconds = None
        r = bsc.run(cmd("again", n=4), 300)
        assert r["ok"] and r["result"]["completed"] == 4
        assert bsc.info() == dict(mode="persistent", processes=2, passes=5, import_s=bsc.import_s)
    finally:
        bsc.close()
        srv.stop()
    assert "in the persistent client, pass 5" in open(log).read()


def test_the_per_pass_client_stays_behind_a_flag(tmp_path):
    assert isinstance(S.make_client(_args(), {}, str(tmp_path), "log"), S.PersistentClient)
    c = S.make_client(_args("--bench-serving-per-pass"), {}, str(tmp_path), "log")
    assert type(c) is S.PerPassClient and c.info()["mode"] == "per-pass"


def _resume_world(tmp_path, monkeypatch, *fixed, gpus=None):
    """What the resume tests share: fake bench_serving passes (2 requests a second per slot), this
    machine's GPUs (``gpus["now"]``, default one), a launcher recording each server's port, and the
    command line of a base,dflash run in one work dir: ``fixed`` + each call's own flags (last wins).
    -> (calls, launched, launcher, args)."""
    calls = _fake_clients(monkeypatch, lambda port, c, n, k: n / (2.0 * c))
    gpus = {"now": ["GPU-aaa"]} if gpus is None else gpus
    monkeypatch.setattr(S, "machine_id", lambda: dict(host="h", gpus=list(gpus["now"])))
    model = _model_dir(tmp_path)
    launched = []

    def launcher(cmd, env, log):
        launched.append(cmd[cmd.index("--port") + 1])
        return _Srv()

    def args(*extra):
        return _args("--model-path", model, "--draft-model-path", "/d", "--arms", "base,dflash", "--warmup", "0",
                     "--identity-prompts", "2", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r"),
                     "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)), *fixed, *extra)

    return calls, launched, launcher, args


def test_resume_keeps_complete_arms_of_the_same_machine_and_runs_the_rest(tmp_path, monkeypatch):
    """One cell over several device calls on one warm machine: a first run whose last arm is cut by
    its deadline, then ``--resume`` in the same work dir runs only the arms not complete (with the
    first run's level counts) and reports all of them; another GPU or other settings keep nothing."""
    gpus = {"now": ["GPU-aaa"]}
    calls, launched, launcher, args = _resume_world(tmp_path, monkeypatch, "--concurrency", "1", "--repeats", "3",
                                                    "--min-level-seconds", "20", "--level-seconds-margin", "1.5",
                                                    gpus=gpus)

    real = S._measure_arm

    def cut_dflash(arm, *a, **k):      # the first call's deadline: dflash measured only partly
        recs = real(arm, *a, **k)
        if arm["name"] == "dflash":
            for rec in recs:
                rec["levels"][-1].update(partial=True, missing_repeats=1)
                rec["status"] = "partial"
        return recs

    monkeypatch.setattr(S, "_measure_arm", cut_dflash)
    first = S.run(args(), launcher=launcher)
    assert [a["status"] for a in first["arms"]] == ["ok", "partial"] and len(launched) == 2
    monkeypatch.setattr(S, "_measure_arm", real)
    n_before = len(calls)
    doc = S.run(args("--resume"), launcher=launcher)
    assert len(launched) == 3                                   # only dflash's server started again
    assert calls[n_before:] == [(1, 60)] * 3                    # no calibration: base's count kept
    assert [a["name"] for a in doc["arms"]] == ["base", "dflash"]
    assert doc["arms"][0].get("resumed") and not doc["arms"][1].get("resumed")
    assert doc["resumed"]["arms"] == ["base"] and doc["identity"]["arms"]["dflash"]["identical"]
    md = open(str(tmp_path / "r") + ".md").read()
    assert "Resumed (`--resume`): `base` measured by an earlier call" in md and "GPU-aaa" in md
    # everything complete now: a further resume starts no server
    S.run(args("--resume"), launcher=launcher)
    assert len(launched) == 3
    # a call naming one more arm only: the state's arms come first, only the new one runs
    doc = S.run(args("--resume", "--arms", "ddtree"), launcher=launcher)
    assert len(launched) == 4 and [a["name"] for a in doc["arms"]] == ["base", "dflash", "ddtree"]
    assert [a.get("resumed", False) for a in doc["arms"]] == [True, True, False]
    assert doc["identity"]["arms"]["ddtree"]["identical"]
    # another GPU: nothing kept, both arms run
    gpus["now"] = ["GPU-bbb"]
    doc = S.run(args("--resume"), launcher=launcher)
    assert len(launched) == 6 and "another machine" in doc["resume_refused"]
    # other settings (repeats): nothing kept
    doc = S.run(args("--resume", "--repeats", "2"), launcher=launcher)
    assert len(launched) == 8 and "repeats" in doc["resume_refused"]


def test_several_workloads_share_each_arms_server_and_keep_their_own_reports(tmp_path, monkeypatch):
    """``--workload random,long``: each arm's server starts once and serves both workloads' levels
    (bench_serving passes with each workload's lengths), one report per workload (``<out>_random``,
    ``<out>_long``, each the format of a one-workload run, its own level sizing), the identity
    requests once per server, in both reports.  ``--resume`` is per workload: an arm complete in one
    and cut in the other starts again for the other only."""
    calls, launched, launcher, args = _resume_world(tmp_path, monkeypatch, "--concurrency", "1,4", "--repeats", "2",
                                                    "--min-level-seconds", "0", "--workload", "random,long")

    sent = []
    real_one = S._one_run

    def one_run(a, bsc, port, opts, workload, *rest, **k):
        sent.append((port, workload["name"], workload["input_len"]))
        return real_one(a, bsc, port, opts, workload, *rest, **k)

    monkeypatch.setattr(S, "_one_run", one_run)
    real = S._measure_arm

    def cut_long_dflash(arm, opts, port, a, levels, maxc, loads, *rest, **k):
        recs = real(arm, opts, port, a, levels, maxc, loads, *rest, **k)
        for L, rec in zip(loads, recs):
            if arm["name"] == "dflash" and L.name == "long":     # its c=4 cut by the deadline
                rec["levels"][-1].update(partial=True, missing_repeats=1)
                rec["status"] = "partial"
        return recs

    monkeypatch.setattr(S, "_measure_arm", cut_long_dflash)
    first = S.run(args(), launcher=launcher)
    assert len(launched) == 2                                    # one server per arm for both workloads
    assert sorted({(w, n) for _, w, n in sent}) == [("long", 8192), ("random", 512)]
    assert [p for p, w, _ in sent if w == "random"][:4] == [p for p, w, _ in sent if w == "long"][:4]
    docs = {w: json.load(open(str(tmp_path / "r") + f"_{w}.json")) for w in ("random", "long")}
    assert first["settings"]["workload"]["name"] == "random"
    for w, d in docs.items():
        assert d["settings"]["workload"]["name"] == w and [a["name"] for a in d["arms"]] == ["base", "dflash"]
        assert [lv["concurrency"] for lv in d["arms"][0]["levels"]] == [1, 4]
        assert d["identity"]["arms"]["dflash"]["identical"]
        assert os.path.exists(str(tmp_path / "r") + f"_{w}.md")
    assert [a["status"] for a in docs["long"]["arms"]] == ["ok", "partial"]
    monkeypatch.setattr(S, "_measure_arm", real)
    sent.clear()
    S.run(args("--resume"), launcher=launcher)
    assert len(launched) == 3 and {w for _, w, _ in sent} == {"long"}   # dflash again, for long only,
    assert len(sent) == 2                                                 # its c=4 (2 repeats) only
    docs = {w: json.load(open(str(tmp_path / "r") + f"_{w}.json")) for w in ("random", "long")}
    assert [a.get("resumed", False) for a in docs["random"]["arms"]] == [True, True]
    assert [a.get("resumed", False) for a in docs["long"]["arms"]] == [True, False]
    assert all(a["status"] == "ok" for d in docs.values() for a in d["arms"])
    assert docs["long"]["identity"]["arms"]["dflash"]["identical"]
    with pytest.raises(ValueError):
        S.parse_workloads("random,random")
    with pytest.raises(ValueError):
        S.parse_workloads("random,short")


def test_resume_keeps_the_complete_levels_of_a_cut_arm(tmp_path, monkeypatch):
    """An arm cut by the deadline after its c=1 level: ``--resume`` starts its server again and runs
    only c=4 (the state's counts, no calibration); the report holds c=1 from the first call and c=4
    from this one, and the arm is complete."""
    calls, launched, launcher, args = _resume_world(tmp_path, monkeypatch, "--concurrency", "1,4", "--repeats", "2",
                                                    "--min-level-seconds", "0")

    real = S._measure_arm

    def cut(arm, *a, **k):
        recs = real(arm, *a, **k)
        if arm["name"] == "dflash":                 # c=4 lost a repeat to the deadline
            for rec in recs:
                rec["levels"][1].update(partial=True, missing_repeats=1)
                rec["status"] = "partial"
        return recs

    monkeypatch.setattr(S, "_measure_arm", cut)
    S.run(args(), launcher=launcher)
    monkeypatch.setattr(S, "_measure_arm", real)
    first_c1 = json.load(open(str(tmp_path / "r") + ".json"))["arms"][1]["levels"][0]
    n_before = len(calls)
    doc = S.run(args("--resume"), launcher=launcher)
    assert len(launched) == 3                                        # dflash's server again
    assert [c for c, _ in calls[n_before:]] == [4, 4]                # its c=4 repeats only
    dfl = doc["arms"][1]
    assert dfl["status"] == "ok" and dfl["resumed_levels"] == [1]
    assert [lv["concurrency"] for lv in dfl["levels"]] == [1, 4]
    assert dfl["levels"][0]["output_throughput"] == first_c1["output_throughput"] and dfl["levels"][0]["resumed"]
    assert not dfl["levels"][1].get("partial") and doc["resumed"]["levels"] == {"dflash": [1]}
    assert doc["identity"]["arms"]["dflash"]["identical"]


def test_serving_profile_splits_each_level_from_its_own_repeats(tmp_path, monkeypatch):
    """``--serving-profile``: only the speculative arms get SGLANG_DDTREE_PROFILE_FILE; a level's round
    split holds the records inside its counted repeats (the uncounted warm-up pass's record is left
    out), and the report shows it per verify width."""
    envs = {}

    def launcher(cmd, env, log):
        envs[int(cmd[cmd.index("--port") + 1])] = env
        return _Srv()

    def a_pass(port, c, n, k):
        prof = envs[port].get("SGLANG_DDTREE_PROFILE_FILE")
        t = time.time()
        time.sleep(0.2)       # passes lie further apart than the windows' 0.05 s slack
        if prof:   # the uncounted warm-up pass (k = 0) was slow: 100 ms rounds; the counted ones 7 ms
            ms = 100.0 if k == 0 else 7.0
            with open(prof, "a") as f:
                f.write(json.dumps(dict(rounds=16, bs_mean=4.0, t_first=t + 0.05, t_last=t + 0.15,
                                        round_ms=dict(median=ms), host_ms=dict(median=2.0),
                                        by_width={"1": dict(rounds=16, round_ms=dict(median=ms))})) + "\n")
        return 25.0

    _fake_clients(monkeypatch, a_pass, itl=7.5)
    model = _model_dir(tmp_path)
    args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "ddtree,base", "--concurrency", "4",
                 "--repeats", "2", "--warmup", "1", "--min-level-seconds", "20", "--identity-prompts", "2",
                 "--serving-profile", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r"),
                 "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)))
    doc = S.run(args, launcher=launcher)
    by = {a["name"]: a for a in doc["arms"]}
    assert "SGLANG_DDTREE_PROFILE_FILE" not in envs[min(envs)] and "SGLANG_DDTREE_PROFILE_FILE" in envs[max(envs)]
    sp = by["ddtree"]["levels"][0]["stage_profile"]
    assert sp["rounds"] == 32 and sp["round_ms"] == 7.0 and sp["by_width"]["1"]["rounds"] == 32
    assert "stage_profile" not in by["base"]["levels"][0]
    md = open(str(tmp_path / "r") + ".md").read()
    assert "## Round split" in md and "32 rounds, bs 4.0, GPU 7.00, host 2.00, ITL 7.50; w1: 32 x 7.00" in md


def _clocked_passes(monkeypatch, seconds):
    """The fake clients on a fake clock (from t = 1000): a pass lasts ``seconds(port, c, n, pass
    index)`` s of wall time and of duration.  -> the clock, {"t": now}."""
    clock = {"t": 1000.0}
    monkeypatch.setattr(S.time, "time", lambda: clock["t"])
    monkeypatch.setattr(S.time, "sleep", lambda s: None)

    def a_pass(port, c, n, k):
        dur = seconds(port, c, n, k)
        clock["t"] += dur
        return dur

    _fake_clients(monkeypatch, a_pass)
    return clock


def test_a_repeat_that_cannot_finish_before_the_deadline_is_not_started(tmp_path, monkeypatch):
    """With less time left than ~the previous repeat took, the level stops (partial, the missing
    repeats counted) instead of starting a pass the deadline would kill; the arm is then partial, so
    ``--resume`` runs it again."""
    clock = _clocked_passes(monkeypatch, lambda port, c, n, k: 30.0)     # every pass: 30 s
    model = _model_dir(tmp_path)
    # the deadline leaves base's calibration pass and two repeats (1000 + 3 x 30 = 1090 < 1100), not a third
    args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "base", "--concurrency", "4",
                 "--repeats", "3", "--warmup", "0", "--min-level-seconds", "20", "--identity-prompts", "2",
                 "--deadline", "100", "--min-arm-s", "1", "--identity-reserve-s", "0", "--workdir", str(tmp_path / "w"),
                 "--out", str(tmp_path / "r"), "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)))
    doc = S.run(args, launcher=lambda cmd, env, log: _Srv())
    arm = doc["arms"][0]
    lv = arm["levels"][0]
    assert lv["repeats"] == 2 and lv["partial"] and lv["missing_repeats"] == 1
    assert arm["unstarted_repeats"] == [4] and arm["status"] == "partial"
    assert clock["t"] == 1090.0            # no fourth pass was started into the deadline


def test_a_first_repeat_the_calibration_says_cannot_finish_is_not_started(tmp_path, monkeypatch):
    """The level's first repeat is sized by its calibration pass: with less time left than that pass
    scaled to the repeat's requests, it is not started (s39: 352 requests started with 23 s left
    after 64 in 5.6 s, and the deadline failed all of them); the level is partial with no repeat.
    Control: with time for it, the repeat runs."""
    model, prompts = _model_dir(tmp_path), str(_prompts_file(tmp_path))
    for deadline, repeats in ((60, 0), (100, 1)):
        clock = _clocked_passes(monkeypatch, lambda port, c, n, k: 30.0)     # every pass: 30 s
        args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "base", "--concurrency", "4",
                     "--repeats", "1", "--warmup", "0", "--min-level-seconds", "20", "--identity-prompts", "2",
                     "--deadline", str(deadline), "--min-arm-s", "1", "--identity-reserve-s", "0",
                     "--workdir", str(tmp_path / f"w{deadline}"),
                     "--out", str(tmp_path / f"r{deadline}"), "--no-env-probe",
                     "--prompts", prompts)
        doc = S.run(args, launcher=lambda cmd, env, log: _Srv())
        arm = doc["arms"][0]
        lv = arm["levels"][0]
        assert lv.get("repeats", 0) == repeats, (deadline, lv)
        if repeats == 0:
            assert lv["partial"] and arm["unstarted_repeats"] == [4] and clock["t"] == 1030.0, arm


def test_a_first_repeat_its_level_warm_up_says_cannot_finish_is_not_started(tmp_path, monkeypatch):
    """An arm that does not size the level has no calibration pass: its level warm-up (W x c
    requests) scaled to the repeat's requests says whether the repeat can finish (s40: 1152 requests
    started with 16 s left after a 320-request warm-up of 9.5 s; all failed).  Control: with time for
    it, the repeat runs."""
    model, prompts = _model_dir(tmp_path), str(_prompts_file(tmp_path))
    for deadline, repeats in ((25, 0), (40, 1)):
        # the warm-up's 20 requests: 5 s; a repeat's 80: 20 s
        clock = _clocked_passes(monkeypatch, lambda port, c, n, k: 0.25 * n)
        args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "base", "--concurrency", "4",
                     "--requests-per-level", "4:80", "--repeats", "1", "--warmup", "0", "--min-level-seconds", "0",
                     "--level-warmup-waves", "5", "--identity-prompts", "2", "--deadline", str(deadline),
                     "--min-arm-s", "1", "--identity-reserve-s", "0", "--workdir", str(tmp_path / f"w{deadline}"),
                     "--out", str(tmp_path / f"r{deadline}"), "--no-env-probe", "--prompts", prompts)
        doc = S.run(args, launcher=lambda cmd, env, log: _Srv())
        arm = doc["arms"][0]
        lv = arm["levels"][0]
        assert lv.get("repeats", 0) == repeats, (deadline, lv)
        # 25 s: after the warm-up (5 s) 20 s are left for a repeat expected to take 20 s x 1.15
        assert clock["t"] == (1005.0 if repeats == 0 else 1025.0), (deadline, clock)
        if repeats == 0:
            assert lv["partial"] and arm["unstarted_repeats"] == [4], arm


def test_the_levels_leave_the_identity_requests_their_time(tmp_path, monkeypatch):
    """An arm's levels stop --identity-reserve-s before the deadline, so its identity requests (the
    lossless verdict) still run when a level is cut; the cut level's repeats stay in the table,
    marked partial.  Control: without the reserve, a repeat slower than its estimate runs into the
    deadline, and the report says the identity was not run (not 16 requests "failed", s40)."""
    model, prompts = _model_dir(tmp_path), str(_prompts_file(tmp_path))
    for reserve in ("15", "0"):
        ports = []

        def seconds(port, c, n, k):
            ports.append(port)
            # base: 1 s a pass; the tree arm: 10 s, then 40 s (a pass slower than its estimate)
            return 1.0 if port == ports[0] else 10.0 if k == 0 else 40.0

        _clocked_passes(monkeypatch, seconds)
        out = tmp_path / f"r{reserve}"
        args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "base,ddtree", "--concurrency",
                     "4", "--requests-per-level", "4:80", "--repeats", "2", "--warmup", "0", "--min-level-seconds",
                     "0", "--identity-prompts", "2", "--deadline", "35", "--min-arm-s", "1",
                     "--identity-reserve-s", reserve, "--workdir", str(tmp_path / f"w{reserve}"), "--out", str(out),
                     "--no-env-probe", "--prompts", prompts)
        doc = S.run(args, launcher=lambda cmd, env, log: _Srv())
        tree = doc["arms"][1]
        md = open(str(out) + ".md").read()
        if reserve == "15":       # the second repeat (expected 10 s x 1.15) does not fit in 20 - 12 s
            assert tree["levels"][0]["repeats"] == 1 and tree["identity_requests"]["failed"] == 0
            assert doc["identity"]["arms"]["ddtree"]["identical"]
            assert "| ddtree | identical (2 of 2)" in md
            assert "| ddtree | 800 (0.10x / -) partial (1 of 2 repeats) |" in md, md
        else:
            assert tree["levels"][0]["repeats"] == 2 and tree["identity_requests"]["not_run"] == "deadline"
            assert "ddtree" not in doc["identity"]["arms"] and tree["status"] == "partial"
            assert "| ddtree | not run (deadline) | - |" in md, md


def test_arm_shares_give_every_arm_its_first_level(tmp_path, monkeypatch):
    """--arm-shares: each arm's levels end at its equal share of the time left when it starts, so
    with time for four of six levels every arm completes its first level (a whole cell) and its
    identity requests.  Control: without it, base and dflash complete both levels and ddtree,
    the arm the cell is about, gets none."""
    model, prompts = _model_dir(tmp_path), str(_prompts_file(tmp_path))
    for shares in (True, False):
        # a repeat (80 requests): 10 s; a level's warm-up (one wave): 0.5 s at c=4, 1 s at c=8
        _clocked_passes(monkeypatch, lambda port, c, n, k: 0.125 * n)
        out = tmp_path / f"r{shares}"
        args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "base,dflash,ddtree",
                     "--concurrency", "4,8", "--requests-per-level", "4:80,8:80", "--repeats", "2", "--warmup",
                     "0", "--min-level-seconds", "0", "--level-warmup-waves", "1", "--identity-prompts", "2",
                     "--deadline", "90",
                     "--min-arm-s", "1", "--identity-reserve-s", "0", "--workdir", str(tmp_path / f"w{shares}"),
                     "--out", str(out), "--no-env-probe", "--prompts", prompts,
                     *(["--arm-shares"] if shares else []))
        doc = S.run(args, launcher=lambda cmd, env, log: _Srv())
        done = {a["name"]: [lv["concurrency"] for lv in a["levels"] if not lv.get("partial")]
                for a in doc["arms"]}
        if shares:    # base's 30 s: its first level (20.5 s), then the second's warm-up; 1.15 x 10 s no longer fit
            assert done == {"base": [4], "dflash": [4], "ddtree": [4]}, done
            assert all(a["identity_requests"]["failed"] == 0 and not a["identity_requests"].get("not_run")
                       for a in doc["arms"])
            # what an arm leaves goes to the next: (90 - 21.5) / 2, then the rest
            assert [a["share_s"] for a in doc["arms"]][:2] == [30.0, 34.2], doc["arms"]
            assert doc["arms"][2]["share_s"] > 34.2
            md = open(str(out) + ".md").read()
            assert "| ddtree | 800 (1.00x / 1.00x) |" in md, md
        else:
            assert done == {"base": [4, 8], "dflash": [4, 8], "ddtree": []}, done
            assert "share_s" not in doc["arms"][0]


def test_levels_run_in_the_order_given_and_show_ascending(tmp_path, monkeypatch):
    """--concurrency 16,4: the c=16 level runs first (a call the lease cuts keeps the level wanted
    most), the report's columns read c=4 then c=16."""
    calls = _fake_clients(monkeypatch, lambda port, c, n, k: 1.0)
    args = _args("--model-path", _model_dir(tmp_path), "--draft-model-path", "/d", "--arms", "base",
                 "--concurrency", "16,4", "--requests-per-level", "4:8,16:32", "--repeats", "1", "--warmup", "0",
                 "--min-level-seconds", "0", "--identity-prompts", "2", "--workdir", str(tmp_path / "w"),
                 "--out", str(tmp_path / "r"), "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)))
    S.run(args, launcher=lambda cmd, env, log: _Srv())
    assert [c for c, n in calls] == [16, 4]
    assert "| arm | c=4 | c=16 | outputs vs base |" in open(str(tmp_path / "r") + ".md").read()


def _resume_order(tmp_path, monkeypatch, cut_arm):
    """A base,dflash,ddtree run whose first call loses ``cut_arm``'s c=4 to the deadline and never
    starts the arms after it; -> (the servers the ``--resume`` call starts, by algorithm, its report)."""
    calls, launched, launcher, args = _resume_world(tmp_path, monkeypatch, "--concurrency", "1,4", "--repeats", "2",
                                                    "--min-level-seconds", "0", "--arms", "base,dflash,ddtree")
    algos, real, order = [], S._measure_arm, ["base", "dflash", "ddtree"]

    def launch(cmd, env, log):
        algos.append(cmd[cmd.index("--speculative-algorithm") + 1] if "--speculative-algorithm" in cmd else "base")
        return launcher(cmd, env, log)

    def cut(arm, *a, **k):
        recs = real(arm, *a, **k)
        for rec in recs:
            if arm["name"] == cut_arm:                # c=4 lost a repeat to the deadline
                rec["levels"][1].update(partial=True, missing_repeats=1)
                rec["status"] = "partial"
            elif order.index(arm["name"]) > order.index(cut_arm):   # never started: the deadline
                rec.update(status="skipped", error="deadline", levels=[])
        return recs

    monkeypatch.setattr(S, "_measure_arm", cut)
    S.run(args(), launcher=launch)
    monkeypatch.setattr(S, "_measure_arm", real)
    del algos[:]
    return algos, S.run(args("--resume"), launcher=launch)


def test_resume_runs_the_arms_never_measured_before_completing_a_cut_one(tmp_path, monkeypatch):
    """Breadth first: a first call measures base, loses dflash's c=4 to the deadline and never starts
    ddtree; ``--resume`` starts ddtree's server before dflash's (a lease that ends then still has
    every arm in the cell), and the report lists the arms in that order.  Control: the first arm
    keeps its place even when cut (it sizes the levels)."""
    algos, doc = _resume_order(tmp_path / "a", monkeypatch, "dflash")
    assert algos == ["DDTREE-GPU", "DFLASH"], algos
    assert [a["name"] for a in doc["arms"]] == ["base", "ddtree", "dflash"]
    assert all(a["status"] == "ok" for a in doc["arms"])
    algos, doc = _resume_order(tmp_path / "b", monkeypatch, "base")
    assert algos == ["base", "DFLASH", "DDTREE-GPU"], algos


def test_an_arm_faster_than_the_sizer_runs_each_repeat_as_several_passes(tmp_path, monkeypatch):
    """Base sizes the level (>= 20 s a pass); an arm 4x faster runs each repeat as ceil(1.05 x 20 /
    its pass) = 3 back-to-back passes of the same requests: its level lasts >= 20 s (not short),
    counts 3 x n requests, and its throughput is the passes' tokens over their summed duration.
    Control: base, as fast as the sizer, runs one pass a repeat."""
    ports = []

    def dur(port, c, n, k):
        ports.append(port)
        return n / (2.0 * c) if port == ports[0] else n / (8.0 * c)

    calls = _fake_clients(monkeypatch, dur)
    model = _model_dir(tmp_path)
    args = _args("--model-path", model, "--draft-model-path", "/d", "--arms", "base,ddtree", "--concurrency", "4",
                 "--repeats", "2", "--warmup", "0", "--min-level-seconds", "20", "--level-seconds-margin", "1.5",
                 "--identity-prompts", "2", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r"),
                 "--no-env-probe", "--prompts", str(_prompts_file(tmp_path)))
    doc = S.run(args, launcher=lambda cmd, env, log: _Srv())
    n = doc["settings"]["requests_per_level"]["4"]
    base, tree = (a["levels"][0] for a in doc["arms"])
    assert "passes_per_repeat" not in base and not base["short"] and base["completed"] == n
    assert tree["passes_per_repeat"] == 3 and not tree["short"] and not tree["partial"]
    assert tree["completed"] == 3 * n and tree["failed"] == 0
    assert tree["duration"] == pytest.approx(3 * n / 32.0) and tree["duration"] >= 20.0
    assert tree["output_throughput"] == pytest.approx(100.0 * 3 * n / tree["duration"])
    assert calls[-6:] == [(4, n)] * 6                    # the arm's two repeats, three passes each
    md = open(str(tmp_path / "r") + ".md").read()
    assert f"{3 * n}/{3 * n} (3 passes)" in md
