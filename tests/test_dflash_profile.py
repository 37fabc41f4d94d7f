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
