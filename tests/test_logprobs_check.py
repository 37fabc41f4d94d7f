"""bench/logprobs_check.py's parsing and comparison helpers (the GPU stage itself needs servers)."""
from helpers import load_bench

LC = load_bench("logprobs_check")


def test_out_tokens_reads_sglang_layout():
    resp = {"meta_info": {"output_token_logprobs": [[-0.5, 11, None], [-1.25, 7, None]],
                          "output_top_logprobs": [[[-0.5, 11, None], [-1.0, 3, None]],
                                                  [[-1.25, 7, None], [-1.5, 9, None]]]}}
    toks, tops = LC.out_tokens(resp)
    assert toks == [(11, -0.5), (7, -1.25)]
    assert tops[1] == [(7, -1.25), (9, -1.5)]


def test_compare_top_counts_value_and_id_mismatches():
    ref = [(1, -0.1), (2, -2.0), (3, -3.0)]
    assert LC.compare_top([(1, -0.12), (2, -2.03), (3, -2.98)], ref, 0.05) == 0
    assert LC.compare_top([(1, -0.3), (2, -2.0), (3, -3.0)], ref, 0.05) == 1       # value off
    assert LC.compare_top([(1, -0.1), (2, -2.0), (4, -3.01)], ref, 0.05) == 0      # edge near tie swap
    assert LC.compare_top([(1, -0.1), (2, -2.0), (4, -2.5)], ref, 0.05) == 1       # a real extra id


def test_start_servers_ports_logs_and_a_failed_start(tmp_path, monkeypatch):
    """start_servers (shared with bench/int4_logits_check.py): one server per spec on port + 20 i, its
    log named by prefix and name, procs filled as they start (so a failure still stops them all)."""
    import pytest

    started = []

    class FakeServer:
        def __init__(self, cmd, env, log_path):
            self.cmd, self.log = cmd, open(log_path, "ab")
            self.log.write(b"fatal: out of memory\n")
            self.log.flush()
            started.append(self)

    health = {"http://127.0.0.1:5000": None, "http://127.0.0.1:5020": "exited with code 1"}
    monkeypatch.setattr(LC.S, "PopenServer", FakeServer)
    monkeypatch.setattr(LC.S, "wait_healthy", lambda url, proc, limit: health[url])
    opts = {"model_path": "/m", "draft_model_path": "/d", "maxc": 4}
    specs = {"base": (LC.S.parse_arm("base"), opts), "ddtree": (LC.S.parse_arm("ddtree_b8"), opts)}
    procs, urls = {}, {}
    with pytest.raises(RuntimeError) as ei:
        LC.start_servers(procs, urls, specs, {}, str(tmp_path), "chk", 5000, lambda: 60)
    assert "ddtree server: exited with code 1" in str(ei.value) and "out of memory" in str(ei.value)
    assert list(procs) == ["base", "ddtree"] and urls["ddtree"] == "http://127.0.0.1:5020"
    assert [s.cmd[s.cmd.index("--port") + 1] for s in started] == ["5000", "5020"]
    assert [s.cmd[s.cmd.index("--nccl-port") + 1] for s in started] == ["5007", "5027"]
    assert (tmp_path / "chk_ddtree.log").exists() and "--speculative-num-draft-tokens" in started[1].cmd


def test_start_servers_sequential_waits_before_the_next_start(tmp_path, monkeypatch):
    """sequential=True: server k+1 is launched only after server k is healthy, and a failed start
    launches nothing after it (the int4logits stage: concurrent weight loads confuse SGLang's KV sizing)."""
    import pytest

    events = []

    class FakeServer:
        def __init__(self, cmd, env, log_path):
            self.cmd, self.log = cmd, open(log_path, "ab")
            events.append(("start", cmd[cmd.index("--port") + 1]))

    def healthy(url, proc, limit):
        events.append(("wait", url.rsplit(":", 1)[1]))
        return "exited with code 1" if url.endswith(":5020") else None

    monkeypatch.setattr(LC.S, "PopenServer", FakeServer)
    monkeypatch.setattr(LC.S, "wait_healthy", healthy)
    opts = {"model_path": "/m", "draft_model_path": "/d", "maxc": 4}
    specs = {n: (LC.S.parse_arm("base"), opts) for n in ("a", "b", "c")}
    procs, urls = {}, {}
    with pytest.raises(RuntimeError, match="b server: exited with code 1"):
        LC.start_servers(procs, urls, specs, {}, str(tmp_path), "seq", 5000, lambda: 60, sequential=True)
    assert events == [("start", "5000"), ("wait", "5000"), ("start", "5020"), ("wait", "5020")]
    assert list(procs) == ["a", "b"]
    events.clear()
    LC.start_servers({}, {}, {"a": specs["a"], "c": specs["c"]}, {}, str(tmp_path), "par", 5100, lambda: 60)
    assert events == [("start", "5100"), ("start", "5120"), ("wait", "5100"), ("wait", "5120")]
