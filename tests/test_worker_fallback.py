"""The worker's verify-mask buffer choice (``worker.plan_verify_mask_buffer``, ``_eager_verify``):
a round whose mask bound does not fit the target's CUDA-graph mask buffer runs its verify eagerly
instead of replaying a graph that cannot take the mask (CPU; the GPU test bed's ``maskcap`` stages
run it inside SGLang)."""
import random
import types

import pytest

pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")

from sglang_ddtree import worker as W  # noqa: E402


def test_plan_against_a_brute_force_rule():
    rng = random.Random()
    for _ in range(2000):
        bs = rng.randint(1, 300)
        need = rng.randint(0, 10 ** 7)
        max_bs = rng.choice([None, rng.randint(1, 256)])
        numel = rng.choice([None, rng.randint(0, 10 ** 7)])
        got = W.plan_verify_mask_buffer(bs=bs, need=need, graph_max_bs=max_bs, graph_buf_numel=numel)
        if max_bs is None or numel is None or bs > max_bs:
            assert got == "own"
        elif need <= numel:
            assert got == "graph"
        else:
            assert got == "eager"
    # the boundary, exactly
    assert W.plan_verify_mask_buffer(bs=16, need=100, graph_max_bs=16, graph_buf_numel=100) == "graph"
    assert W.plan_verify_mask_buffer(bs=16, need=101, graph_max_bs=16, graph_buf_numel=100) == "eager"
    assert W.plan_verify_mask_buffer(bs=17, need=101, graph_max_bs=16, graph_buf_numel=100) == "own"


class _Runner:
    def can_run_graph(self, forward_batch):
        return True


def test_eager_verify_declines_the_graph_only_inside_and_restores():
    runner = _Runner()
    mr = types.SimpleNamespace(decode_cuda_graph_runner=runner)
    with W._eager_verify(mr, eager=True):
        assert runner.can_run_graph(object()) is False
    assert runner.can_run_graph(object()) is True and "can_run_graph" not in vars(runner)
    with pytest.raises(RuntimeError):
        with W._eager_verify(mr, eager=True):
            raise RuntimeError("verify failed")
    assert runner.can_run_graph(object()) is True              # restored after an exception too
    with W._eager_verify(mr, eager=False):
        assert runner.can_run_graph(object()) is True
    with W._eager_verify(types.SimpleNamespace(decode_cuda_graph_runner=None), eager=True):
        pass


def test_mask_capacity_test_switch(monkeypatch):
    import torch
    buf = torch.zeros(1000, dtype=torch.uint8)
    monkeypatch.delenv(W._GRAPH_MASK_CAP_ENV, raising=False)
    assert W._graph_mask_capacity(buf) == 1000
    monkeypatch.setenv(W._GRAPH_MASK_CAP_ENV, "300")
    assert W._graph_mask_capacity(buf) == 300
    monkeypatch.setenv(W._GRAPH_MASK_CAP_ENV, "5000")
    assert W._graph_mask_capacity(buf) == 1000
