"""The worker's verify-mask buffer choice (``DDTreeWorker._mask_out_buffer``, ``_eager_verify``): a
round whose mask bound does not fit the target's CUDA-graph mask buffer runs its verify eagerly
instead of replaying a graph that cannot take the mask (CPU; the GPU test bed's ``maskcap`` stages
run it inside SGLang).

The choice is checked by what happens next, not by restating its rule: each round is played out
against a stand-in for SGLang 0.5.16's replay (the decode graph runner replays a batch of at most
``max_bs`` unless ``can_run_graph`` declines it, and then the triton backend copies
``spec_info.custom_mask`` into its captured ``cuda_graph_custom_mask``:
``layers/attention/triton_backend.py``, ``custom_mask[: spec_info.custom_mask.shape[0]] = ...``),
on real tensors, so an oversized mask raises as it would on the GPU."""
import types

import pytest
import torch

pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")

from sglang_ddtree import verify_backend as VB  # noqa: E402
from sglang_ddtree import worker as W  # noqa: E402


def _worker(max_bs, graph_numel):
    """A DDTreeWorker's attributes that _mask_out_buffer reads: a target whose decode graph runner
    replays batches up to ``max_bs`` (None: no graph runner) and whose triton backend captured a mask
    buffer of ``graph_numel`` elements (None: no such buffer)."""
    runner = None if max_bs is None else _Runner(max_bs)
    backend = types.SimpleNamespace(
        cuda_graph_custom_mask=None if graph_numel is None else torch.zeros(graph_numel, dtype=torch.uint8))
    mr = types.SimpleNamespace(decode_cuda_graph_runner=runner, attn_backend=backend)
    return types.SimpleNamespace(_target_worker=types.SimpleNamespace(model_runner=mr), _own_mask_buf=None,
                                 _eager_mask_rounds=0, device=torch.device("cpu"), algo_name="DDTREE-GPU",
                                 ps=types.SimpleNamespace(tp_rank=0))


def _play_round(w, bs, need, gen):
    """One round's verify with the buffer _mask_out_buffer hands out: the mask kernel writes ``need``
    elements into it, then the target forward either replays its graph (the backend first copies the
    mask into the captured buffer, as SGLang does) or runs eagerly on the mask where it lies.
    -> (replayed, mask written straight into the graph buffer, eager)."""
    mr = w._target_worker.model_runner
    runner, graph_buf = mr.decode_cuda_graph_runner, mr.attn_backend.cuda_graph_custom_mask
    buf, eager = W.DDTreeWorker._mask_out_buffer(w, bs, need)
    assert buf.numel() >= need, "the mask kernel writes need elements"
    mask = buf[:need]
    written = torch.randint(0, 2, (need,), generator=gen, dtype=torch.uint8)
    mask.copy_(written)
    in_place = graph_buf is not None and need > 0 and mask.data_ptr() == graph_buf.data_ptr()
    with VB._eager_verify(mr, eager):
        replayed = runner is not None and bs <= runner.max_bs and runner.can_run_graph(None)
        if replayed and graph_buf is not None:
            graph_buf[: mask.shape[0]] = mask     # raises when the mask is larger than the buffer
            read = graph_buf[:need]
        else:                                     # eager, or a backend without a captured mask buffer
            read = mask
    assert torch.equal(read.to(torch.uint8), written), "the attention reads the mask the kernel wrote"
    return replayed, in_place, eager


def test_mask_buffer_choice_by_its_consequences():
    """Every (batch, mask bound, graph max batch, graph buffer size) on a grid around the boundaries:
    the round never overflows the captured buffer, the attention always reads the mask written; a
    graph that can take the mask always replays, with the mask written straight into its buffer;
    a round goes eager only when the graph would replay but the mask does not fit, and the eager
    counter counts exactly those rounds."""
    gen = torch.Generator().manual_seed(0)
    cases = 0
    for max_bs in (None, 1, 4, 16):
        for graph_numel in (None, 0, 1, 50, 100):
            for bs in sorted({1, 3, 4, 5, 15, 16, 17}):
                for need in (0, 1, 49, 50, 51, 99, 100, 101, 250):
                    w = _worker(max_bs, graph_numel)
                    replayed, in_place, eager = _play_round(w, bs, need, gen)
                    graph_runs_this_batch = max_bs is not None and bs <= max_bs
                    fits = graph_numel is not None and need <= graph_numel
                    where = (max_bs, graph_numel, bs, need)
                    if graph_runs_this_batch and fits:
                        assert replayed and not eager, where
                        assert in_place or need == 0, where        # no copy into the graph buffer
                    if eager:
                        assert graph_runs_this_batch and not fits, where
                    assert w._eager_mask_rounds == int(eager), where
                    cases += 1
    assert cases == 4 * 5 * 7 * 9


def test_eager_rounds_counted_and_the_own_buffer_reused():
    """Across rounds on one worker: eager rounds add up, and the private buffer is allocated again
    only when a round needs more than it holds (it grows at least twofold)."""
    gen = torch.Generator().manual_seed(1)
    w = _worker(max_bs=8, graph_numel=100)
    seq = [(4, 150, True), (4, 120, True), (4, 100, False), (9, 200, False), (2, 101, True), (9, 250, False),
           (9, 10, False)]
    ptrs = []
    for i, (bs, need, want_eager) in enumerate(seq):
        replayed, in_place, eager = _play_round(w, bs, need, gen)
        assert eager == want_eager, (i, bs, need)
        assert replayed == (bs <= 8 and not eager), (i, bs, need)
        assert in_place == (i == 2), i
        if not in_place:
            ptrs.append(w._own_mask_buf.data_ptr())
    assert w._eager_mask_rounds == 3
    # 150: allocated; 120 fits; 200: regrown to 2 x 150 = 300, which 101, 250 and 10 then fit
    assert w._own_mask_buf.numel() == 300
    assert ptrs[0] == ptrs[1] != ptrs[2] and len(set(ptrs[2:])) == 1, ptrs


def test_plan_boundary_worked_by_hand():
    """Graph max batch 16, buffer 100: a bound of exactly 100 replays into it; 101 goes eager; at
    batch 17 the graph does not run, so no eager round is needed."""
    assert VB.plan_verify_mask_buffer(bs=16, need=100, graph_max_bs=16, graph_buf_numel=100) == "graph"
    assert VB.plan_verify_mask_buffer(bs=16, need=101, graph_max_bs=16, graph_buf_numel=100) == "eager"
    assert VB.plan_verify_mask_buffer(bs=17, need=101, graph_max_bs=16, graph_buf_numel=100) == "own"
    assert VB.plan_verify_mask_buffer(bs=1, need=1, graph_max_bs=None, graph_buf_numel=100) == "own"
    assert VB.plan_verify_mask_buffer(bs=1, need=1, graph_max_bs=16, graph_buf_numel=None) == "own"


class _Runner:
    def __init__(self, max_bs=16):
        self.max_bs = max_bs

    def can_run_graph(self, forward_batch):
        return True


def test_eager_verify_declines_the_graph_only_inside_and_restores():
    runner = _Runner()
    mr = types.SimpleNamespace(decode_cuda_graph_runner=runner)
    with VB._eager_verify(mr, eager=True):
        assert runner.can_run_graph(object()) is False
    assert runner.can_run_graph(object()) is True and "can_run_graph" not in vars(runner)
    with pytest.raises(RuntimeError):
        with VB._eager_verify(mr, eager=True):
            raise RuntimeError("verify failed")
    assert runner.can_run_graph(object()) is True              # restored after an exception too
    with VB._eager_verify(mr, eager=False):
        assert runner.can_run_graph(object()) is True
    with VB._eager_verify(types.SimpleNamespace(decode_cuda_graph_runner=None), eager=True):
        pass


def test_mask_capacity_test_switch(monkeypatch):
    import torch
    buf = torch.zeros(1000, dtype=torch.uint8)
    from sglang_ddtree import switches
    monkeypatch.setattr(switches, "CURRENT", switches.Switches())
    assert W._graph_mask_capacity(buf) == 1000
    monkeypatch.setattr(switches, "CURRENT", switches.Switches(graph_mask_cap=300))   # the test bed's maskcap300
    assert W._graph_mask_capacity(buf) == 300
    monkeypatch.setattr(switches, "CURRENT", switches.Switches(graph_mask_cap=5000))
    assert W._graph_mask_capacity(buf) == 1000
