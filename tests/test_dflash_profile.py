"""patches/dflash_round_profile.py: stock DFLASH decode rounds recorded with DDTree's stages.

A stand-in worker calls its drafter, the target's verify and the drafter context append in
DFlashWorkerV2's order; CUDA events are replaced by host-clock events (CPU), so each stage's time
is the sleep inside it. Checks: the JSON lines have every stage in order, a round missing a stage
is dropped, prefill / DDTree's own worker / no env are untouched."""
import json
import time
import types

import pytest
import torch

from sglang_ddtree import profiling
from sglang_ddtree.patches import dflash_round_profile as H


class FakeEvent:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def query(self):
        return True

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


SLEEP = {"draft": 0.004, "verify_prep": 0.002, "verify": 0.012, "accept": 0.003, "commit": 0.005}


class Mode:
    def __init__(self, extend=False):
        self._e = extend

    def is_extend(self):
        return self._e

    def is_idle(self):
        return False


class Target:
    def forward_batch_generation(self, batch=None, forward_batch=None, is_verify=False, **kw):
        time.sleep(SLEEP["verify"] if is_verify else 0.0)
        return "target-out"


class Drafter:
    def forward(self, fb):
        time.sleep(SLEEP["draft"])
        return "draft-out"


class StockDFlash:
    """DFlashWorkerV2's decode order (the real class's body is what the hook wraps)."""
    block_size = 16

    def __init__(self, skip_append=False):
        self._target_worker = Target()
        self.draft_model_runner = Drafter()
        self.skip_append = skip_append

    @property
    def target_worker(self):
        return self._target_worker

    def _append_target_hidden_to_draft_kv_by_loc(self, **kw):
        time.sleep(SLEEP["commit"])

    def forward_batch_generation(self, batch, on_publish=None):
        self.draft_model_runner.forward("fb")
        time.sleep(SLEEP["verify_prep"])
        self.target_worker.forward_batch_generation(batch=None, forward_batch="v", is_verify=True)
        time.sleep(SLEEP["accept"])
        if not self.skip_append:
            self._append_target_hidden_to_draft_kv_by_loc(target_hidden=None)
        return "result"


def _batch(bs=3, extend=False):
    return types.SimpleNamespace(forward_mode=Mode(extend), is_extend_in_batch=False,
                                 seq_lens=torch.zeros(bs))


@pytest.fixture
def prof_file(tmp_path, monkeypatch):
    p = tmp_path / "prof.jsonl"
    monkeypatch.setenv(profiling.ENV_FILE, str(p))
    monkeypatch.setenv(profiling.ENV_EVERY, "4")
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return p


def _call(worker, batch):
    return H.profiled_round(type(worker).forward_batch_generation, worker, batch)


def test_stages_in_order_with_their_times(prof_file):
    w = StockDFlash()
    for _ in range(8):
        assert _call(w, _batch(bs=3)) == "result"
    recs = [json.loads(x) for x in prof_file.read_text().splitlines()]
    assert len(recs) == 2 and all(r["rounds"] == 4 and r["algo"] == "DFLASH" for r in recs)
    st = recs[0]["stage_ms"]
    assert list(st) == list(profiling.STAGES)
    assert st["tree"]["median"] < 1.0
    for name, secs in SLEEP.items():
        assert secs * 1e3 * 0.9 <= st[name]["median"] <= secs * 1e3 + 15, (name, st[name])
    assert recs[0]["bs_mean"] == 3


def test_incomplete_rounds_prefill_and_self_profiling_workers_are_not_recorded(prof_file, monkeypatch):
    w = StockDFlash(skip_append=True)          # no accept mark: dropped
    for _ in range(8):
        _call(w, _batch())
    assert not prof_file.exists()
    w = StockDFlash()
    for _ in range(8):
        _call(w, _batch(extend=True))           # prefill: untouched, no wrappers installed
    assert not prof_file.exists() and H._STATE not in w.__dict__

    class DDTreeLike(StockDFlash):
        _profiles_its_rounds = True
    d = DDTreeLike()
    for _ in range(8):
        _call(d, _batch())
    assert not prof_file.exists() and H._STATE not in d.__dict__
    monkeypatch.delenv(profiling.ENV_FILE)
    w = StockDFlash()
    _call(w, _batch())
    assert H._STATE not in w.__dict__


def test_a_failing_round_is_dropped_and_the_next_one_counts(prof_file):
    w = StockDFlash()

    def boom(**kw):
        raise RuntimeError("verify failed")
    _call(w, _batch())                          # installs the wrappers
    real = w._target_worker.forward_batch_generation
    w._target_worker.forward_batch_generation = lambda *a, **k: boom(**k)
    with pytest.raises(RuntimeError):
        _call(w, _batch())
    w._target_worker.forward_batch_generation = real
    for _ in range(3):
        _call(w, _batch())
    recs = [json.loads(x) for x in prof_file.read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["rounds"] == 4


def test_an_idle_gap_closes_the_record_and_records_carry_wall_times(prof_file):
    """Rounds on either side of a pause longer than IDLE_GAP_S never share a record (a benchmark level's
    tail is not mixed into the next level), and each record says when its first and last round ended."""
    w = StockDFlash()
    t0 = time.time()
    for _ in range(6):                      # 4 -> one record at the 4th round, 2 left open
        _call(w, _batch(bs=2))
    t_mid = time.time()
    time.sleep(profiling.IDLE_GAP_S + 0.1)
    t1 = time.time()
    for _ in range(5):                      # the first of these closes the 2 (a record of 2 rounds)
        _call(w, _batch(bs=5))
    recs = [json.loads(x) for x in prof_file.read_text().splitlines()]
    assert [r["rounds"] for r in recs] == [4, 2, 4]
    assert [r["bs_mean"] for r in recs] == [2, 2, 5]
    assert all(r["t_first"] <= r["t_last"] for r in recs)
    assert t0 - 0.01 <= recs[0]["t_first"] and recs[1]["t_last"] <= t_mid + 0.01
    assert recs[2]["t_first"] >= t1 - 0.01


def test_ab_assigns_records_to_levels_by_wall_clock(tmp_path, monkeypatch):
    """sglang_ddtree.ab's level split: a record counts for the level whose window holds it; the
    flush request after the last level is sent; records without wall times change nothing."""
    from sglang_ddtree.ab import runner
    path = tmp_path / "p.jsonl"

    def rec(t0, t1, bs, rnd):
        return {"rounds": 4, "bs_mean": bs, "stage_ms": {"verify": {"median": 1.0}},
                "round_ms": {"median": rnd}, "host_ms": {"median": 0.5}, "t_first": t0, "t_last": t1}
    path.write_text("\n".join(json.dumps(r) for r in (rec(10.0, 11.0, 4, 5.0), rec(11.5, 11.9, 4, 6.0),
                                                       rec(20.2, 21.0, 64, 30.0), rec(30.0, 30.1, 1, 2.0))) + "\n")
    sent = []
    monkeypatch.setattr(runner.client, "run_level", lambda *a, **kw: sent.append(a[3]) or ([], 0.0, False))
    monkeypatch.setattr(runner, "IDLE_FLUSH_S", 0.0)
    levels = [{"concurrency": 4, "ms_per_step": 8.0, "_window": (9.9, 12.0)},
              {"concurrency": 64, "ms_per_step": 33.0, "_window": (20.0, 21.5)}]
    runner._profiles_by_window(levels, str(path), "http://x", [{"ids": [1]}], None)
    assert sent == [2]                                   # one short request closes the last record
    assert levels[0]["stage_profile"]["rounds"] == 8 and levels[0]["stage_profile"]["round_ms"] == 5.5
    assert levels[1]["stage_profile"]["bs_mean"] == 64 and levels[1]["stage_profile"]["outside_ms"] == 3.0
    old = [{"concurrency": 1, "stage_profile": {"rounds": 1}, "_window": (0.0, 1.0)}]
    path.write_text(json.dumps({"rounds": 3, "round_ms": {"median": 1.0}}) + "\n")
    runner._profiles_by_window(old, str(path), "http://x", [{"ids": [1]}], None)
    assert old[0]["stage_profile"] == {"rounds": 1}
