"""The round profiler's garbage-collection counts (``profiling.GcPauses``): a collection between two
records is counted and timed in the next record, per generation."""
import gc
import json

from sglang_ddtree import profiling


def test_gc_pauses_are_counted_per_generation_and_reset():
    ticks = iter([1.0, 1.0125, 2.0, 2.5])   # a 12.5 ms gen-0 pause, then a 500 ms gen-2 pause
    p = profiling.GcPauses(clock=lambda: next(ticks))
    p.callback("start", {"generation": 0})
    p.callback("stop", {"generation": 0})
    p.callback("start", {"generation": 2})
    p.callback("stop", {"generation": 2})
    got = p.take()
    assert got["n"] == [1, 0, 1]
    assert abs(got["ms"][0] - 12.5) < 1e-6 and abs(got["ms"][2] - 500.0) < 1e-6
    assert abs(got["max_ms"] - 500.0) < 1e-6
    assert p.take() == {"n": [0, 0, 0], "ms": [0.0, 0.0, 0.0], "max_ms": 0.0}
    p.callback("stop", {"generation": 1})     # a stop without its start (installed mid-collection)
    assert p.take()["n"] == [0, 0, 0]


def test_installed_once_and_sees_real_collections():
    a = profiling.GcPauses.installed()
    assert profiling.GcPauses.installed() is a
    assert gc.callbacks.count(a.callback) == 1
    a.take()
    gc.collect()
    got = a.take()
    assert got["n"][2] >= 1 and got["ms"][2] >= 0.0


class _Ev:
    def record(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 1.0


def test_records_carry_the_collections_since_the_previous_record(tmp_path, monkeypatch):
    path = tmp_path / "prof.jsonl"
    monkeypatch.setenv(profiling.ENV_FILE, str(path))
    monkeypatch.setenv(profiling.ENV_EVERY, "2")
    prof = profiling.RoundProfiler(dict(algo="X"))
    monkeypatch.setattr(prof, "_event", lambda: _Ev())
    prof._gc.take()

    def round_():
        prof.begin()
        for _ in profiling.STAGES:
            prof.mark()
        prof.end(3, None)
    was = gc.isenabled()
    gc.disable()          # no automatic collection: only the explicit one below happens
    try:
        round_()
        gc.collect()
        round_()
        round_()
        round_()
    finally:
        if was:
            gc.enable()
    recs = [json.loads(line) for line in open(path)]
    assert len(recs) == 2
    assert recs[0]["gc"]["n"][2] >= 1
    assert recs[1]["gc"]["n"][2] == 0


def test_level_aggregate_sums_collections_and_counts_stalls():
    from sglang_ddtree.ab.stats import aggregate_profile
    base = dict(rounds=16, bs_mean=4.0, round_ms={"median": 10.0}, host_ms={"median": 3.0}, stage_ms={})
    recs = [dict(base, t_first=100.0, t_last=100.15, gc={"n": [5, 1, 0], "ms": [1.0, 0.5, 0.0], "max_ms": 0.4}),
            dict(base, t_first=100.16, t_last=100.31, gc={"n": [4, 0, 1], "ms": [0.8, 0.0, 130.0], "max_ms": 130.0}),
            dict(base, t_first=100.45, t_last=100.60),    # 140 ms after the previous record: a stall
            dict(base, t_first=100.61, t_last=100.75, gc={"n": [2, 0, 0], "ms": [0.2, 0.0, 0.0], "max_ms": 0.1})]
    out = aggregate_profile(recs)
    assert out["gc"]["n"] == [11, 1, 1]
    assert abs(out["gc"]["ms"][2] - 130.0) < 1e-9 and out["gc"]["max_ms"] == 130.0
    assert out["stalls"]["n"] == 1 and abs(out["stalls"]["s"] - 0.14) < 1e-6
    assert abs(out["stalls"]["span_s"] - 0.75) < 1e-6
    assert "gc" not in aggregate_profile([dict(base)]) and "stalls" not in aggregate_profile([dict(base)])


def test_the_ab_stall_threshold_is_the_profilers_idle_gap():
    from sglang_ddtree.ab.stats import STALL_S
    assert STALL_S == profiling.IDLE_GAP_S
