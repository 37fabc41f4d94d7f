"""The A/B's split of a regime controller's counters by level (``sglang_ddtree/ab/regime_log.py``), on
the CPU.  The log lines come from the worker's own code (``DDTreeWorker._regime_launch`` and
``_on_regime_switch`` with a real ``RegimeController`` on a fake clock) through SGLang's own log
format (``configure_logger``), so a change of either format breaks these tests; then the harness
(``serving_client._measure_arm``) against fake servers writing such lines, and its report."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import types

import pytest

from sglang_ddtree.ab import regime_log as RL

EPOCH = time.mktime((2026, 12, 6, 9, 23, 0, 0, 0, -1))    # a local-time whole second: the fake clock's 0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sglang_formatter(monkeypatch, prefix=" TP0", ms=False) -> logging.Formatter:
    """The format SGLang's processes log with (``configure_logger``; a scheduler's ``prefix`` names its
    ranks, `` TP0`` under TP), read from SGLang itself."""
    common = pytest.importorskip("sglang.srt.utils.common")
    got = {}
    monkeypatch.delenv("SGLANG_LOGGING_CONFIG_PATH", raising=False)
    if ms:
        monkeypatch.setenv("SGLANG_LOG_MS", "1")
    else:
        monkeypatch.delenv("SGLANG_LOG_MS", raising=False)
    with monkeypatch.context() as m:
        m.setattr(common.logging, "basicConfig", lambda **kw: got.update(kw))
        common.configure_logger(types.SimpleNamespace(log_level="info"), prefix=prefix)
    return logging.Formatter(got["format"], datefmt=got["datefmt"])


def _stamp(record, t):
    record.created = t
    record.msecs = (t - int(t)) * 1000.0
    return record


def _line(fmt, t, d, switch=None) -> str:
    """A report line as the worker writes it (its two format strings), stamped ``t`` (epoch s)."""
    msg, args = (("%s regime: %s", ("DDTREE-GPU", d)) if switch is None else
                 ("%s regime switch %d: now %s; %s", ("DDTREE-GPU", switch, d.get("regime"), d)))
    return fmt.format(_stamp(logging.makeLogRecord(dict(msg=msg, args=args, levelno=20)), t)) + "\n"


def _report(plain=0.0, spec=0.0, switching=0.0, switches=0, excursions=0, explore_s=0.0, regime="spec"):
    busy = plain + spec + switching
    return {"regime": regime, "time_s": {"plain": plain, "spec": spec, "switching": switching},
            "switches": switches, "excursions": excursions, "windows": 0, "explore_s": explore_s,
            "explore_share": explore_s / busy if busy else 0.0, "explore_loss_s": 0.0, "credit_s": 0.0}


# ------------------------------------------------------------------------------------------ a server's lines
class FakeServer:
    """A DDTREE-GPU server's regime path on the CPU: the worker's own ``_regime_launch`` /
    ``_on_regime_switch`` (its format strings and ``REGIME_LOG_EVERY_S``) with a real
    ``RegimeController``, all on the fake clock ``t`` (s after ``EPOCH``); the scheduler's transition
    hook right after a switch is asked for; the lines through SGLang's format into ``path``.  Decode
    launches every 0.1 s; speculation emits 3 tokens a request a launch, plain decoding 1 (the
    controller trips to plain once, then goes back)."""

    def __init__(self, W, path, fmt, monkeypatch):
        from sglang_ddtree import regime_state
        from sglang_ddtree.policy import RoundPolicy
        from sglang_ddtree.policy.regime import LaunchTracker, RegimeController

        self.W, self.rs, self.path, self.t, self.rid = W, regime_state, path, 0.0, 0
        monkeypatch.setattr(W, "time", types.SimpleNamespace(monotonic=lambda: self.t))
        self.ctl = RegimeController(clock=lambda: self.t)
        w = self.w = W.DDTreeWorker.__new__(W.DDTreeWorker)
        w.algo_name = "DDTREE-GPU"
        w.ps = types.SimpleNamespace(tp_rank=0)
        w._policy = RoundPolicy(17)
        w._policy.start_regime(self.ctl)
        w._launches = LaunchTracker()
        regime_state.enable(regime_state.SPEC, on_switch=w._on_regime_switch)
        self.handler = logging.FileHandler(path)
        self.handler.setFormatter(fmt)
        self.handler.addFilter(lambda rec: bool(_stamp(rec, self.now())))
        self._level = W.logger.level
        W.logger.addHandler(self.handler)
        W.logger.setLevel(logging.INFO)
        self.sends = 0

    def close(self):
        self.W.logger.removeHandler(self.handler)
        self.W.logger.setLevel(self._level)
        self.handler.close()
        self.rs.disable()

    def now(self) -> float:
        return EPOCH + self.t

    def sleep(self, s: float) -> None:
        self.t += max(0.0, s)

    def _reqs(self, c):
        self.rid += c
        return [types.SimpleNamespace(rid=f"r{self.rid - i}", output_ids=[0],
                                      sampling_params=types.SimpleNamespace(custom_params=None)) for i in range(c)]

    def _launch(self, reqs):
        for r in reqs:
            r.output_ids += [0] * (3 if self.rs.STATE.regime == self.rs.SPEC else 1)
        self.w._regime_launch(types.SimpleNamespace(reqs=reqs), no_spec=False)
        if self.rs.STATE.pending is not None:       # the transition hook: drain, convert, switch
            self.t += 0.05
            self.rs.switched()

    def level(self, c, seconds):
        """One level: the client starts, a prefill, decode launches every 0.1 s for ``seconds``, the
        last response.  -> (window (epoch s), busy s: first to last launch)."""
        start = self.now()
        self.t += 0.2
        reqs, first = self._reqs(c), self.t
        while self.t - first < seconds - 1e-9:
            self._launch(reqs)
            self.t += 0.1
        self._launch(reqs)
        busy = self.t - first
        self.t += 0.1
        return (start, self.now()), busy

    def flush(self):
        """The harness's short request: a prefill, one decode launch."""
        self.sends += 1
        self.t += 0.05
        self._launch(self._reqs(1))
        self.t += 0.02


@pytest.fixture
def server(tmp_path, monkeypatch):
    W = pytest.importorskip("sglang_ddtree.worker")      # SGLang's scheduler modules, on the CPU
    srv = FakeServer(W, str(tmp_path / "server.log"), _sglang_formatter(monkeypatch), monkeypatch)
    yield srv
    srv.close()


def _busy(r):
    return sum(r["time_s"].values())


def test_the_harness_interval_is_the_workers(server):
    assert RL.LOG_EVERY_S == server.W.REGIME_LOG_EVERY_S == 5.0


def test_worker_lines_parse_and_split_by_level(server):
    """Two levels, each closed by the harness's wait and flush request: every line the worker wrote
    parses (periodic and switch lines), the last is the controller's report, and each level's
    deltas are its own busy time and switches; control: the last line before a level's END loses
    the level's last seconds."""
    log = RL.RegimeLog(server.path)
    warm, _ = server.level(4, 8.0)            # the warm-up pass: the first line comes 5 s after the first launch
    assert RL.await_line(log, warm[1], server.flush, now=server.now, sleep=server.sleep)   # as the harness
    snaps, sends = [server.ctl.report()], server.sends
    win_a, busy_a = server.level(4, 30.0)
    t_end = server.t
    assert RL.await_line(log, win_a[1], server.flush, now=server.now, sleep=server.sleep)
    assert server.sends == sends + 1 and server.t - t_end <= RL.LOG_EVERY_S + 2.0   # one request did it
    snaps.append(server.ctl.report())
    win_b, busy_b = server.level(8, 20.0)
    assert RL.await_line(log, win_b[1], server.flush, now=server.now, sleep=server.sleep)
    snaps.append(server.ctl.report())
    reps = log.reports()
    with open(server.path) as f:
        assert len(reps) == len(f.readlines()) >= 10      # every line the worker wrote
    assert {r.switch for r in reps} >= {None, 1, 2}       # periodic and switch lines
    assert reps[-1].d["time_s"] == pytest.approx(server.ctl.report()["time_s"])
    assert reps[-1].d["switches"] == server.ctl.switches and reps[-1].d["regime"] == server.ctl.regime
    assert all(b.t >= a.t for a, b in zip(reps, reps[1:]))

    # the controller's counters after each flush (its launch: its decision, then its line, then a switch
    # it asks for is made: that switch's time goes to the next level)
    for win, busy, before, after in ((win_a, busy_a, snaps[0], snaps[1]), (win_b, busy_b, snaps[1], snaps[2])):
        r = RL.level_regime(reps, win)
        assert r["lines"] == 2 and "partial" not in r
        assert _busy(r) == pytest.approx(busy, abs=1e-6)          # every interval of the level, nothing else
        for k in ("plain", "spec"):
            assert r["time_s"][k] == pytest.approx(after["time_s"][k] - before["time_s"][k], abs=2e-3)
        assert r["switches"] == after["switches"] - before["switches"]
        run = r["time_s"]["plain"] + r["time_s"]["spec"]
        assert r["spec_share"] == pytest.approx(r["time_s"]["spec"] / run, abs=1e-3)
        assert r["explore_s"] == 0.0 and r["explore_share"] == 0.0 and r["excursions"] == 0
    ra, rb = RL.level_regime(reps, win_a), RL.level_regime(reps, win_b)
    # level A: speculation throughout (the warm-up's trip to measure plain decoding at bs 4 ended at its
    # flush, whose bs-1 batch only passes: no trip there); level B, a new state (bs 8): speculation for
    # its first measured window, the one-window trip (4 s of plain decoding), then speculation again
    assert ra["switches"] == 0 and ra["spec_share"] == 1.0
    assert rb["switches"] == 2 and rb["trips"] == 1 and rb["time_s"]["plain"] == pytest.approx(4.0, abs=1e-3)
    assert rb["trip_s"] == pytest.approx(4.0, abs=1e-3) and ra["trip_s"] == 0.0   # the trip: all its plain time
    assert ra["trips"] == 0 and RL.summary(rb) == "spec 80 %, 2 switches (1 trip, 20.0 % of busy time), explore 0.0 %"
    assert rb["spec_share"] == pytest.approx(15.9 / 19.9, abs=1e-3)
    assert rb["time_s"]["switching"] == pytest.approx(0.1, abs=1e-6)

    # control: the last line at or before the end instead of the first after it
    last_before = max((r for r in reps if r.t <= win_a[1]), key=lambda r: r.t)
    first_line = next(r for r in reversed(reps) if r.t <= win_a[0])
    wrong = sum(last_before.d["time_s"].values()) - sum(first_line.d["time_s"].values())
    assert busy_a - wrong > 1.0 and _busy(ra) == pytest.approx(busy_a, abs=1e-6)


def test_a_level_without_a_line_after_it_is_partial(server):
    """The server logs nothing while idle: without the flush request no line comes after the end;
    the wait stops ``every`` + 2 s after it and the level keeps what there is, marked partial (and
    short of its busy time).  A near deadline stops the wait at once."""
    log = RL.RegimeLog(server.path)
    server.t += 1.0
    win, busy = server.level(4, 12.0)
    t_end = server.t
    assert not RL.await_line(log, win[1], lambda: None, now=server.now, sleep=server.sleep)
    assert server.t - t_end == pytest.approx(RL.LOG_EVERY_S + 2.0, abs=1e-3)
    r = RL.level_regime(log.reports(), win)
    assert r["partial"] and r["lines"] == 1 and 0.0 < _busy(r) < busy - 1.0
    t_end = server.t
    win2 = (win[0], server.now())
    assert not RL.await_line(log, win2[1], server.flush, deadline_at=server.now() + 3.0, now=server.now,
                             sleep=server.sleep)
    assert server.t == t_end and server.sends == 0


def test_no_line_before_the_start_counts_from_the_servers_start(monkeypatch, tmp_path):
    """Counters are cumulative from the server's start: before the first line they are zeros; the
    start line is the last one stamped at or before the start (whole seconds), the end line the
    first stamped at or after the end."""
    fmt = _sglang_formatter(monkeypatch)
    p = tmp_path / "s.log"
    p.write_text(_line(fmt, EPOCH + 10, _report(plain=1.0, spec=3.0, switches=1))
                 + _line(fmt, EPOCH + 15, _report(plain=2.0, spec=6.0, switching=0.5, switches=3, excursions=1,
                                                  explore_s=1.0), switch=3)
                 + _line(fmt, EPOCH + 20, _report(plain=2.0, spec=10.0, switching=0.5, switches=3, excursions=1,
                                                  explore_s=1.0)))
    reps = RL.RegimeLog(str(p)).reports()
    assert [r.switch for r in reps] == [None, 3, None]
    r = RL.level_regime(reps, (EPOCH + 2.0, EPOCH + 14.5))
    assert r["lines"] == 1 and r["time_s"] == {"plain": 2.0, "spec": 6.0, "switching": 0.5}
    assert r["spec_share"] == pytest.approx(0.75) and r["switches"] == 3 and r["excursions"] == 1
    assert r["explore_s"] == pytest.approx(1.0) and r["explore_share"] == pytest.approx(1.0 / 8.5, abs=1e-3)
    r = RL.level_regime(reps, (EPOCH + 10.4, EPOCH + 15.0))    # a stamp is a whole second: 10 is <= 10.4
    assert r["lines"] == 2 and r["time_s"]["spec"] == pytest.approx(3.0) and r["switches"] == 2
    r = RL.level_regime(reps, (EPOCH + 15.0, EPOCH + 15.2))    # 15 may be before 15.2: the next line
    assert r["time_s"]["spec"] == pytest.approx(4.0) and r["switches"] == 0 and r["explore_share"] == 0.0
    r = RL.level_regime(reps, (EPOCH + 21.0, EPOCH + 30.0))    # nothing in or after it
    assert r == dict(time_s={"plain": 0.0, "spec": 0.0, "switching": 0.0}, spec_share=None, switches=0,
                     trips=0, trip_s=0.0, trip_share=None, excursions=0, explore_s=0.0, explore_share=None,
                     lines=1, partial=True)
    assert RL.summary(RL.level_regime(reps, (EPOCH + 2.0, EPOCH + 14.5))) == "spec 75 %, 3 switches, explore 11.8 %"


@pytest.mark.parametrize("prefix,ms", [("", False), (" TP0", False), (" DP1 TP0", True)])
def test_sglang_prefixes_and_millisecond_stamps(monkeypatch, tmp_path, prefix, ms):
    """Without TP no rank in the prefix, ``SGLANG_LOG_MS`` adds milliseconds: both parse, as local time."""
    fmt = _sglang_formatter(monkeypatch, prefix=prefix, ms=ms)
    line = _line(fmt, EPOCH + 7.25, _report(spec=1.0))
    assert line.startswith("[2026-12-06 09:23:07" + (".250" if ms else "") + prefix + "] DDTREE-GPU regime: {'regime'")
    r = RL.parse_line(line)
    assert r.t == pytest.approx(EPOCH + (7.25 if ms else 7.0)) and r.d == _report(spec=1.0) and r.switch is None


def test_stamps_are_read_as_local_time(monkeypatch):
    """SGLang stamps in the host's local time; the harness's ``time.time()`` windows are epoch s: a
    zone off UTC by 5 h 30 (POSIX TZ, no tz database needed) reads back to the same epoch second."""
    fmt = _sglang_formatter(monkeypatch)
    old = os.environ.get("TZ")
    os.environ["TZ"] = "XST-5:30"
    time.tzset()
    try:
        t = 1796000000.0
        line = _line(fmt, t, _report(spec=2.0))
        assert line.startswith(time.strftime("[%Y-%m-%d %H:%M:%S", time.gmtime(t + 5.5 * 3600)))
        assert RL.parse_line(line).t == pytest.approx(t, abs=1e-6)
    finally:
        if old is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old
        time.tzset()


def test_cycle_and_malformed_lines(monkeypatch, tmp_path):
    """A ``CycleRegime`` report (switches only) counts its switches; a line whose dict does not parse,
    a non-dict, the start-up line and other lines are left out; a line still being written waits."""
    from sglang_ddtree.policy.regime import CycleRegime
    fmt = _sglang_formatter(monkeypatch)
    cyc = CycleRegime(3)
    p = tmp_path / "s.log"
    good = _line(fmt, EPOCH + 1, cyc.report())
    bad = _line(fmt, EPOCH + 2, {"regime": "spec"}).replace("'spec'}", "'spec'")
    s = _line(fmt, EPOCH + 3, {"a": 1}).replace("{'a': 1}", "{'a': float('nan')}")
    p.write_text("[2026-12-06 09:23:00 TP0] DDTREE-GPU regime: starts spec (plain batches on SGLang's decode path)\n"
                 "[2026-12-06 09:23:00 TP0] Decode batch, #running-req: 4, #token: 100\n"
                 + good + bad + s + _line(fmt, EPOCH + 4, {"a": 1}).replace("{'a': 1}", "{1, 2}"))
    log = RL.RegimeLog(str(p))
    assert [r.d for r in log.reports()] == [cyc.report()]
    cyc.observe(None), cyc.observe(None), cyc.observe(None)
    cyc.switched()
    with open(p, "a") as f:
        f.write(_line(fmt, EPOCH + 9, cyc.report(), switch=1).rstrip("\n"))
    assert len(log.reports()) == 1
    with open(p, "a") as f:
        f.write("\n")
    reps = log.reports()
    assert len(reps) == 2 and reps[-1].switch == 1
    r = RL.level_regime(reps, (EPOCH + 1.5, EPOCH + 8.0))
    assert r["switches"] == 1 and r["spec_share"] is None and r["explore_share"] is None
    assert RL.level_regime([], (EPOCH, EPOCH + 1)) is None
    assert RL.RegimeLog(str(tmp_path / "missing.log")).reports() == []


# ------------------------------------------------------------------------------------------ the harness
def _args(tmp_path, *extra):
    from sglang_ddtree.ab import cli
    model = tmp_path / "text_target"
    shutil.copytree(os.path.join(REPO, "bench", "textpair", "tokenizer"), model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"text": t}) for t in ("def f(x):\n    return x\n", "class A:\n    pass\n",
                                                                   "The quick brown fox.")))
    return cli.build_parser().parse_args(
        ["--client", "bench_serving", "--model-path", str(model), "--draft-model-path", "/d", "--identity-prompts", "2",
         "--warmup", "0", "--min-level-seconds", "20", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r"),
         "--no-env-probe", "--prompts", str(prompts), *extra])


def test_measure_arm_adds_the_regime_of_arms_that_log_it(tmp_path, monkeypatch):
    """Through ``serving_client.run``: the regime arm's server writes report lines while it serves
    (every 5 s of a pass, and at the harness's flush request after a level); its levels get
    ``regime`` and its record ``regime_final``, the report a regime table of that arm only; the base
    arm's server writes none: nothing added, and the report without the regime section is exactly
    the report of the same run without regime fields."""
    from sglang_ddtree.ab import serving_client as S
    fmt = _sglang_formatter(monkeypatch)
    clock = {"t": EPOCH + 100.0, "log": None, "spec": 0.0, "plain": 0.0, "switches": 0, "share": 0.0}
    monkeypatch.setattr(S.time, "time", lambda: clock["t"])
    monkeypatch.setattr(S.time, "sleep", lambda s: clock.update(t=clock["t"] + max(0.0, s)))

    def served(seconds):      # the server decodes for ``seconds``: a line every 5 s (the regime arm only)
        t_next, t_end = clock["t"] + RL.LOG_EVERY_S, clock["t"] + seconds
        while True:
            clock["t"] = min(t_next, t_end)
            if t_next <= t_end and clock["log"]:   # closed windows only: a pass's last 2 s not yet
                clock["spec"] += clock["share"] * 5.0
                clock["plain"] += (1 - clock["share"]) * 5.0
            if clock["log"] and t_next <= t_end:
                with open(clock["log"], "a") as f:
                    f.write(_line(fmt, clock["t"], _report(plain=clock["plain"], spec=clock["spec"],
                                                           switches=clock["switches"])))
            if t_next > t_end:
                return
            t_next += RL.LOG_EVERY_S

    class Client:
        def __init__(self, args, env, cwd, log_path):
            self.k = 0

        def run(self, cmd, timeout):
            c = int(cmd[cmd.index("--max-concurrency") + 1])
            n = int(cmd[cmd.index("--num-prompts") + 1])
            clock["switches"] += bool(clock["log"])
            clock["share"] = 0.25 if c == 1 else 0.75
            served(22.0)
            self.k += 1
            return dict(ok=True, rc=0, seconds=22.0, result=dict(output_throughput=100.0 * n / 22.0 * c, completed=n,
                                                                  duration=22.0, median_ttft_ms=1.0, median_itl_ms=1.0))

        def close(self):
            pass

        def info(self):
            return dict(mode="fake", passes=self.k)

    flushes = []

    def run_level(url, prompts, c, m, *a, **k):   # the flush request and the identity requests
        flushes.append((len(prompts), m))
        clock["t"] += 0.1
        if clock["log"]:
            with open(clock["log"], "a") as f:
                f.write(_line(fmt, clock["t"], _report(plain=clock["plain"], spec=clock["spec"],
                                                       switches=clock["switches"])))
        return [dict(ok=True, output_ids=[1, 2, 3]) for _ in prompts], 0.1, False

    class Srv:
        def poll(self):
            return None

        def stop(self):
            pass

    def launcher(cmd, env, log_path):
        open(log_path, "w").close()
        clock["log"] = log_path if "regime" in (env.get("DDTREE_SWITCHES") or "") else None
        return Srv()

    monkeypatch.setattr(S, "make_client", Client)
    monkeypatch.setattr(S.client, "run_level", run_level)
    monkeypatch.setattr(S, "wait_healthy", lambda *a, **k: None)
    doc = S.run(_args(tmp_path, "--arms", "base,ddtree_regimeauto", "--concurrency", "1,4", "--repeats", "1",
                      "--warmup", "1"), launcher=launcher)
    base, auto = doc["arms"]
    assert all("regime" not in lv for lv in base["levels"]) and "regime_final" not in base
    assert flushes.count((1, 2)) == 3          # after the regime arm's warm-up pass and each of its levels
    r1, r4 = (lv["regime"] for lv in auto["levels"])
    # a pass (the levels are sized by base: one pass each here) = 22 s, 20 s of it in lines 5 s apart, a
    # flush line after it: each level from the line after the pass before it (the warm-up's for c=1)
    for r, share in ((r1, 0.25), (r4, 0.75)):
        assert r["lines"] == 2 and "partial" not in r and r["switches"] == 1
        assert _busy(r) == pytest.approx(20.0, abs=1e-6) and r["spec_share"] == pytest.approx(share, abs=1e-6)
    assert auto["regime_final"]["switches"] == clock["switches"] == 3
    md = open(str(tmp_path / "r") + ".md").read()
    sec = md[md.index("## Regime"):md.index("## Identity")]
    assert "| ddtree_regimeauto | spec 25 %, 1 switches, explore 0.0 % | spec 75 %, 1 switches, explore 0.0 % |" in sec
    assert "| base |" not in sec and "`ddtree_regimeauto` whole server (its last report): plain" in sec
    for a in doc["arms"]:           # the same run without regime fields renders as before, byte for byte
        a.pop("regime_final", None)
        for lv in a["levels"]:
            lv.pop("regime", None)
    assert S.render_markdown(doc) == md.replace(sec, "")
