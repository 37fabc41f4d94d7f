"""No-speculation rounds on SGLang's decode path (sglang_ddtree/plain_decode.py, issue 39 item 2):
the deferred drafter K/V (DraftCatchUp) against a brute-force replay of slot ownership, the backend
plain decoding would use, and the runner / batch views restored on every exit."""
import contextlib
import types

import pytest
import torch

from sglang_ddtree import plain_decode as P


class Drafter:
    """A drafter K/V store: each slot holds (request, position) of its last write."""

    def __init__(self, slots):
        self.kv = [None] * slots
        self.calls = []

    def append(self, *, target_hidden, cache_loc, positions):
        assert target_hidden.shape[0] == cache_loc.numel() == positions.numel()
        self.calls.append(cache_loc.numel())
        for h, loc, pos in zip(target_hidden.tolist(), cache_loc.tolist(), positions.tolist()):
            self.kv[loc] = (int(h[0]), int(pos))       # hidden row 0 carries the request id


def test_catch_up_flush_rules_and_capacity():
    d = Drafter(64)
    cu = P.DraftCatchUp(d.append, capacity=6)
    key = ("a", "b")
    h = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    assert not cu.must_flush(key, speculative=True)                   # nothing pending
    cu.stash(h, torch.tensor([3, 9]), torch.tensor([5, 7]), key)
    assert cu.rows == 2 and d.calls == []                              # deferred
    assert not cu.must_flush(key, speculative=False, incoming=2)
    assert cu.must_flush(key, speculative=True)                        # a draft reads the context
    assert cu.must_flush(("a", "c"), speculative=False)                # the requests changed
    cu.stash(h, torch.tensor([4, 10]), torch.tensor([6, 8]), key)
    cu.stash(h, torch.tensor([5, 11]), torch.tensor([7, 9]), key)
    assert cu.must_flush(key, speculative=False, incoming=2)           # 6 + 2 > 6
    with pytest.raises(RuntimeError, match="exceed the capacity"):
        cu.stash(h, torch.tensor([6, 12]), torch.tensor([8, 10]), key)
    with pytest.raises(RuntimeError, match="another batch"):
        cu.stash(h, torch.tensor([6, 12]), torch.tensor([8, 10]), ("x",))
    assert cu.flush() == 6 and d.calls == [6] and cu.rows == 0 and cu.key is None
    assert [d.kv[i] for i in (3, 4, 5, 9, 10, 11)] == [(0, 5), (0, 6), (0, 7), (1, 7), (1, 8), (1, 9)]
    assert cu.flush() == 0 and d.calls == [6]                           # nothing: no call
    with pytest.raises(ValueError):
        P.DraftCatchUp(d.append, capacity=0)


def test_catch_up_buffer_is_bounded_in_bytes_but_holds_a_batch():
    d = Drafter(64)
    cu = P.DraftCatchUp(d.append, capacity=1000, max_bytes=10 * 4 * 2)   # 10 rows of 2 fp32
    h = torch.ones(3, 2)
    cu.stash(h, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), ("k",))
    assert cu.capacity == 10 and cu._hidden.shape == (10, 2)
    assert cu.must_flush(("k",), speculative=False, incoming=8)          # 3 + 8 > 10
    big = P.DraftCatchUp(d.append, capacity=1000, max_bytes=8)             # less than one row
    big.stash(torch.ones(4, 2), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3]), ("k",))
    assert big.capacity == 4 and big.rows == 4                            # still one batch


def test_catch_up_copies_the_callers_rows():
    """The decode graph's hidden output is a view the next replay overwrites: stash copies it."""
    d = Drafter(8)
    cu = P.DraftCatchUp(d.append, capacity=4)
    h, loc, pos = torch.tensor([[7.0]]), torch.tensor([2]), torch.tensor([1])
    cu.stash(h, loc, pos, ("r",))
    h.fill_(9.0), loc.fill_(5), pos.fill_(4)
    cu.flush()
    assert d.kv[2] == (7, 1) and d.kv[5] is None


def test_slot_reuse_never_leaves_a_stale_row_on_top(rng):
    """A random schedule like SGLang's: requests join (prefill writes their prompt's drafter K/V),
    finish (their slots go back to a free list and are handed out again), and every round is either
    plain (rows deferred) or speculative (the worker flushes, then writes its own rows).  The worker's
    rules -- flush before a prefill and whenever the batch's requests differ from the pending rows'
    -- must leave every live request's drafter K/V at every committed position as its own."""
    slots = 600
    d = Drafter(slots)
    cu = P.DraftCatchUp(d.append, capacity=24)
    free = list(range(slots))[::-1]
    live = {}                    # rid -> [slots of positions 0..len-1]
    nxt = 0

    def prefill():
        nonlocal nxt
        if cu.rows:
            cu.flush()
        rid, n = nxt, int(torch.randint(1, 6, (), generator=rng))
        nxt += 1
        got = [free.pop() for _ in range(n)]          # LIFO: just-freed slots first (the worst case)
        live[rid] = got
        for p, s in enumerate(got):
            d.kv[s] = (rid, p)

    for _ in range(3):
        prefill()
    for _ in range(300):
        u = float(torch.rand((), generator=rng))
        if (u < 0.1 and len(live) < 8 and len(free) > 16) or not live:
            prefill()
            continue
        if (u < 0.2 or len(free) < 2 * len(live) + 8) and len(live) > 1:   # a request finishes
            rid = list(live)[int(torch.randint(0, len(live), (), generator=rng))]
            free.extend(live.pop(rid))
            continue
        rids = sorted(live)
        key = tuple(rids)
        plain = float(torch.rand((), generator=rng)) < 0.6
        if cu.must_flush(key, speculative=not plain, incoming=len(rids) if plain else 0):
            cu.flush()
        new = [free.pop() for _ in rids]
        for rid, s in zip(rids, new):
            live[rid].append(s)
        if plain:
            cu.stash(torch.tensor([[float(r)] for r in rids]), torch.tensor(new),
                     torch.tensor([len(live[r]) - 1 for r in rids]), key)
        else:                                                          # the drafter reads, then writes
            for rid in rids:
                assert [d.kv[s] for s in live[rid][:-1]] == [(rid, p) for p in range(len(live[rid]) - 1)]
            for rid, s in zip(rids, new):
                d.kv[s] = (rid, len(live[rid]) - 1)
    cu.flush()
    for rid, got in live.items():
        assert [d.kv[s] for s in got] == [(rid, p) for p in range(len(got))]
    assert len(d.calls) > 5


def test_catch_up_without_a_flush_before_prefill_goes_wrong():
    """The hazard the flush rules exist for: a row stashed for request 0 at slot 2, the slot freed and
    written by request 1's prefill with no flush first, then the flush puts the stale row on top."""
    d = Drafter(4)
    cu = P.DraftCatchUp(d.append, capacity=8)
    cu.stash(torch.tensor([[0.0]]), torch.tensor([2]), torch.tensor([5]), (0,))
    d.kv[2] = (1, 0)
    cu.flush()
    assert d.kv[2] == (0, 5)


def test_user_decode_backend():
    from sglang_ddtree.spec_algo import SPLIT_ATTR

    a = types.SimpleNamespace(attention_backend="triton", decode_attention_backend=None)
    assert P.user_decode_backend(a) == "triton"
    a = types.SimpleNamespace(attention_backend="fa3", decode_attention_backend="flashinfer")
    assert P.user_decode_backend(a) == "flashinfer"                    # the user's own split
    a = types.SimpleNamespace(attention_backend="flashinfer", decode_attention_backend="triton")
    setattr(a, SPLIT_ATTR, True)                                       # DDTree's split: decode=triton
    assert P.user_decode_backend(a) == "flashinfer"
    assert P.user_decode_backend(types.SimpleNamespace(attention_backend=None,
                                                       decode_attention_backend=None)) is None


class Args:
    def __init__(self):
        self.enable_return_hidden_states = False
        self.log = []

    def override(self, source, **kw):
        self.log.append(source)
        for k, v in kw.items():
            setattr(self, k, v)


def test_plain_runner_view_restores_on_error():
    pytest.importorskip("sglang.srt.speculative.spec_info")
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    mr = types.SimpleNamespace(spec_algorithm="DDTREE", server_args=Args())
    with pytest.raises(RuntimeError):
        with P.plain_runner_view(mr):
            assert mr.spec_algorithm is SpeculativeAlgorithm.NONE
            assert mr.server_args.enable_return_hidden_states is True
            raise RuntimeError("capture failed")
    assert mr.spec_algorithm == "DDTREE" and mr.server_args.enable_return_hidden_states is False


def test_plain_runner_view_captures_plain_decodings_batch_sizes():
    """Argument resolution trimmed the decode graph list for the tree widths (spec_algo.
    plain_floor_graphs) and kept the whole one: inside the view SGLang's runner reads the whole list,
    after it (also on error) the trimmed one again; without a kept list nothing changes."""
    pytest.importorskip("sglang.srt.speculative.spec_info")
    from sglang_ddtree.spec_algo import PLAIN_GRAPH_BS_ATTR

    args = Args()
    args.cuda_graph_config = types.SimpleNamespace(decode=types.SimpleNamespace(bs=[1, 2, 4, 64], max_bs=64))
    mr = types.SimpleNamespace(spec_algorithm="DDTREE", server_args=args)
    with P.plain_runner_view(mr):
        assert args.cuda_graph_config.decode.bs == [1, 2, 4, 64]
    object.__setattr__(args, PLAIN_GRAPH_BS_ATTR, [1, 2, 4, 64, 128, 256])
    for fail in (False, True):
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
            with P.plain_runner_view(mr):
                dec = args.cuda_graph_config.decode
                assert (dec.bs, dec.max_bs) == ([1, 2, 4, 64, 128, 256], 256)
                if fail:
                    raise RuntimeError("capture failed")
        assert (args.cuda_graph_config.decode.bs, args.cuda_graph_config.decode.max_bs) == ([1, 2, 4, 64], 64)


def test_build_plain_state_falls_back_to_the_servers_backend():
    pytest.importorskip("sglang.srt.speculative.spec_info")
    mr = types.SimpleNamespace(spec_algorithm="DDTREE", server_args=Args())
    built = []

    def build(m, name):
        built.append(name)
        if name == "fa3":
            raise ImportError("no fa3 kernels")
        return types.SimpleNamespace(name=name)

    st = P.build_plain_decode_state(mr, use_graphs=True, backend_name="fa3", build_backend=build,
                                    runner_cls=lambda m, attn_backend: types.SimpleNamespace(b=attn_backend))
    assert built == ["fa3", None] and st.backend_name is None and st.width == 1
    assert st.graph_runner.b is st.attn_backend and mr.spec_algorithm == "DDTREE"
    st = P.build_plain_decode_state(mr, use_graphs=False, backend_name="flashinfer", build_backend=build)
    assert st.backend_name == "flashinfer" and st.graph_runner is None


def test_the_plain_backend_shares_the_servers_flashinfer_workspace(monkeypatch):
    """SGLang 0.5.16's builders (``_build_backend_from_str``, ``ModelRunner._get_attention_backend``)
    are asked for the server's workspace (``init_new_workspace=False``: no second 384-512 MB
    buffer), and the runner's ``init_new_workspace``, which SGLang's builder overwrites, is restored."""
    setup = pytest.importorskip("sglang.srt.model_executor.model_runner_components.attention_backend_setup")
    asked = []

    def from_str(*, model_runner, backend_str, init_new_workspace):
        model_runner.init_new_workspace = init_new_workspace          # what SGLang's builder does
        asked.append((backend_str, init_new_workspace))
        return backend_str

    monkeypatch.setattr(setup, "_build_backend_from_str", from_str)
    mr = types.SimpleNamespace(init_new_workspace="before")
    mr._get_attention_backend = lambda init_new_workspace: from_str(
        model_runner=mr, backend_str="server's", init_new_workspace=init_new_workspace)
    assert P._build_backend(mr, "flashinfer") == "flashinfer" and P._build_backend(mr, None) == "server's"
    assert asked == [("flashinfer", False), ("server's", False)] and mr.init_new_workspace == "before"


def test_plain_forward_batch_restores_the_batch_on_error(monkeypatch):
    FBI = pytest.importorskip("sglang.srt.model_executor.forward_batch_info")

    def boom(cls, batch, mr, **kw):
        assert batch.forward_mode == FBI.ForwardMode.DECODE and batch.spec_info is None
        assert torch.equal(batch.seq_lens, torch.tensor([5, 8])) and int(batch.seq_lens_sum) == 14 + 2
        raise RuntimeError("init_new failed")

    monkeypatch.setattr(FBI.ForwardBatch, "init_new", classmethod(boom))
    seq = torch.tensor([4, 7])
    batch = types.SimpleNamespace(input_ids=None, seq_lens=seq, seq_lens_cpu=None, seq_lens_sum=11,
                                  spec_info="spec", forward_mode="sched", spec_algorithm="algo",
                                  out_cache_loc=None)
    with pytest.raises(RuntimeError, match="init_new failed"):
        P.plain_decode_forward_batch(batch, None, input_ids=torch.tensor([1, 2]), prefix=seq,
                                     out_cache_loc=torch.tensor([10, 20]),
                                     host_prefix_bound=torch.tensor([6, 8], dtype=torch.int32),
                                     host_prefix_bound_sum=14)
    assert (batch.input_ids, batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info,
            batch.forward_mode, batch.spec_algorithm) == (None, seq, None, 11, "spec", "sched", "algo")
