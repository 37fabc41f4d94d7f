"""bench/ab_serve.py (the wrapper around the package sglang_ddtree.ab) against a fake SGLang-like HTTP
server (no GPU, no real server).

The fake speaks SGLang 0.5.16's streaming /generate: HTTP/1.1 chunked, SSE lines ``data: {json}``
with cumulative ``output_ids`` (deltas for an --incremental-streaming-output server) and
``meta_info`` (prompt_tokens, completion_tokens, spec_verify_ct, finish_reason), ending with
``data: [DONE]``; speculative arms stream several tokens per chunk.  The benchmark's launcher is
replaced, so the whole run (start, health wait, warm-up, levels, identity, stage profile, report,
deadline, failed start) is exercised in-process.  One test parses the generated server command
lines with SGLang's own ``prepare_server_args`` (no GPU: ``--device cuda``, config-only models).
"""
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a subprocess loads this file
from helpers import load_bench  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_load = load_bench


ab = _load("ab_serve")  # every name of the package's modules, as the single-file script had them
from sglang_ddtree.ab import client as ab_client, servers as ab_servers  # noqa: E402  (what the tests replace)


@pytest.fixture(autouse=True)
def _fast_health_poll(monkeypatch):
    monkeypatch.setattr(ab_servers, "HEALTH_POLL_S", 0.05)

VOCAB = 1000


def chain(last, n):
    out = []
    for _ in range(n):
        last = (last * 5 + 3) % VOCAB
        out.append(last)
    return out


class FakeSGLang:
    """One fake server.  algo None | DFLASH | DDTREE-*; ``mismatch``: corrupt token 5 of prompts whose
    last id is even; ``incremental``: stream output_ids as deltas; ``profile``: write profiling records."""

    def __init__(self, port, algo=None, num_draft=None, mismatch=False, incremental=False, profile=None,
                 unhealthy_polls=2):
        self.algo, self.mismatch, self.incremental, self.profile = algo, mismatch, incremental, profile
        self.unhealthy = unhealthy_polls
        self.accept = [1] if algo is None else [3, 1, 4, 2, 5]
        self.rounds = 0
        self.freeze_gc_calls = 0
        self.pins = []          # custom_params.ddtree_budget of each /generate (None: not sent)
        self.lock = threading.Lock()
        fake = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def handle(self):
                try:
                    super().handle()
                except (ConnectionResetError, BrokenPipeError):
                    pass  # the client closes after data: [DONE]

            def _send(self, code, body=b""):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health_generate":
                    with fake.lock:
                        fake.unhealthy -= 1
                        ok = fake.unhealthy < 0
                    self._send(200 if ok else 503)
                else:
                    self._send(404)

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(n) or b"{}")
                if self.path == "/flush_cache":
                    return self._send(200, b"Cache flushed.")
                if self.path == "/freeze_gc":
                    with fake.lock:
                        fake.freeze_gc_calls += 1
                    return self._send(200, b"Garbage collection frozen.\n")
                if self.path == "/start_profile":   # SGLang's: blocks until num_steps ran, writes a trace
                    fake.write_trace(req)
                    return self._send(200, b"Start profiling.\n")
                if self.path != "/generate":
                    return self._send(404)
                fake.generate(self, req)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def generate(self, h, req):
        ids = req.get("input_ids")
        last = ids[-1] if ids else len(req["text"])
        sp = req["sampling_params"]
        assert sp["temperature"] == 0 and sp["ignore_eos"] is True and req.get("stream") is True
        m = sp["max_new_tokens"]
        with self.lock:
            self.pins.append((sp.get("custom_params") or {}).get("ddtree_budget"))
        out = chain(last, m)
        if self.mismatch and last % 2 == 0 and m > 5:
            out[5] = (out[5] + 1) % VOCAB
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(b):
            h.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
            h.wfile.flush()

        sizes, k, r = [1], 0, 0  # the prefill's token, then one chunk per verify round
        while sum(sizes) < m:
            sizes.append(min(self.accept[k % len(self.accept)], m - sum(sizes)))
            k += 1
        done = 0
        for j, s in enumerate(sizes):
            time.sleep(0.001)
            done += s
            if j > 0 and self.algo:
                r += 1
            meta = {"id": "x", "prompt_tokens": len(ids or req["text"]), "completion_tokens": done,
                    "cached_tokens": 0, "finish_reason": {"type": "length", "length": m} if done == m else None}
            if self.algo:
                meta.update(spec_verify_ct=max(1, r), spec_accept_length=done / max(1, r))
            ids_out = out[done - s:done] if self.incremental else out[:done]
            send(b"data: " + json.dumps({"output_ids": ids_out, "meta_info": meta}).encode() + b"\n\n")
        send(b"data: [DONE]\n\n")
        send(b"")
        h.close_connection = True
        with self.lock:
            self.rounds += r
            if self.profile and self.rounds >= 16:
                rec = {"pid": 7, "algo": self.algo, "budget": 16, "rounds": self.rounds, "bs_mean": 2.0,
                       "stage_ms": {s: {"median": v, "mean": v} for s, v in
                                    zip(ab.STAGES, (0.5, 0.1, 0.05, 1.0, 0.02, 0.2))},
                       "round_ms": {"median": 1.87, "mean": 1.9}, "host_ms": {"median": 0.8, "mean": 0.8}}
                with open(self.profile, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                self.rounds = 0

    def write_trace(self, req):
        """A Chrome trace as torch.profiler exports it: ``num_steps`` steps of a 'verify' kernel
        (DDTREE arms 1.2 ms, others 1.0) then a 0.1 ms 'topk_logprobs' kernel, 0.3 ms idle between steps."""
        import gzip
        time.sleep(0.2)
        ev, t = [], 1000.0
        ver = 1200.0 if (self.algo or "").startswith("DDTREE") else 1000.0
        for _ in range(req["num_steps"]):
            ev.append(dict(ph="X", cat="kernel", name="_fwd_kernel_extend", ts=t, dur=ver))
            ev.append(dict(ph="X", cat="kernel", name="topk_logprobs_kernel", ts=t + ver, dur=100.0))
            ev.append(dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", ts=t, dur=20.0))
            t += ver + 100.0 + 300.0
        os.makedirs(req["output_dir"], exist_ok=True)
        with gzip.open(os.path.join(req["output_dir"], f"{time.time()}-TP-0.trace.json.gz"), "wt") as f:
            json.dump({"traceEvents": ev}, f)
        time.sleep(1.2)   # the runner waits for a file that stopped changing

    def poll(self):
        return None

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class DeadServer:
    def __init__(self, log_path):
        with open(log_path, "a") as f:
            f.write("Traceback (most recent call last):\nRuntimeError: fake startup failure\n")

    def poll(self):
        return 1

    def stop(self):
        pass


def make_launcher(started, broken=(), mismatch=(), incremental=()):
    def launcher(cmd, env, log_path):
        def flag(name):
            return cmd[cmd.index(name) + 1] if name in cmd else None
        started.append(cmd)
        algo = flag("--speculative-algorithm")
        nd = flag("--speculative-num-draft-tokens")
        name = {None: "base", "DFLASH": "dflash"}.get(algo) or (
            ("ddtree" if algo == "DDTREE-GPU" else "ddtreecpu") + f"_b{int(nd) - 1}")
        if name in broken:
            return DeadServer(log_path)
        if algo and algo.startswith("DDTREE"):   # the worker's start-up line (verify_attn_hook / worker.py)
            with open(log_path, "a") as f:
                f.write("[2026-12-02 06:28:52] DDTREE-GPU: target verify attention = "
                        + ("SGLang's masked extend kernel (SGLANG_DDTREE_VERIFY_ATTN=sglang)\n"
                           if env.get("SGLANG_DDTREE_VERIFY_ATTN") == "sglang" else
                           "sglang_ddtree tree_verify_attention (bitmask (64, 9, 1), 7 prefix splits)\n"))
                if json.loads(env.get("DDTREE_SWITCHES") or "{}").get("draft_attn") == "ddtree":
                    f.write("[2026-12-02 06:28:52] DDTREE-GPU: drafter block attention = sglang_ddtree "
                            "tree_verify_attention (block 16, all visible, 7 prefix splits)\n")
        return FakeSGLang(int(flag("--port")), algo, nd, mismatch=name in mismatch, incremental=name in incremental,
                          profile=env.get("SGLANG_DDTREE_PROFILE_FILE"))
    return launcher


def _args(tmp_path, *extra):
    prompts = tmp_path / "p.jsonl"
    with open(prompts, "w") as f:
        for i in range(40):
            f.write(json.dumps({"input_ids": [1] + [(7 * i + j) % 900 + 3 for j in range(3 + i % 9)]}) + "\n")
    return ab.build_parser().parse_args([
        "--model-path", str(tmp_path / "no_model"), "--draft-model-path", str(tmp_path / "no_drafter"),
        "--prompts", str(prompts), "--num-prompts", "24", "--concurrency", "1,4,8", "--max-new-tokens", "12",
        "--out", str(tmp_path / "res" / "ab"), "--port", str(_free_port()), "--workdir", str(tmp_path / "work"),
        "--no-plot", "--no-env-probe", "--no-progress", *extra])


def _free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return 20000 + p % 20000  # the arms use port + 10 i


def test_parse_arms_and_commands():
    arms = ab.parse_arms("dflash,ddtree_b8,base,ddtreecpu_b16")
    assert [a["name"] for a in arms][0] == "base"  # the reference runs first
    d = {a["name"]: a for a in arms}
    assert d["ddtree_b8"]["algo"] == "DDTREE-GPU" and d["ddtree_b8"]["num_draft_tokens"] == 9
    assert d["ddtreecpu_b16"]["algo"] == "DDTREE-CPU" and d["ddtreecpu_b16"]["num_draft_tokens"] == 17
    assert d["ddtreecpu_b16"]["env"] == {"SGLANG_DDTREE_ADAPTIVE": "0"}
    assert d["dflash"]["num_draft_tokens"] is None
    assert d["ddtree_b8"]["env"] == {"SGLANG_DDTREE_ADAPTIVE": "0"}      # fixed: an explicit choice
    default = ab.parse_arm("ddtree")                                          # the product default
    assert default["env"] == {} and default["num_draft_tokens"] is None and default["auto"]
    assert ab.parse_arm("ddtree_nospec")["env"] == {"DDTREE_SWITCHES": '{"budget_cycle": [0]}'}
    for bad in ("ddtree_16", "eagle", "base_b8", "base,base", "dflash_vattn", "base_vattn",
                "ddtreecpu_b16_vattn", "ddtree_b16_vattn,ddtree_b16_vattn", "ddtree_pin7"):
        with pytest.raises(ValueError):
            ab.parse_arms(bad)
    v = {a["name"]: a for a in ab.parse_arms("ddtree_b16,ddtree_b16_vattn,ddtree_auto_vattn")}
    assert v["ddtree_b16_vattn"]["env"] == {"SGLANG_DDTREE_VERIFY_ATTN": "ddtree", "SGLANG_DDTREE_ADAPTIVE": "0"}
    assert v["ddtree_b16_vattn"]["num_draft_tokens"] == 17
    assert v["ddtree_b16"]["env"] == {"SGLANG_DDTREE_ADAPTIVE": "0"}
    assert v["ddtree_auto_vattn"]["env"]["SGLANG_DDTREE_VERIFY_ATTN"] == "ddtree"
    s = {a["name"]: a for a in ab.parse_arms("ddtree_b7_sglattn,ddtree_auto_sglattn")}
    assert s["ddtree_b7_sglattn"]["env"] == {"SGLANG_DDTREE_VERIFY_ATTN": "sglang", "SGLANG_DDTREE_ADAPTIVE": "0"}
    assert s["ddtree_auto_sglattn"]["auto"] and s["ddtree_auto_sglattn"]["env"]["SGLANG_DDTREE_VERIFY_ATTN"] == "sglang"
    for bad in ("dflash_sglattn", "ddtree_b7_vattn_sglattn"):
        with pytest.raises(ValueError, match="only DDTREE-GPU arms"):
            ab.parse_arms(bad)
    assert v["ddtree_auto_vattn"]["env"]["SGLANG_DDTREE_BUDGETS"] == "0,7,15,31" and v["ddtree_auto_vattn"]["auto"]
    ns = ab.parse_arm("ddtree_auto_nospec")
    assert ns["auto"] and ab.arm_switches(ns) == {"budget_cycle": [0]}
    assert ns["env"]["SGLANG_DDTREE_BUDGETS"] == "0,7,15,31" and ns["num_draft_tokens"] == 32
    for bad in ("ddtree_b7_nospec", "dflash_nospec", "ddtree_auto_nospec_nospec", "ddtree_b7_nooverhead",
                "ddtree_auto_nooverhead_nooverhead"):
        with pytest.raises(ValueError):
            ab.parse_arm(bad)
    no = ab.parse_arm("ddtree_auto_nooverhead")
    assert no["auto"] and ab.arm_switches(no) == {"round_overhead": False} and no["num_draft_tokens"] == 32
    t = {a["name"]: a for a in ab.parse_arms("ddtree_b7_torchcommit,ddtree_auto_vattn_torchcommit")}
    assert t["ddtree_b7_torchcommit"]["env"] == {"DDTREE_SWITCHES": '{"commit_ops": "torch"}',
                                                 "SGLANG_DDTREE_ADAPTIVE": "0"}
    assert t["ddtree_auto_vattn_torchcommit"]["env"]["SGLANG_DDTREE_VERIFY_ATTN"] == "ddtree"
    assert ab.arm_switches(t["ddtree_auto_vattn_torchcommit"]) == {"commit_ops": "torch"}
    both = ab.parse_arm("ddtree_auto_nospec_torchcommit")          # two switches: one object
    assert ab.arm_switches(both) == {"budget_cycle": [0], "commit_ops": "torch"}
    for bad in ("dflash_torchcommit", "ddtree_b7_torchcommit_torchcommit"):
        with pytest.raises(ValueError):
            ab.parse_arms(bad)
    opts = dict(python="py", model_path="T", draft_model_path="D", maxc=64, token_ids=True,
                server_args="--mem-fraction-static 0.5 --tp-size 1")
    cmd = ab.build_server_cmd(d["ddtree_b8"], opts, 31000)
    s = " ".join(cmd)
    assert s.startswith("py -m sglang.launch_server --model-path T --attention-backend triton")
    for want in ("--port 31000", "--cuda-graph-max-bs-decode 64", "--disable-prefill-cuda-graph",
                 "--max-running-requests 64", "--skip-tokenizer-init", "--speculative-algorithm DDTREE-GPU",
                 "--speculative-draft-model-path D", "--speculative-num-draft-tokens 9"):
        assert want in s, want
    assert s.endswith("--mem-fraction-static 0.5 --tp-size 1")  # user flags last: they win
    for pg, want, not_want in ((True, None, "--disable-prefill-cuda-graph"), (0, None, "--disable-prefill-cuda-graph"),
                               (2048, "--cuda-graph-max-bs-prefill 2048", "--disable-prefill-cuda-graph"),
                               (None, "--disable-prefill-cuda-graph", "--cuda-graph-max-bs-prefill")):
        s2 = " ".join(ab.build_server_cmd(d["ddtree_b8"], dict(opts, prefill_cuda_graph=pg), 31000))
        assert not_want not in s2 and (want is None or want in s2), (pg, s2)
    assert ab.build_parser().parse_args(["--prefill-cuda-graph"]).prefill_cuda_graph == 0
    assert ab.build_parser().parse_args(["--prefill-cuda-graph", "1024"]).prefill_cuda_graph == 1024
    assert ab.build_parser().parse_args([]).prefill_cuda_graph == 512           # SGLang's graph, capped
    assert ab.build_parser().parse_args(["--no-prefill-cuda-graph"]).prefill_cuda_graph is None
    base = " ".join(ab.build_server_cmd(d["base"], dict(opts, token_ids=False, server_args=""), 31010))
    assert "--speculative" not in base and "--skip-tokenizer-init" not in base
    # with a config, the flags it already sets are not added
    cmd = ab.build_server_cmd(d["dflash"], opts, 1, "c.yaml", {"cuda-graph-config", "attention-backend",
                                                                "max-running-requests"})
    s = " ".join(cmd)
    assert "--config c.yaml" in s and "--cuda-graph" not in s and "--attention-backend" not in s
    assert "--max-running-requests" not in s and "--speculative-num-draft-tokens" not in s


def test_stats_helpers():
    assert ab.pct([1, 2, 3, 4], 50) == 2.5 and ab.pct([5], 99) == 5 and ab.pct([], 50) is None
    assert abs(ab.pct(list(range(101)), 99) - 99) < 1e-9
    assert ab.first_diff([1, 2, 3], [1, 2, 4]) == 2 and ab.first_diff([1, 2], [1, 2, 3]) == 2
    assert ab.first_diff([1], [1]) is None
    prof = [{"pid": 1, "rounds": 10, "bs_mean": 1.0, "stage_ms": {"draft": {"median": 1.0}},
             "round_ms": {"median": 2.0}, "host_ms": {"median": 1.0}},
            {"pid": 2, "rounds": 30, "bs_mean": 3.0, "stage_ms": {"draft": {"median": 2.0}},
             "round_ms": {"median": 4.0}, "host_ms": {"median": 1.0}}]
    a = ab.aggregate_profile(prof)
    assert a["rounds"] == 40 and a["pids"] == 2 and a["stage_ms"] == {"draft": 1.75}
    assert a["round_ms"] == 3.5 and a["bs_mean"] == 2.5
    assert ab.aggregate_profile([]) is None


def test_prompts_offline_and_tokenized(tmp_path):
    ps = ab.make_prompts(300)
    assert len(ps) == 300 and {p["kind"] for p in ps} == {"code", "prose"}
    assert len({p["text"] for p in ps}) > 250 and all(len(p["text"]) > 300 for p in ps)
    assert ab.make_prompts(20) == ps[:20]  # deterministic prefix
    tj = tmp_path / "m"
    tj.mkdir()
    how = ab.tokenize_prompts(ps[:3], str(tj), 64)
    assert how == "bytes+3" and all(len(p["input_ids"]) == 64 and max(p["input_ids"]) < 259 for p in ps[:3])
    f = tmp_path / "x.json"
    f.write_text(json.dumps(["hello", {"prompt": "a"}, {"input_ids": [1, 2]}]))
    got = ab.load_prompts_file(str(f), "<u>{prompt}</u>")
    assert got[0]["text"] == "<u>hello</u>" and got[1]["text"] == "<u>a</u>" and got[2]["input_ids"] == [1, 2]


def test_stream_parsing_cumulative_and_incremental():
    port = _free_port()
    for inc in (False, True):
        srv = FakeSGLang(port, "DDTREE-GPU", 17, incremental=inc, unhealthy_polls=0)
        try:
            r = ab.stream_generate(f"http://127.0.0.1:{port}", ab.request_payload({"input_ids": [1, 9]}, 20))
        finally:
            srv.stop()
        assert r["ok"], r
        assert r["output_ids"] == chain(9, 20)
        assert r["meta"]["completion_tokens"] == 20 and r["meta"]["finish_reason"] == "length"
        # chunks: 1 (prefill) + rounds of 3,1,4,2,5,3,1,1 -> one ITL value per token after the first
        assert r["n_chunks"] == 1 + r["meta"]["spec_verify_ct"] and len(r["itl"]) == 19
        assert r["ttft"] is not None and r["latency"] >= r["ttft"]
        port += 1


def test_full_run_against_fake_server(tmp_path):
    started = []
    launcher = make_launcher(started, broken={"ddtree_b64"}, mismatch={"ddtree_b8"}, incremental={"dflash"})
    args = _args(tmp_path, "--arms", "base,dflash,ddtree_b8,ddtree_b16,ddtreecpu_b16,ddtree_b64")
    t0 = time.time()
    doc = ab.run(args, launcher=launcher)
    assert time.time() - t0 < 30
    assert len(started) == 6
    arms = {a["name"]: a for a in doc["arms"]}
    assert arms["ddtree_b64"]["status"] == "failed" and "fake startup failure" in arms["ddtree_b64"]["log_tail"]
    for name in ("base", "dflash", "ddtree_b8", "ddtree_b16", "ddtreecpu_b16"):
        a = arms[name]
        assert a["status"] == "ok", a.get("error")
        assert [lv["concurrency"] for lv in a["levels"]] == [1, 4, 8]
        for lv in a["levels"]:
            n = doc["settings"]["requests_per_level"][str(lv["concurrency"])]
            assert lv["completed"] == n == min(24, max(16, 4 * lv["concurrency"]))  # auto
            assert lv["total_output_tokens"] == 12 * n and lv["output_throughput"] > 0
            assert lv["median_ttft_ms"] > 0 and lv["p99_itl_ms"] >= lv["median_itl_ms"] > 0
            for k in ("duration", "completed", "total_output_tokens", "output_throughput", "median_ttft_ms",
                      "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms"):
                assert k in lv  # sglang.bench_serving's names
            if name == "base":
                assert lv["accept_length"] is None and lv["tokens_per_chunk"] == 1.0
            else:  # the prefill's token, then rounds of 3,1,4,2,(5->)1: 12 tokens, 5 rounds, 6 chunks
                assert lv["accept_length"] == pytest.approx(12 / 5)
                assert lv["tokens_per_chunk"] == pytest.approx(12 / 6)
    # per-stage records only for the DDTREE arms, attributed per level
    assert arms["base"]["levels"][0].get("stage_profile") is None
    sp = arms["ddtree_b16"]["levels"][0]["stage_profile"]
    assert sp and sp["stage_ms"]["verify"] == 1.0 and sp["round_ms"] == 1.87
    assert "outside_ms" in sp and arms["ddtree_b16"]["env"]["SGLANG_DDTREE_PROFILE_FILE"]
    # identity
    idn = doc["identity"]
    assert idn["reference"] == "base"
    for name in ("dflash", "ddtree_b16", "ddtreecpu_b16"):
        assert idn["arms"][name]["identical"] and idn["arms"][name]["compared"] == 16 + 16 + 24
    bad = idn["arms"]["ddtree_b8"]
    assert bad["mismatched"] > 0 and not bad["identical"]
    assert {e["first_diff"] for e in bad["examples"]} == {5}
    assert "ddtree_b64" not in idn["arms"]
    # files and the markdown
    out = str(tmp_path / "res" / "ab")
    saved = json.load(open(out + ".json"))
    assert saved["arms"][0]["command_str"].startswith(sys.executable)
    md = open(out + ".md").read()
    for want in ("Output tokens per second", "| ddtree_b16 |", "x base", "Token identity against `base`",
                 "| ddtree_b8 | 56 | **", "Round time split", "fake startup failure", "--speculative-num-draft-tokens 17"):
        assert want in md, want
    # --report-only re-renders the same markdown from the JSON
    os.remove(out + ".md")
    assert ab.main(["--report-only", out + ".json"]) == 0
    assert open(out + ".md").read() == md


def test_drafttriton_arm_puts_the_drafter_on_triton_whatever_the_run_gives():
    """``_drafttriton``: the arm's own flag comes after the run's server args (so with
    ``--attention-backend flashinfer`` for every arm, that arm's drafter runs on triton); only
    DDTree arms, once; composes with the env / switch suffixes."""
    d = ab.parse_arm("ddtree_drafttriton")
    assert d["auto"] and d["env"] == {} and d["server_flags"] == ("--speculative-draft-attention-backend", "triton")
    assert ab.arm_switches(ab.parse_arm("ddtree_dfastplan")) == {"draft_fast_plan": True}   # the other fix
    ns = ab.parse_arm("ddtree_nospec_drafttriton")
    assert ab.arm_switches(ns) == {"budget_cycle": [0]} and ns["server_flags"] == d["server_flags"]
    for bad in ("base_drafttriton", "dflash_drafttriton", "ddtree_drafttriton_drafttriton"):
        with pytest.raises(ValueError, match="only DDTREE-GPU arms"):
            ab.parse_arm(bad)
    opts = dict(python="py", model_path="T", draft_model_path="D", maxc=16,
                server_args="--attention-backend flashinfer --speculative-draft-attention-backend flashinfer")
    cmd = ab.build_server_cmd(d, opts, 31000)
    assert cmd[-2:] == ["--speculative-draft-attention-backend", "triton"]
    assert ab.build_server_cmd(ab.parse_arm("ddtree"), opts, 31000)[-2:] == ["--speculative-draft-attention-backend",
                                                                            "flashinfer"]   # the run's, untouched


def test_deadline_skips_arms_and_still_writes(tmp_path):
    started = []
    args = _args(tmp_path, "--arms", "base,dflash,ddtree_b16", "--deadline", "4", "--min-arm-s", "2.5",
                 "--reserve-s", "0")
    orig = FakeSGLang.generate

    def slow(self, h, req):  # base takes ~2.1 s: then < 2.5 s are left, the other arms are skipped
        time.sleep(0.08)
        return orig(self, h, req)
    FakeSGLang.generate = slow
    try:
        doc = ab.run(args, launcher=make_launcher(started))
    finally:
        FakeSGLang.generate = orig
    st = [a["status"] for a in doc["arms"]]
    assert st[0] in ("ok", "partial") and st[1:] == ["skipped", "skipped"] and len(started) == 1
    md = open(str(tmp_path / "res" / "ab") + ".md").read()
    assert "skipped" in md and "deadline" in md


def test_merge_and_plot(tmp_path):
    started = []
    args = _args(tmp_path, "--arms", "base,ddtree_b16", "--concurrency", "1,4", "--requests-per-level", "8")
    ab.run(args, launcher=make_launcher(started))
    a = str(tmp_path / "res" / "ab.json")
    sweep = {"status": "ok", "info": {"gpu": "fake"}, "rows": [
        {"bs": b, "budget": 16, "D": 15, "gpu_us": 10.0, "cpu_heap_us": 300.0 * b, "speedup": 30.0 * b,
         "exact": True} for b in (1, 4)]}
    d = json.load(open(a))
    d["kernel_sweep"] = sweep
    json.dump(d, open(a, "w"))
    out = str(tmp_path / "merged")
    ab.main(["--merge", out, a, a])
    md = open(out + ".md").read()
    assert md.count("A/B serving benchmark: no_model") == 2 and "GPU tree build vs the CPU heap" in md
    # the summary: every (run, arm), tok/s with x the same run's base, the identity verdict
    merged = json.load(open(out + ".json"))
    assert [r["run_id"] for r in merged["runs"]] == ["1", "2"]
    rows = ab.summary_rows(merged)
    assert [(r["run"], r["arm"]) for r in rows] == [("1", "base"), ("1", "ddtree_b16"), ("2", "base"),
                                                    ("2", "ddtree_b16")]
    r = rows[1]
    base = merged["runs"][0]["arms"][0]["levels"][0]["output_throughput"]
    assert r["levels"][1]["x_base"] == pytest.approx(r["levels"][1]["tput"] / base)
    assert r["identity"] == "identical (16)"
    assert "## Summary" in md and "| ddtree_b16 | 1 | " in md and "identical (16) |" in md
    import gzip
    with gzip.open(out + ".per_request.json.gz", "rt") as f:  # per-request columns live beside the report
        pr = json.load(f)
    assert sorted(pr) == ["0/base/1", "0/base/4", "0/ddtree_b16/1", "0/ddtree_b16/4", "1/base/1", "1/base/4",
                          "1/ddtree_b16/1", "1/ddtree_b16/4"] and len(pr["0/base/1"]["latency_ms"]) == 8
    assert all("per_request" not in lv for r in merged["runs"] for a in r["arms"] for lv in a["levels"])
    # merging the merged report again (a new run appended) keeps the earlier runs' columns, re-keyed
    ab.main(["--merge", out + "_again", out + ".json", a])
    with gzip.open(out + "_again.per_request.json.gz", "rt") as f:
        pr2 = json.load(f)
    assert sorted(pr2) == sorted(list(pr) + [f"2/{arm}/{c}" for arm in ("base", "ddtree_b16") for c in (1, 4)])
    assert pr2["1/ddtree_b16/4"] == pr["1/ddtree_b16/4"] and pr2["2/base/1"] == pr["0/base/1"]
    assert [r["run_id"] for r in json.load(open(out + "_again.json"))["runs"]] == ["1", "2", "3"]
    ab.main(["--summary", out + ".json"])
    # --invalid: a broken measurement stays in the JSON and leaves every ratio
    ab.main(["--merge", out + "_inv", a, "--invalid", "ab.json", "base", "1", "a 9 s server stall"])
    inv = json.load(open(out + "_inv.json"))
    assert inv["runs"][0]["arms"][0]["levels"][0]["invalid"] == "a 9 s server stall"
    rows = ab.summary_rows(inv)
    assert rows[0]["levels"][1]["invalid"] and rows[1]["levels"][1]["x_base"] is None
    assert rows[1]["levels"][4]["x_base"] is not None
    assert "| base | invalid |" in open(out + "_inv.md").read()
    with pytest.raises(SystemExit, match="no such level"):
        ab.main(["--merge", out + "_bad", a, "--invalid", "ab.json", "base", "99", "x"])
    pytest.importorskip("matplotlib")
    assert os.path.getsize(out + ".png") > 10000
    plot = _load("ab_plot")
    plot.main([a])
    assert os.path.getsize(a[:-5] + ".png") > 10000


def test_kernel_sweep_skips_without_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has CUDA: the sweep would run")
    r = ab.run_kernel_sweep(sys.executable, 60, str(tmp_path))
    assert r["status"] == "skipped" and "no CUDA" in r["note"] and r["rows"] == []


def test_server_commands_parse_in_sglang(tmp_path):
    """The generated command lines are accepted by SGLang 0.5.16's own parser (CPU: --device cuda)."""
    sa_mod = pytest.importorskip("sglang.srt.server_args")
    pytest.importorskip("sglang.srt.plugins").load_plugins()
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "device", "mk_models.py"), str(tmp_path),
                    "--configs-only"], check=True, capture_output=True)
    opts = dict(python="py", model_path=str(tmp_path / "gqa_target"), draft_model_path=str(tmp_path / "drafter"),
                maxc=64, token_ids=True, server_args="", cuda_graph_bs=[1, 2, 4, 8, 16, 32, 64])
    for arm in ab.parse_arms("base,dflash,ddtree_b8,ddtreecpu_b64"):
        cmd = ab.build_server_cmd(arm, opts, 31000)
        assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
        sa = sa_mod.prepare_server_args(cmd[3:] + ["--device", "cuda"])
        assert sa.port == 31000 and sa.max_running_requests == 64 and sa.skip_tokenizer_init
        assert sa.attention_backend == "triton" and sa.skip_server_warmup
        assert sa.cuda_graph_config.decode.max_bs == 64 and sa.cuda_graph_config.decode.bs == [1, 2, 4, 8, 16, 32, 64]
        assert str(getattr(sa.cuda_graph_config.prefill.backend, "value", sa.cuda_graph_config.prefill.backend)) \
            == "disabled"
        sa = sa_mod.prepare_server_args(ab.build_server_cmd(arm, dict(opts, prefill_cuda_graph=True), 31000)[3:]
                                        + ["--device", "cuda"])
        assert str(getattr(sa.cuda_graph_config.prefill.backend, "value", sa.cuda_graph_config.prefill.backend)) \
            != "disabled"
        sa = sa_mod.prepare_server_args(ab.build_server_cmd(arm, dict(opts, prefill_cuda_graph=512), 31000)[3:]
                                        + ["--device", "cuda"])
        assert str(getattr(sa.cuda_graph_config.prefill.backend, "value", sa.cuda_graph_config.prefill.backend)) \
            != "disabled" and sa.cuda_graph_config.prefill.max_bs == 512
        if arm["algo"] is None:
            assert sa.speculative_algorithm is None
        else:
            assert sa.speculative_algorithm == arm["algo"]
            want = arm["num_draft_tokens"] or 8  # DFLASH: the drafter's block size
            assert sa.speculative_num_draft_tokens == want


FAKE_PY = """#!{python}
# stands in for `python -m sglang.launch_server ...`: a fake server plus a child process (as SGLang's
# scheduler and detokenizer are), so the benchmark must kill the whole process group
import importlib.util, os, subprocess, sys, time
spec = importlib.util.spec_from_file_location("fake_t", {test!r})
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)
assert sys.argv[1:3] == ["-m", "sglang.launch_server"], sys.argv
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["FAKE_CHILD_PID_FILE"], "w").write(str(child.pid))
print("fake server starting", " ".join(sys.argv[1:]), flush=True)
print("fake server cwd", os.getcwd(), flush=True)
t.FakeSGLang(int(sys.argv[sys.argv.index("--port") + 1]), unhealthy_polls=1)
while True:
    time.sleep(1)
"""


def test_popen_launcher_starts_and_kills_the_group(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY.format(python=sys.executable, test=os.path.abspath(__file__)))
    fake.chmod(0o755)
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_CHILD_PID_FILE", str(pidfile))
    args = _args(tmp_path, "--arms", "base", "--concurrency", "1,2", "--requests-per-level", "4",
                 "--python", str(fake), "--start-timeout", "60")
    doc = ab.run(args)  # the real launcher: PopenServer
    a = doc["arms"][0]
    assert a["status"] == "ok", (a.get("error"), a.get("log_tail"))
    assert a["command"][0] == str(fake)
    log = open(a["log"]).read()
    assert "fake server starting -m sglang.launch_server" in log
    # `python -m` puts the cwd first on sys.path: a server started from a checkout's root would
    # import the bare sglang_ddtree source folder instead of the installed package
    monkeypatch.chdir(tmp_path)
    assert f"fake server cwd {os.path.dirname(os.path.abspath(a['log']))}" in log
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the server's child process outlived the benchmark")


def test_dry_run_prints_commands(tmp_path, capsys):
    args = _args(tmp_path, "--arms", "base,ddtree_b32", "--dry-run")
    ab.run(args)
    out = capsys.readouterr().out
    assert "[ddtree_b32]" in out and "--speculative-num-draft-tokens 33" in out and '"count": 24' in out


def test_interrupt_stops_the_server_and_writes(tmp_path, monkeypatch):
    started, stopped = [], []
    inner = make_launcher(started)

    def launcher(cmd, env, log_path):
        srv = inner(cmd, env, log_path)
        orig = srv.stop

        def stop():
            stopped.append(cmd)
            orig()
        srv.stop = stop
        return srv
    real = ab_client.run_level
    calls = []

    def run_level(*a, **k):
        calls.append(1)
        if len(started) == 2 and a[2] == 4:  # second arm, level c=4: SIGTERM arrives
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(ab_client, "run_level", run_level)  # the runner calls it through the client module
    doc = ab.run(_args(tmp_path, "--arms", "base,dflash,ddtree_b16"), launcher=launcher)
    assert doc["interrupted"] and len(started) == 2 and len(stopped) == 2
    st = {a["name"]: a for a in doc["arms"]}
    assert st["base"]["status"] == "ok" and st["dflash"]["status"] == "partial"
    assert [lv["concurrency"] for lv in st["dflash"]["levels"]] == [1]
    assert doc["identity"]["arms"]["dflash"]["compared"] == 16
    for lv in st["base"]["levels"]:   # each repeat's wall-clock window, in run order (round_gaps.py)
        w = lv["repeat_windows"]
        assert len(w) == lv["repeats"] == 3 and all(a[0] <= a[1] <= b[0] for a, b in zip(w, w[1:]))
        assert w[-1][0] <= w[-1][1] and "_window" not in lv
    saved = json.load(open(str(tmp_path / "res" / "ab.json")))
    assert saved["interrupted"] and len(saved["arms"]) == 2


def test_kernel_sweep_logic_on_cpu(tmp_path):
    """The sweep's loop with bench/tree_kernels.py's helpers swapped for CPU ones (the Triton
    interpreter builds the trees): rows written, trees identical to the heap."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CPU stand-in of the sweep (its CPU tensors cannot launch CUDA kernels); the real "
                    "sweep runs on the GPU host (bench/device stage `sweep`)")
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(REPO, "tests"))
    try:
        from helpers import drafter_logits
    finally:
        sys.path.pop(0)
    from sglang_ddtree import ddtree

    def make_inputs(bs, D, budget, n_sets, gen, V=64):
        out = []
        for _ in range(n_sets):
            lp, ids = ddtree.topk_logprobs(drafter_logits(bs, D, V, gen), min(budget, V), validate=False)
            out.append((lp, ids, torch.randint(0, V, (bs,), generator=gen)))
        return out

    def timer(fns, replays=2):
        t = time.perf_counter()
        for f in fns:
            f()
        us = (time.perf_counter() - t) * 1e6 / len(fns)
        return us, us, us
    tk = SimpleNamespace(make_inputs=make_inputs, graph_time_us=timer, REPS=1,
                         cpu_time_us=lambda f, reps: timer([f])[0])
    path = str(tmp_path / "s.jsonl")
    assert ab.kernel_sweep_child(path, (1, 2), (4,), (3,), tk=tk) == 0
    rows = [json.loads(x) for x in open(path)]
    assert "info" in rows[0]
    assert [(r["bs"], r["budget"], r["D"]) for r in rows[1:]] == [(1, 4, 3), (2, 4, 3)]
    assert all(r["exact"] and r["gpu_us"] > 0 and r["cpu_heap_us"] > 0 for r in rows[1:])


def test_pick_repeat_reports_the_median_run_and_repeat_mismatches():
    def lv(t, partial=False):
        return {"output_throughput": t, "partial": partial}
    a, b = [[1, 2], [3]], [[1, 2], [4]]
    got, outs = ab.pick_repeat([(lv(900.0), a), (lv(100.0), b), (lv(500.0), a)])
    assert got["output_throughput"] == 500.0 and outs == a
    assert got["output_throughput_repeats"] == [900.0, 100.0, 500.0] and got["repeats"] == 3
    assert got["repeat_output_mismatches"] == 1  # the 100 tok/s run's second request
    # a partial run is never the reported one while a complete run exists; an even count takes the lower middle
    got, _ = ab.pick_repeat([(lv(50.0, True), a), (lv(300.0), a), (lv(200.0), a)])
    assert got["output_throughput"] == 200.0 and got["median_of"] == 2


@pytest.mark.parametrize("cfg", ["kimi_k26_tp8_ddtree.yaml", "qwen3_8b_ddtree.yaml"])
def test_deployment_configs_drive_every_arm(cfg, tmp_path):
    """--config configs/<real deployment>.yaml: the YAML (minus its speculative and host/port keys) is
    every arm's base, so TP, quantization and backends stay the user's; the arm adds only its algorithm."""
    pytest.importorskip("yaml")
    args = ab.build_parser().parse_args(["--config", os.path.join(REPO, "configs", cfg), "--num-prompts", "4",
                                         "--arms", "base,dflash,ddtree_b32,ddtreecpu_b16"])
    model, draft, token_ids, cfg_path, keys, prompts, source, how = ab.resolve_inputs(args)
    import yaml
    raw = yaml.safe_load(open(os.path.join(REPO, "configs", cfg)))
    try:
        kept = yaml.safe_load(open(cfg_path))
        assert model == raw["model-path"] and draft == raw["speculative-draft-model-path"]
        assert not set(kept) & set(ab.CONFIG_DROP) and kept.get("tp-size") == raw.get("tp-size")
        assert len(prompts) == 4 and not token_ids
        opts = dict(python="py", model_path=model, draft_model_path=draft, maxc=64, token_ids=False,
                    server_args="", cuda_graph_bs=None)
        for arm in ab.parse_arms(args.arms):
            cmd = ab.build_server_cmd(arm, opts, 31000, cfg_path, keys)
            s = " ".join(cmd)
            assert f"--config {cfg_path}" in s and "--port 31000" in s
            for k in keys:  # the config's own settings are never overridden by the benchmark's defaults
                assert f"--{k} " not in s, k
            if arm["algo"]:
                assert f"--speculative-algorithm {arm['algo']}" in s
                if arm["budget"]:
                    assert f"--speculative-num-draft-tokens {arm['budget'] + 1}" in s
            else:
                assert "--speculative" not in s
    finally:
        os.remove(cfg_path)


def test_recommendation_is_the_fastest_lossless_arm():
    """The report's "which arm to run": per concurrency the fastest arm whose outputs are identical
    to the reference's or differ only at classified near ties; an arm with an error never wins."""
    from sglang_ddtree.ab import report

    def arm(name, *tputs):
        return dict(name=name, status="done", levels=[dict(concurrency=c, output_throughput=t)
                                                       for c, t in zip((1, 64), tputs)])
    run = dict(settings=dict(concurrency=[1, 64]),
               arms=[arm("base", 200.0, 4000.0), arm("dflash", 150.0, 3000.0),
                     arm("ddtree_b16", 250.0, 3500.0), arm("ddtree_b32", 300.0, 3900.0),
                     arm("ddtree_b64", 400.0, 5000.0)],
               identity=dict(reference="base", arms={
                   "dflash": dict(compared=10, mismatched=0),
                   "ddtree_b16": dict(compared=10, mismatched=2),
                   "ddtree_b32": dict(compared=10, mismatched=0),
                   "ddtree_b64": dict(compared=10, mismatched=3)},
                   classification=dict(arms={"ddtree_b16": dict(near_tie=2, error=0),
                                             "ddtree_b64": dict(near_tie=2, error=1)})))
    rec = {r["c"]: r for r in report.recommendations(run)}
    assert rec[1]["arm"] == "ddtree_b32" and rec[1]["x_base"] == pytest.approx(1.5)
    assert rec[1]["x_dflash"] == pytest.approx(2.0) and rec[1]["best_ddtree"] == "ddtree_b32"
    assert rec[64]["arm"] == "base" and rec[64]["best_ddtree"] == "ddtree_b32"   # b64 has an error
    assert rec[64]["best_ddtree_x_base"] == pytest.approx(3900 / 4000)
    md = "\n".join(report._render_recommendations(run, "##"))
    assert "| 1 | ddtree_b32 | 300 | 1.50 | 2.00 | ddtree_b32 (1.50x) |" in md
    assert "| 64 | base | 4000 | 1.00 | 1.33 | ddtree_b32 (0.97x) |" in md


@pytest.mark.parametrize("n_code,n_prose", [(14, 7), (622, 7), (5, 13), (1, 1)])
def test_prompts_visit_every_source_before_repeating(monkeypatch, n_code, n_prose):
    """Python 3.12's held-out files give 7 module docstrings: a step of 7 sent all prose prompts to one."""
    from sglang_ddtree.ab import prompts as P
    code = [(f"c{i}", f"code body {i}") for i in range(n_code)]
    prose = [(f"p{i}", f"prose body {i}") for i in range(n_prose)]
    monkeypatch.setattr(P, "_stdlib_texts", lambda files=None: (code, prose))
    ps = P.make_prompts(2 * max(n_code, n_prose))
    for kind, size in (("code", n_code), ("prose", n_prose)):
        srcs = [p["source"] for p in ps if p["kind"] == kind]
        assert len(set(srcs[:size])) == size, (kind, srcs[:size])


def test_verify_width_per_arm(tmp_path):
    from sglang_ddtree.ab import runner
    d = tmp_path / "dr"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 16}}))
    assert runner.verify_width({"kind": "ddtree", "num_draft_tokens": 17}, str(d)) == 17
    assert runner.verify_width({"kind": "dflash", "num_draft_tokens": None}, str(d)) == 16
    assert runner.verify_width({"kind": "dflash", "num_draft_tokens": None}, str(tmp_path / "none")) is None
    assert runner.verify_width({"kind": "base", "num_draft_tokens": None}, None) is None


def test_ddtree_auto_arm(tmp_path):
    from sglang_ddtree.ab import report, servers
    a = servers.parse_arm("ddtree_auto")
    assert a["auto"] and a["budget"] == 31 and a["num_draft_tokens"] == 32
    assert a["env"] == {"SGLANG_DDTREE_BUDGETS": "0,7,15,31"}          # 0: no speculation
    b = servers.parse_arm("ddtree_auto_b63-7-15")
    assert b["env"]["SGLANG_DDTREE_BUDGETS"] == "0,7,15,63" and b["num_draft_tokens"] == 64
    for bad in ("ddtree_auto_7-15", "ddtree_auto_bx", "ddtree_autox"):
        with pytest.raises(ValueError):
            servers.parse_arm(bad)
    cmd = servers.build_server_cmd(a, {"model_path": "T", "draft_model_path": "D", "maxc": 4}, 30000)
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "32"
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "DDTREE-GPU"

    def lv(c, tput):
        return {"concurrency": c, "completed": 4, "failed": 0, "num_requests": 4, "output_throughput": tput}
    same = {"compared": 8, "mismatched": 0, "errors": 0}
    run = {"settings": {"concurrency": [1, 16]},
           "identity": {"reference": "base", "arms": {n: same for n in ("dflash", "ddtree_b16", "ddtree_auto")}},
           "arms": [{"name": n, "kind": n.split("_")[0], "status": "ok", "levels": [lv(1, t1), lv(16, t16)]}
                    for n, t1, t16 in (("base", 100, 1000), ("dflash", 120, 700), ("ddtree_b16", 150, 600),
                                       ("ddtree_auto", 146, 990))]}
    rec = {r["c"]: r for r in report.recommendations(run)}
    assert abs(rec[1]["auto"]["ddtree_auto"]["x_best_of_base_dflash"] - 146 / 120) < 1e-9
    assert abs(rec[1]["auto"]["ddtree_auto"]["x_best_fixed"] - 146 / 150) < 1e-9
    assert rec[1]["best_ddtree"] == "ddtree_b16"   # the adaptive arm is not a fixed budget
    md = "\n".join(report._render_recommendations(run, "##"))
    assert "| 1 | ddtree_auto | 1.22 | 0.97 | yes |" in md
    assert "| 16 | ddtree_auto | 0.99 | 1.65 | **no** |" in md


def test_textpair_prompts_are_bare_and_in_domain():
    """The text pair is a base model of the standard library's raw text: its prompts are held-out code
    windows and docstrings as they are, not wrapped in a task line and a code fence."""
    from sglang_ddtree.ab import prompts as P
    ps = P.textpair_prompts(48)
    tasks = P._CODE_TASKS + P._PROSE_TASKS
    assert len(ps) == 48 and all("```" not in p["text"] and not p["text"].startswith(tasks) for p in ps)
    held = set(P.textpair_heldout_files())
    assert all(p["source"].split(":")[0][len("stdlib/"):] in held for p in ps)
    assert len({p["source"] for p in ps if p["kind"] == "prose"}) == 24
    wrapped = P.make_prompts(48, files=P.textpair_heldout_files())
    assert [p["source"] for p in wrapped] == [p["source"] for p in ps]   # same sources, only the wrapping differs


def test_chain_prompts_for_the_toy_pairs(tmp_path):
    """bench/device/mk_chain_prompts.py: short id prompts (the test bed's regime) the A/B's --prompts reads."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "mk_chain_prompts", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         "bench", "device", "mk_chain_prompts.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    ps = mk.chain_prompts(200, seed=3)
    assert ps == mk.chain_prompts(200, seed=3) and ps != mk.chain_prompts(200, seed=4)
    assert all(2 <= len(p) <= 40 and p[0] == 1 and all(3 <= t < 1000 for t in p[1:]) for p in ps)
    assert min(map(len, ps)) <= 5 and max(map(len, ps)) >= 35   # the whole range, not one length
    longp = mk.chain_prompts(20, seed=3, min_len=8000, max_len=8192)   # a long-context arm's prompts
    assert all(8000 <= len(p) <= 8192 and p[0] == 1 for p in longp) and len(set(map(len, longp))) > 5
    with pytest.raises(ValueError):
        mk.chain_prompts(3, min_len=41, max_len=40)
    out = tmp_path / "p.jsonl"
    with open(out, "w") as f:
        for p in ps[:5]:
            f.write(json.dumps({"input_ids": p}) + "\n")
    from sglang_ddtree.ab import prompts as PR
    got = PR.load_prompts_file(str(out))
    assert [g["input_ids"] for g in got] == ps[:5]


def test_rounds_per_verify_width_recorded_aggregated_and_rendered(tmp_path, monkeypatch):
    """The adaptive arm mixes verify widths in one profile record: the profiler splits its rounds by
    width (verify stage and round medians per width), the A/B aggregates the split rounds-weighted,
    and the report renders a per-width table only for arms that mixed widths."""
    from sglang_ddtree import profiling
    from sglang_ddtree.ab import report
    done = [([1.0, 0.0, 0.0, v, 0.0, 0.0], r, 0.5, bs, w)
            for v, r, bs, w in ((4.0, 6.0, 2, 8), (5.0, 7.0, 4, 8), (9.0, 11.0, 2, 32), (0.5, 2.0, 6, 1))]
    bw = profiling._by_width(done)
    assert set(bw) == {"1", "8", "32"} and bw["8"]["rounds"] == 2 and bw["8"]["bs_mean"] == 3.0
    assert bw["8"]["verify_ms"]["median"] == 4.5 and bw["32"]["round_ms"]["median"] == 11.0
    assert profiling._by_width([(d[0], d[1], d[2], d[3], None) for d in done]) is None
    path = tmp_path / "p.jsonl"
    monkeypatch.setenv(profiling.ENV_FILE, str(path))
    prof = profiling.RoundProfiler({"algo": "DDTREE-GPU"})
    prof._done = list(done)
    prof._flush()
    rec = json.loads(path.read_text().splitlines()[-1])
    assert rec["by_width"] == json.loads(json.dumps(bw))
    rec2 = dict(rec, rounds=4, by_width={"8": {"rounds": 6, "bs_mean": 1.0, "verify_ms": {"median": 6.5},
                                               "round_ms": {"median": 9.0}}})
    agg = ab.aggregate_profile([rec, rec2])
    assert agg["by_width"]["8"]["rounds"] == 8 and agg["by_width"]["8"]["verify_ms"] == round((4.5 * 2 + 6.5 * 6) / 8, 4)
    assert agg["by_width"]["32"]["rounds"] == 1 and agg["by_width"]["1"]["verify_ms"] == 0.5
    assert "by_width" not in ab.aggregate_profile([{k: v for k, v in rec.items() if k != "by_width"}])
    import copy
    import os
    base_doc = json.load(open(os.path.join(os.path.dirname(__file__), "..", "bench", "results",
                                           "ab_h200_kimicost_chain.json")))
    assert "Rounds per verify width" not in report.render_markdown(base_doc)   # older records: no table
    doc = copy.deepcopy(base_doc)
    arms = {a["name"]: a for a in doc["arms"]}
    lv16 = next(lv for lv in arms["ddtree_auto_vattn"]["levels"] if lv["concurrency"] == 16)
    lv16["stage_profile"]["by_width"] = agg["by_width"]
    lv1d = next(lv for lv in arms["dflash"]["levels"] if lv["concurrency"] == 1)
    lv1d["stage_profile"]["by_width"] = {"8": agg["by_width"]["8"]}           # one width: no rows
    md = report.render_markdown(doc)
    tail = md.split("Rounds per verify width")[1]
    assert "| ddtree_auto_vattn | 16 | no spec | 1 (10 %) |" in tail
    assert "| ddtree_auto_vattn | 16 | 8 | 8 (80 %) |" in tail and "| dflash |" not in tail.split("##")[0]


def test_host_time_per_stage_recorded_aggregated_and_rendered(tmp_path, monkeypatch):
    """The profiler splits the worker call's host time at the stage marks (host_stage_ms: wall time
    from one mark to the next), the A/B aggregates it like stage_ms, and the report renders the
    host table; older records without it render no such table."""
    import copy
    import os

    from sglang_ddtree import profiling
    from sglang_ddtree.ab import report

    path = tmp_path / "p.jsonl"
    monkeypatch.setenv(profiling.ENV_FILE, str(path))
    prof = profiling.RoundProfiler({"algo": "DDTREE-GPU"})
    ticks = iter([10.0, 10.002, 10.0025, 10.004, 10.009, 10.0092, 10.010, 10.0105])
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: next(ticks))

    class Ev:                                  # a finished CUDA event 1 ms after the previous one
        n = 0

        def __init__(self):
            Ev.n += 1
            self.t = Ev.n

        def query(self):
            return True

        def elapsed_time(self, other):
            return float(other.t - self.t)

    monkeypatch.setattr(prof, "_event", Ev)
    prof.begin()
    for _ in profiling.STAGES:
        prof.mark()
    prof.end(3, 8)
    prof._flush()
    rec = json.loads(path.read_text().splitlines()[-1])
    want = {"draft": 2.0, "tree": 0.5, "verify_prep": 1.5, "verify": 5.0, "accept": 0.2, "commit": 0.8}
    assert {k: v["median"] for k, v in rec["host_stage_ms"].items()} == pytest.approx(want, abs=1e-6)
    assert rec["host_ms"]["median"] == pytest.approx(10.5, abs=1e-6)
    assert rec["stage_ms"]["verify"]["median"] == 1.0
    rec2 = dict(rec, rounds=3, host_stage_ms={k: {"median": 2 * v} for k, v in want.items()})
    agg = ab.aggregate_profile([rec, rec2])
    assert agg["host_stage_ms"]["verify"] == pytest.approx((5.0 + 3 * 10.0) / 4, abs=1e-4)
    old = {k: v for k, v in rec.items() if k != "host_stage_ms"}
    assert "host_stage_ms" not in ab.aggregate_profile([old])

    base_doc = json.load(open(os.path.join(os.path.dirname(__file__), "..", "bench", "results",
                                           "ab_h200_kimicost_chain.json")))
    assert "Host time per stage" not in report.render_markdown(base_doc)
    doc = copy.deepcopy(base_doc)
    lv = next(lv for a in doc["arms"] if a["name"] == "dflash" for lv in a["levels"] if lv["concurrency"] == 1)
    lv["stage_profile"]["host_stage_ms"] = agg["host_stage_ms"]
    lv["stage_profile"]["host_ms"] = 20.0
    tail = report.render_markdown(doc).split("Host time per stage")[1].split("##")[0]
    row = next(r for r in tail.splitlines() if r.startswith("| dflash | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[3 + profiling.STAGES.index("verify")]) == pytest.approx(agg["host_stage_ms"]["verify"], abs=1e-3)
    assert float(cells[-2]) == pytest.approx(20.0 - sum(agg["host_stage_ms"].values()), abs=2e-3)   # rest


def test_torch_profile_pass_is_uncounted_summarized_and_rendered(tmp_path):
    """--torch-profile 4:5: after level 4's repeats, one extra pass with /start_profile; its trace's
    summary is in the level (per-step busy / idle / categories), the measured numbers are the
    repeats', and the report has the trace table."""
    started = []
    args = _args(tmp_path, "--arms", "base,ddtree_b16", "--repeats", "1", "--torch-profile", "4:5")
    doc = ab.run(args, launcher=make_launcher(started))
    arms = {a["name"]: a for a in doc["arms"]}
    for name, ver in (("base", 1.0), ("ddtree_b16", 1.2)):
        lvs = {lv["concurrency"]: lv for lv in arms[name]["levels"]}
        assert "torch_profile" not in lvs[1] and "torch_profile" not in lvs[8]
        t = lvs[4]["torch_profile"]
        assert "error" not in t, t
        assert t["steps"] == 5 and t["pass"]["concurrency"] == 4 and t["pass"]["failed"] == 0
        assert t["per_step"]["busy_ms"] == pytest.approx(ver + 0.1, abs=1e-6)
        assert t["per_step"]["idle_ms"] == pytest.approx(0.3 * 4 / 5, abs=1e-6)
        assert t["kernel_ms_per_step_by_category"]["attention"] == pytest.approx(ver)
        assert t["kernel_ms_per_step_by_category"]["ddtree"] == pytest.approx(0.1)
        assert t["host_calls_per_step"]["cudaGraphLaunch"]["calls"] == 1
    assert doc["settings"]["torch_profile"] == "4:5"
    md = open(str(tmp_path / "res" / "ab") + ".md").read()
    assert "GPU trace of one uncounted pass" in md and "| ddtree_b16 | 4 | 5 |" in md


@pytest.mark.parametrize("bad", ["0", "4:0", "x", "4:5:6", "-1"])
def test_torch_profile_spec_is_checked(bad):
    with pytest.raises(SystemExit, match="torch-profile"):
        ab.main(["--torch-profile", bad, "--dry-run"])


def test_each_arm_records_its_verify_attention(tmp_path):
    """SGLANG_DDTREE_VERIFY_ATTN=auto decides per server: the A/B keeps what each DDTREE server logged
    (ours, or SGLang's kernel and why) and the report says it beside the command line."""
    args = _args(tmp_path, "--arms", "base,ddtree_b8,ddtree_b8_sglattn,ddtree_b8_dattn", "--repeats", "1",
                 "--concurrency", "1")
    doc = ab.run(args, launcher=make_launcher([]))
    arms = {a["name"]: a for a in doc["arms"]}
    assert "verify_attention" not in arms["base"]
    # _dattn: the drafter's block through our kernel too (switch draft_attn=ddtree), recorded
    assert arms["ddtree_b8_dattn"]["draft_attention"].endswith("(block 16, all visible, 7 prefix splits)")
    assert all("draft_attention" not in arms[n] for n in ("base", "ddtree_b8", "ddtree_b8_sglattn"))
    assert arms["ddtree_b8"]["verify_attention"].startswith("sglang_ddtree tree_verify_attention (bitmask")
    assert arms["ddtree_b8_sglattn"]["verify_attention"].startswith("SGLang's masked extend kernel")
    md = open(str(tmp_path / "res" / "ab") + ".md").read()
    assert "; target verify attention: sglang_ddtree tree_verify_attention" in md
    assert "; drafter block attention: sglang_ddtree tree_verify_attention (block 16" in md
    assert ab.verify_attention_of(str(tmp_path / "nothing.log")) is None


def test_requests_per_level_specs():
    from sglang_ddtree.ab.runner import requests_per_level
    assert [requests_per_level("auto", c, 300) for c in (1, 4, 16, 64)] == [16, 16, 64, 256]
    assert [requests_per_level("auto:32", c, 300) for c in (1, 4, 16, 64)] == [32, 32, 64, 256]
    assert requests_per_level("auto:32", 64, 100) == 100 and requests_per_level("all", 1, 77) == 77
    assert requests_per_level("8", 64, 100) == 8
    for bad in ("auto:", "auto:0", "auto:x", "autox", "0", "-3", "many", "1:32,4", "1:0", "4:x,1:3", "0:5"):
        with pytest.raises(ValueError, match="requests-per-level"):
            requests_per_level(bad, 4, 100)
    per_c = "1:32,4:96, 16:128,64:256"
    assert [requests_per_level(per_c, c, 300) for c in (1, 4, 16, 64)] == [32, 96, 128, 256]
    assert requests_per_level(per_c, 64, 200) == 200 and requests_per_level("4:9", 4, 100) == 9
    with pytest.raises(ValueError, match="no count for concurrency 8"):
        requests_per_level(per_c, 8, 300)


def test_new_tokens_spread_gives_every_arm_the_same_lengths(tmp_path):
    """--new-tokens-spread 0.5: prompt i asks round(12 * (0.5 + u_i)) tokens, u_i = frac((i + 1) *
    golden ratio), in every arm; outputs stay identical across arms, the report says the spread, and
    a spread outside [0, 1) is refused."""
    from sglang_ddtree.ab.prompts import GOLDEN, spread_new_tokens
    args = _args(tmp_path, "--arms", "base,ddtree_b8", "--repeats", "1", "--concurrency", "1,4",
                 "--new-tokens-spread", "0.5")
    doc = ab.run(args, launcher=make_launcher([]))
    want = [max(1, round(12 * (0.5 + ((i + 1) * GOLDEN) % 1.0))) for i in range(24)]
    assert len(set(want)) > 5 and min(want) >= 6 and max(want) <= 18
    for a in doc["arms"]:
        assert a["status"] == "ok", a.get("error")
        lv = {x["concurrency"]: x for x in a["levels"]}
        assert lv[1]["total_output_tokens"] == sum(want[:16])
    assert doc["settings"]["new_tokens_spread"] == 0.5
    assert "max_new_tokens 12 (x0.5-1.5 per prompt, the same in every arm)" in open(
        str(tmp_path / "res" / "ab") + ".md").read()
    assert spread_new_tokens([{"text": "a"}], 0.0) == [{"text": "a"}]
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="new-tokens-spread"):
            spread_new_tokens([{"text": "a"}], bad)


def test_freeze_gc_arm_suffix_and_option(tmp_path):
    """``_freezegc`` (any arm, last) and ``--freeze-gc`` (every arm): SGLang's /freeze_gc is called
    once, after that arm's warm-up, and the arm's record and the settings say so; other arms are not
    touched; a doubled suffix is refused."""
    from sglang_ddtree.ab.servers import parse_arm
    assert parse_arm("ddtree_auto_nooverhead_freezegc")["env"]["DDTREE_SWITCHES"] == '{"round_overhead": false}'
    assert parse_arm("base_freezegc")["freeze_gc"] and parse_arm("base_freezegc")["kind"] == "base"
    assert "freeze_gc" not in parse_arm("dflash")
    with pytest.raises(ValueError, match="_freezegc once"):
        parse_arm("dflash_freezegc_freezegc")
    for extra, frozen in ((["--arms", "base,dflash_freezegc,ddtree_b8"], {"dflash_freezegc"}),
                          (["--arms", "base,ddtree_b8", "--freeze-gc"], {"base", "ddtree_b8"})):
        servers = []
        inner = make_launcher([])

        def launcher(cmd, env, log_path):
            servers.append(inner(cmd, env, log_path))
            return servers[-1]
        doc = ab.run(_args(tmp_path, *extra, "--repeats", "1", "--concurrency", "1"), launcher=launcher)
        calls = {a["name"]: s.freeze_gc_calls for a, s in zip(doc["arms"], servers)}
        assert calls == {a["name"]: int(a["name"] in frozen) for a in doc["arms"]}, calls
        assert {a["name"] for a in doc["arms"] if a.get("freeze_gc")} == frozen
        assert set(doc["settings"]["freeze_gc"]) == frozen
        assert all(a["status"] == "ok" for a in doc["arms"])


def test_warmup_batches_are_recorded_and_rendered(tmp_path):
    """The uncounted warm-up (a burst at the largest concurrency, then full-length requests at c=1)
    keeps its own figures per arm: accept length for speculative arms, None for base."""
    doc = ab.run(_args(tmp_path, "--arms", "base,ddtree_b8", "--repeats", "1", "--concurrency", "1,4"),
                 launcher=make_launcher([]))
    by = {a["name"]: a for a in doc["arms"]}
    for name in ("base", "ddtree_b8"):
        wu = by[name]["warmup"]
        assert wu["burst"]["concurrency"] == 4 and wu["burst"]["num_requests"] == 4
        assert wu["single"]["concurrency"] == 1 and wu["single"]["num_requests"] == 2
        assert wu["burst"]["completed"] == 4 and wu["burst"]["total_output_tokens"] == 4 * 12
    assert by["base"]["warmup"]["burst"]["accept_length"] is None
    assert by["ddtree_b8"]["warmup"]["single"]["accept_length"] > 1.0
    md = open(str(tmp_path / "res" / "ab") + ".md").read()
    assert "Warm-up (uncounted): the first batch after start-up" in md and "| ddtree_b8 | 4 | 4 |" in md


def test_pinned_arms_share_the_adaptive_server(tmp_path):
    """``ddtree_auto..._pin<B>``: one server for the adaptive arm and its pinned arms (started and warmed
    up once, measured in order), every pinned request carries custom_params.ddtree_budget = B, each
    arm has its own record and identity; the report counts pinned arms (B > 0) as fixed budgets."""
    from sglang_ddtree.policy import adaptive_config
    from sglang_ddtree.ab import report, runner, servers as S
    assert runner.PIN_KEY == adaptive_config.REQUEST_BUDGET_KEY     # the ab package keeps its own copy (runs alone)
    a = S.parse_arm("ddtree_auto_b7-15_pin7")
    assert a["pin"] == 7 and a["server"] == "ddtree_auto_b7-15" and a["num_draft_tokens"] == 16
    assert S.parse_arm("ddtree_auto_pin0")["pin"] == 0
    for bad, words in (("ddtree_auto_b7-15_pin31", "not one of"), ("ddtree_b16_pin15", "only adaptive"),
                       ("ddtree_auto_pin7_pin15", "once")):
        with pytest.raises(ValueError, match=words):
            S.parse_arm(bad)
    started, servers = [], []
    inner = make_launcher(started)

    def launcher(cmd, env, log_path):
        servers.append(inner(cmd, env, log_path))
        return servers[-1]
    arms = "base,ddtree_auto_b7-15_pin15,ddtree_auto_b7-15,dflash,ddtree_auto_b7-15_pin7"
    doc = ab.run(_args(tmp_path, "--arms", arms, "--repeats", "1", "--concurrency", "1,4"), launcher=launcher)
    names = [x["name"] for x in doc["arms"]]
    assert names == ["base", "ddtree_auto_b7-15", "ddtree_auto_b7-15_pin15", "ddtree_auto_b7-15_pin7", "dflash"]
    assert len(started) == 3                                    # base, the adaptive server, dflash
    auto = servers[1]
    n_lv = sum(doc["settings"]["requests_per_level"].values())
    warm = len(auto.pins) - 3 * n_lv - 1                       # warm-up requests, then a flush request per arm
    assert warm > 0 and set(auto.pins[:warm]) == {None}
    by = {x["name"]: x for x in doc["arms"]}
    assert all(x["status"] == "ok" for x in doc["arms"])
    assert by["ddtree_auto_b7-15_pin15"]["server_of"] == "ddtree_auto_b7-15"
    assert by["ddtree_auto_b7-15_pin7"]["pin"] == 7 and by["ddtree_auto_b7-15_pin7"]["verify_width"] == 8
    assert "warmup" in by["ddtree_auto_b7-15"] and "warmup" not in by["ddtree_auto_b7-15_pin7"]
    pinned = [p for p in auto.pins if p is not None]
    assert pinned == [15] * n_lv + [7] * n_lv
    assert doc["identity"]["arms"]["ddtree_auto_b7-15_pin7"]["mismatched"] == 0
    # the report: pinned budgets count as fixed ones, the adaptive arm against them
    rec = {r["c"]: r for r in report.recommendations(doc)}
    assert rec[4]["best_ddtree"] in ("ddtree_auto_b7-15_pin15", "ddtree_auto_b7-15_pin7")
    assert set(rec[4]["auto"]) == {"ddtree_auto_b7-15"}
