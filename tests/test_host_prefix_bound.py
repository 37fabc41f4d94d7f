"""The round's host bound of each request's committed prefix (``DDTreeWorker._host_prefix_bound``) and
the FutureMap DDTree asks SGLang for.  The bound must be a true upper bound of the prefix the round
starts from (a backend plans its work from it) without reading anything from the GPU: SGLang's host
mirror of the published lengths (``FutureMap`` with ``needs_cpu_seq_lens``) makes the scheduler wait
for the round in flight, so DDTree asks for a FutureMap without it and bounds the prefix from the
requests' committed lengths, which the host knows one round late, plus the most one round commits."""
import types

import pytest
import torch

pytest.importorskip("sglang.srt.managers.overlap_utils")

from sglang_ddtree import worker as W  # noqa: E402
from sglang_ddtree.spec_algo import DDTreeGPUSpecAlgo  # noqa: E402

B = 16


def _worker():
    w = W.DDTreeWorker.__new__(W.DDTreeWorker)
    w.block_size = B
    w._draft_seq_lens_cpu_buf = torch.full((64,), -7, dtype=torch.int32)   # poisoned
    return w


class Dev:
    """A device tensor stand-in: any read from the host fails the test."""
    shape = (4,)

    def to(self, *a, **k):
        raise AssertionError("the bound read the device")

    cpu = to


def test_bound_from_committed_lengths_without_a_device_read():
    """Overlap scheduling: round i + 1 launches before round i's result is processed, so the host's
    committed length misses at most one round's commit (<= B tokens: D accepted + the bonus).  Simulated
    rounds with random commits: the bound always covers the true prefix and exceeds it by <= B."""
    gen = torch.Generator().manual_seed(0)
    w = _worker()
    true = torch.randint(1, 500, (4,), generator=gen)
    host = true.clone()                     # what the host knows (lags one round)
    for _ in range(200):
        reqs = [types.SimpleNamespace(kv_committed_len=int(x)) for x in host]
        batch = types.SimpleNamespace(seq_lens_cpu=None, reqs=reqs, seq_lens=Dev())
        di = types.SimpleNamespace(reserved_seq_lens_cpu=host.to(torch.int32) + 2 * 61)
        bound, total = w._host_prefix_bound(batch, di, 4)
        assert torch.all(bound >= true) and torch.all(bound - true <= B), (bound, true)
        assert total == int(bound.sum())
        commit = torch.randint(1, B + 1, (4,), generator=gen)   # this round's commit, unknown to the host
        host = true.clone()                                    # the previous round becomes known
        true = true + commit


def test_reservation_caps_and_fallbacks():
    w = _worker()
    reqs = [types.SimpleNamespace(kv_committed_len=x) for x in (10, 20)]
    di = types.SimpleNamespace(reserved_seq_lens_cpu=torch.tensor([100, 30], dtype=torch.int32))
    bound, _ = w._host_prefix_bound(types.SimpleNamespace(seq_lens_cpu=None, reqs=reqs, seq_lens=Dev()), di, 2)
    assert bound.tolist() == [26, 30]                       # committed + B, capped by the reservation
    mirror = types.SimpleNamespace(seq_lens_cpu=torch.tensor([5, 6]), reqs=reqs, seq_lens=Dev())
    assert w._host_prefix_bound(mirror, di, 2)[0].tolist() == [21, 22]      # the mirror + B, as before
    no_reqs = types.SimpleNamespace(seq_lens_cpu=None, reqs=None, seq_lens=Dev())
    assert w._host_prefix_bound(no_reqs, di, 2)[0].tolist() == [100, 30]   # the reservation alone


def test_ddtree_future_map_has_no_host_mirror(monkeypatch):
    """Whatever SGLang decides from the backends (flashinfer asks for the mirror), DDTree's FutureMap
    is built without it."""
    import sglang.srt.managers.overlap_utils as OU
    got = {}

    class FM:
        def __init__(self, device, algo, pool, needs_cpu_seq_lens, needs_confidence_relay):
            got.update(needs=needs_cpu_seq_lens, relay=needs_confidence_relay)

    monkeypatch.setattr(OU, "FutureMap", FM)
    DDTreeGPUSpecAlgo.create_future_map(DDTreeGPUSpecAlgo.__new__(DDTreeGPUSpecAlgo), "cpu", None,
                                        needs_cpu_seq_lens=True, needs_confidence_relay=False)
    assert got == dict(needs=False, relay=False)
