"""The drafter's context after a plain stretch (``sglang_ddtree/drafter_rebuild.py``, design section 3).

A CPU world of one KV pool: ``req_to_token``, the target's K/V and the drafter's context K/V as one
number per slot.  A token t at position p has the value ``t * 1000 + p``; the K/V a decode step wrote
carries ``+ 0.5`` (decode-time K/V is not bit-identical to a recomputed one), so a recomputed K/V
landing in a request's real slot is seen.  The rebuild's extend is SGLang's real ``ForwardBatch``
(``ForwardBatch.init_new``) handed to a recording target whose hidden rows are the values of the
(token, position) it was given.  Each case has a control that must come out the other way."""
import types

import pytest
import torch

pytest.importorskip("sglang.srt.model_executor.forward_batch_info")

from sglang_ddtree import drafter_rebuild as R  # noqa: E402
from sglang_ddtree import plugin, regime_state  # noqa: E402
from sglang_ddtree import worker as W  # noqa: E402

plugin.register()

import sglang.srt.model_executor.forward_batch_info as fbi  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

DDTREE = SpeculativeAlgorithm.from_string("DDTREE-GPU")
SPEC, PLAIN = "spec", "plain"


@pytest.fixture(autouse=True)
def _cpu_forward_batch(monkeypatch):
    # init_new asks the MoE expert-parallel group whether to count padding; none exists on the CPU
    monkeypatch.setattr(fbi, "enable_num_token_non_padded", lambda: False)
    regime_state.disable()
    yield
    regime_state.disable()


def value(tok, pos):
    return tok * 1000.0 + pos


class FakeAllocator:
    """SGLang's token allocator (page size 1, slot 0 the padding slot): counts scratch traffic."""

    def __init__(self, slots):
        self.size = slots
        self.free_slots = list(range(1, slots + 1))
        self.allocs = self.frees = 0

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        self.allocs += 1
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots):
        self.frees += 1
        self.free_slots += [int(s) for s in slots]


class World:
    """One KV pool on the CPU and the writes the worker makes (see the module docstring)."""

    def __init__(self, slots=160, rows=8, ctx=64, max_tokens=4096, window=None):
        self.alloc = FakeAllocator(slots)
        self.req_to_token = torch.zeros((rows, ctx), dtype=torch.int32)
        self.target_kv = torch.zeros(slots + 1, dtype=torch.float64)
        self.drafter_kv = torch.full((slots + 1,), -1.0, dtype=torch.float64)
        self.rb = R.DrafterRebuild(slots + 1, "cpu", max_tokens=max_tokens, window=window)
        self.mr = types.SimpleNamespace(
            device="cpu", server_args=types.SimpleNamespace(attention_backend="torch_native", enable_lora=False),
            ngram_embedding_manager=types.SimpleNamespace(enabled=False),
            model_config=types.SimpleNamespace(model_is_mrope=False),
            req_to_token_pool=types.SimpleNamespace(req_to_token=self.req_to_token),
            token_to_kv_pool_allocator=self.alloc)
        self.forwards, self.appends = [], []
        self._next_tok = 11

    # ------------------------------------------------------------ the serving writes
    def _tok(self):
        self._next_tok += 1
        return self._next_tok

    def slots(self, req, lo=0, hi=None):
        return self.req_to_token[req.req_pool_idx, lo:req.kv_committed_len if hi is None else hi].to(torch.int64)

    def ids(self, req):
        return list(req.origin_input_ids) + list(req.output_ids)

    def _write(self, req, lo, hi, regime, plain_marks=False):
        slots = self.slots(req, lo, hi)
        vals = torch.tensor([value(t, p) for p, t in enumerate(self.ids(req)[lo:hi], start=lo)],
                            dtype=torch.float64)
        self.target_kv[slots] = vals + 0.5                     # the decode / prefill K/V
        if regime == SPEC:
            self.drafter_kv[slots] = vals                      # the drafter's context write
            self.rb.drafted(slots)
        elif plain_marks:                                      # control: a plain write that sets the map
            self.rb.drafted(slots)
        else:
            self.rb.plain_write(slots)

    def admit(self, rid, prompt_len, row, regime, share_from=None, shared=0, plain_marks=False):
        req = types.SimpleNamespace(rid=rid, origin_input_ids=[self._tok() for _ in range(prompt_len)],
                                    output_ids=[], kv_committed_len=prompt_len, req_pool_idx=row,
                                    lora_id=None, token_type_ids=None, multimodal_inputs=None,
                                    input_embeds=None)
        if shared:                                             # a radix-cache hit: the same slots
            req.origin_input_ids[:shared] = share_from.origin_input_ids[:shared]
            self.req_to_token[row, :shared] = self.req_to_token[share_from.req_pool_idx, :shared]
        self.req_to_token[row, shared:prompt_len] = self.alloc.alloc(prompt_len - shared).to(torch.int32)
        self._write(req, shared, prompt_len, regime, plain_marks)
        if regime == SPEC:
            self.rb.spec_prefill([shared])
        req.output_ids.append(self._tok())                     # sampled, not in the KV yet
        return req

    def step(self, req, regime, n=1, plain_marks=False):
        for _ in range(n):
            c = req.kv_committed_len
            self.req_to_token[req.req_pool_idx, c] = int(self.alloc.alloc(1)[0])
            req.kv_committed_len = c + 1
            self._write(req, c, c + 1, regime, plain_marks)
            req.output_ids.append(self._tok())

    # ------------------------------------------------------------ the rebuild's collaborators
    def target_forward(self, fb):
        """The target's extend: its own K/V at out_cache_loc (recomputed: no +0.5), hidden rows the
        (token, position) values of its inputs."""
        vals = value(fb.input_ids.to(torch.float64), fb.positions.to(torch.float64))
        self.target_kv[fb.out_cache_loc] = vals
        self.forwards.append(fb)
        return types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=vals.view(-1, 1)))

    def append(self, *, target_hidden, cache_loc, positions):
        self.appends.append((cache_loc.clone(), positions.clone()))
        self.drafter_kv[cache_loc] = target_hidden[:, 0]

    def build(self, plan, scratch):
        return R.extend_forward_batch(plan, scratch, model_runner=self.mr, spec_algorithm=DDTREE, device="cpu")

    def rebuild(self, reqs, build=None):
        return self.rb.run(reqs, req_to_token=self.req_to_token, allocator=self.alloc,
                           build_forward_batch=build or self.build, target_forward=self.target_forward,
                           append=self.append)

    # ------------------------------------------------------------ checks
    def drafter_exact(self, req, lo=0):
        """The drafter's context at every position in [lo, C) is its token's."""
        ids = self.ids(req)
        want = torch.tensor([value(ids[p], p) for p in range(lo, req.kv_committed_len)], dtype=torch.float64)
        return bool(torch.equal(self.drafter_kv[self.slots(req, lo)], want))

    def target_untouched(self, req):
        """Every real target slot still holds the K/V its decode / prefill wrote."""
        ids = self.ids(req)
        want = torch.tensor([value(ids[p], p) + 0.5 for p in range(req.kv_committed_len)], dtype=torch.float64)
        return bool(torch.equal(self.target_kv[self.slots(req)], want))

    def all_valid(self, req):
        return bool((self.rb.ok.valid[self.slots(req)] == 1).all())


# ------------------------------------------------------------------ the map
def test_the_map_is_set_by_drafter_writes_and_cleared_by_plain_writes():
    ok = R.DrafterOk(10, "cpu")
    ok.mark_drafted(torch.tensor([1, 2, 3]))
    ok.clear(torch.tensor([2]))
    assert ok.valid.tolist() == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    # a round's commit (SGLang's prefix-valid write): the committed prefix of each block row valid, the
    # rest invalid (the draft block's forward wrote noise there)
    ok.valid.fill_(1)
    ok.mark_drafted(torch.tensor([4, 5, 6, 7, 8, 9]), cache_loc_2d=torch.tensor([[4, 5, 6], [7, 8, 9]]),
                    commit_lens=torch.tensor([2, 0], dtype=torch.int32))
    assert ok.valid.tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="commit_lens"):
        ok.mark_drafted(torch.tensor([1]), cache_loc_2d=torch.tensor([[1]]))
    with pytest.raises(ValueError, match="at least one slot"):
        R.DrafterOk(1, "cpu")
    # first stale position per request, within [lower, committed)
    r2t = torch.tensor([[4, 5, 6, 7], [1, 2, 3, 0]], dtype=torch.int32)
    first = ok.first_stale(r2t, torch.tensor([0, 1]), torch.tensor([4, 3]), torch.tensor([0, 0]), 4)
    assert first.tolist() == [2, 3]                 # slot 6 stale at position 2; request 2 all valid
    first = ok.first_stale(r2t, torch.tensor([0, 1]), torch.tensor([4, 3]), torch.tensor([3, 0]), 4)
    assert first.tolist() == [3, 3]                 # request 1's stale slots lie before its window
    with pytest.raises(RuntimeError, match="without out_cache_loc"):
        R.DrafterRebuild(10, "cpu", max_tokens=8).plain_write(None)


def test_the_worker_marks_at_every_drafter_write_and_clears_at_plain_batches(monkeypatch):
    """Through the worker: its override of DFLASH's drafter write marks (prefill / commit / catch-up
    all call it), a plain-regime batch clears its out_cache_loc.  Control: without the regime served
    no map exists (a server that never goes plain pays nothing)."""
    written = []
    monkeypatch.setattr(W.DFlashWorkerV2, "_append_target_hidden_to_draft_kv_by_loc",
                        lambda self, **kw: written.append(kw["cache_loc"].tolist()))
    w = W.DDTreeWorker.__new__(W.DDTreeWorker)
    w.algo_name = "DDTREE-GPU"
    w.target_server_args = types.SimpleNamespace(max_prefill_tokens=64, chunked_prefill_size=32)
    alloc = FakeAllocator(20)
    mr = types.SimpleNamespace(token_to_kv_pool_allocator=alloc, device="cpu", attn_backend="b",
                               prefill_cuda_graph_runner=None)
    w._target_worker = types.SimpleNamespace(
        model_runner=mr, forward_batch_generation=lambda batch, **kw: types.SimpleNamespace(
            logits_output=types.SimpleNamespace(hidden_states=None)))
    w._verify_states = None
    w._catch_up = None
    w._policy = types.SimpleNamespace(interrupt=lambda: None, regime_controller=None)
    # control first: no regime, no map
    w._append_target_hidden_to_draft_kv_by_loc(target_hidden=torch.ones(2, 1), cache_loc=torch.tensor([3, 4]),
                                               positions=torch.tensor([0, 1]))
    assert w._rebuild is None and written == [[3, 4]]
    regime_state.enable(regime_state.SPEC)
    # a regime that never switches (the default spec, forced plain: no controller): still no map
    w._append_target_hidden_to_draft_kv_by_loc(target_hidden=torch.ones(2, 1), cache_loc=torch.tensor([3, 4]),
                                               positions=torch.tensor([0, 1]))
    assert w._rebuild is None
    w._policy.regime_controller = object()                      # cycle<k> / auto
    w._append_target_hidden_to_draft_kv_by_loc(target_hidden=torch.ones(3, 1), cache_loc=torch.tensor([3, 4, 5]),
                                               positions=torch.tensor([0, 1, 2]))
    rb = w._rebuild
    assert rb.ok.num_slots == 21 and rb.max_tokens == 32          # pool + slot 0; a prefill chunk
    assert rb.ok.valid[3:6].tolist() == [1, 1, 1]
    plain = types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.NONE, forward_mode=ForwardMode.EXTEND,
                                  is_extend_in_batch=True, out_cache_loc=torch.tensor([4, 5]),
                                  seq_lens=torch.zeros(1), return_hidden_states=False)
    w.forward_batch_generation(plain)
    assert rb.ok.valid[3:6].tolist() == [1, 0, 0] and rb.plain_seen


# ------------------------------------------------------------------ the rebuild
def test_a_request_through_a_plain_stretch_gets_exactly_its_stale_positions_at_its_real_slots():
    w = World()
    a = w.admit("a", 6, row=2, regime=SPEC)
    w.step(a, SPEC, 4)                                          # C = 10, all drafted
    w.step(a, PLAIN, 5)                                         # C = 15, 10..14 stale
    assert w.rb.due(switches=2)
    free_before, allocs_before = w.alloc.available_size(), w.alloc.allocs
    assert w.rebuild([a]) == 5
    fb, = w.forwards
    assert fb.forward_mode == ForwardMode.EXTEND and fb.capture_hidden_mode == CaptureHiddenMode.FULL
    assert fb.extend_prefix_lens_cpu == [10] and fb.extend_seq_lens_cpu == [5]     # prefix [0, 10)
    assert fb.req_pool_indices.tolist() == [2] and fb.seq_lens.tolist() == [15]
    assert fb.positions.tolist() == list(range(10, 15))
    assert fb.input_ids.tolist() == w.ids(a)[10:15]
    (loc, pos), = w.appends
    assert loc.tolist() == w.slots(a, 10).tolist() and pos.tolist() == list(range(10, 15))
    assert not set(fb.out_cache_loc.tolist()) & set(w.slots(a).tolist())    # scratch, not its own
    assert w.drafter_exact(a) and w.target_untouched(a) and w.all_valid(a)
    assert (w.alloc.allocs - allocs_before, w.alloc.frees) == (1, 1)       # one scratch, freed
    assert w.alloc.available_size() == free_before
    assert not w.rb.pending and w.rb.rebuilt_tokens == 5
    # control: the drafter context was stale before (what the rebuild fixed)
    w2 = World()
    b = w2.admit("b", 6, row=2, regime=SPEC)
    w2.step(b, SPEC, 4)
    w2.step(b, PLAIN, 5)
    assert not w2.drafter_exact(b)
    # control: recomputed K/V written into the request's own slots is detected
    def into_real_slots(plan, scratch):
        return w2.build(plan, w2.slots(b, 10))
    w2.rebuild([b], build=into_real_slots)
    assert w2.drafter_exact(b) and not w2.target_untouched(b)


def test_a_request_admitted_while_plain_gets_its_whole_context():
    w = World()
    a = w.admit("a", 7, row=1, regime=PLAIN)
    w.step(a, PLAIN, 3)                                        # C = 10, nothing drafted
    assert w.rebuild([a]) == 10
    fb, = w.forwards
    assert fb.extend_prefix_lens_cpu == [0] and fb.input_ids.tolist() == w.ids(a)[:10]
    assert w.drafter_exact(a) and w.target_untouched(a) and w.all_valid(a)
    # control: a plain prefill that sets the map (as a drafter write would) hides the prompt
    w2 = World()
    b = w2.admit("b", 7, row=1, regime=PLAIN, plain_marks=True)
    w2.step(b, PLAIN, 3)
    assert w2.rebuild([b]) == 3 and not w2.drafter_exact(b)


def test_a_radix_prefix_computed_while_plain_is_rebuilt_for_the_request_that_reads_it(monkeypatch):
    w = World()
    a = w.admit("a", 8, row=0, regime=PLAIN)                   # its prompt cached while plain
    assert not w.rb.due(switches=0)
    # back in spec with no running batch (no switch seen by a decode launch yet is irrelevant): b hits
    # a's 8 cached tokens, its own 4 drafted at prefill
    b = w.admit("b", 12, row=3, regime=SPEC, share_from=a, shared=8)
    assert w.slots(b, 0, 8).tolist() == w.slots(a, 0, 8).tolist()
    w.step(b, SPEC, 2)
    assert w.rb.due(switches=0)                                # the cached-prefix recheck
    assert w.rebuild([b]) == 14                                # [0, 14): contiguous from position 0
    assert w.drafter_exact(b) and w.target_untouched(b) and w.all_valid(b)
    # control: without the recheck, no rebuild is due and the shared slots stay stale
    monkeypatch.setattr(R, "RECHECK_CACHED_PREFIXES", False)
    w2 = World()
    a2 = w2.admit("a", 8, row=0, regime=PLAIN)
    b2 = w2.admit("b", 12, row=3, regime=SPEC, share_from=a2, shared=8)
    assert not w2.rb.due(switches=0) and not w2.drafter_exact(b2)


def test_nothing_is_rebuilt_when_nothing_is_stale():
    w = World()
    a = w.admit("a", 5, row=0, regime=SPEC)
    b = w.admit("b", 3, row=1, regime=SPEC)
    w.step(a, SPEC, 4)
    assert w.rebuild([a, b]) == 0
    assert not w.forwards and not w.appends and w.alloc.allocs == 2 + 4      # the admissions' only
    assert not w.rb.pending
    # control: one plain write, and exactly that position (and after it) is rebuilt
    w.step(b, PLAIN, 1)
    w.step(b, SPEC, 2)
    assert w.rebuild([a, b]) == 3 and w.forwards[0].extend_prefix_lens_cpu == [3]
    assert w.drafter_exact(b) and w.drafter_exact(a)


def test_the_window_and_the_token_cap_bound_the_work():
    w = World(window=3)
    a = w.admit("a", 4, row=0, regime=PLAIN)
    w.step(a, PLAIN, 4)                                        # C = 8, all stale
    assert w.rebuild([a]) == 3 and w.forwards[0].extend_prefix_lens_cpu == [5]
    assert w.drafter_exact(a, lo=5) and not w.drafter_exact(a)
    # control: no window, the whole context
    w2 = World()
    b = w2.admit("b", 4, row=0, regime=PLAIN)
    w2.step(b, PLAIN, 4)
    assert w2.rebuild([b]) == 8 and w2.drafter_exact(b)
    # the token cap: each request keeps its most recent positions, sum <= max_tokens
    w3 = World(max_tokens=9)
    c = w3.admit("c", 10, row=0, regime=PLAIN)
    d = w3.admit("d", 3, row=1, regime=PLAIN)
    assert w3.rebuild([c, d]) == 9
    fb, = w3.forwards
    assert fb.extend_prefix_lens_cpu == [4, 0] and fb.extend_seq_lens_cpu == [6, 3]
    assert w3.drafter_exact(c, lo=4) and w3.drafter_exact(d) and w3.rb.skipped_tokens == 4
    assert R.cap_ranges([10, 3], 9) == [6, 3] and R.cap_ranges([2, 2], 0) == [0, 0]
    with pytest.raises(ValueError, match="window"):
        R.DrafterRebuild(10, "cpu", max_tokens=4, window=0)


def test_scratch_slots_are_freed_and_a_full_pool_skips(caplog):
    w = World(slots=24)
    a = w.admit("a", 10, row=0, regime=PLAIN)
    w.step(a, PLAIN, 2)                                        # 12 used, 12 free
    free_before = w.alloc.available_size()
    assert w.rebuild([a]) == 12 and w.alloc.available_size() == free_before
    # a fuller pool: only what fits is rebuilt (the most recent positions)
    b = w.admit("b", 7, row=1, regime=PLAIN)                   # 5 free
    assert w.rebuild([b]) == 5 and w.drafter_exact(b, lo=2)
    assert w.alloc.available_size() == 5
    # an allocator that refuses: skipped, logged once, nothing written
    w.alloc.alloc = lambda n: None
    appends_before = len(w.appends)
    c = types.SimpleNamespace(**vars(b))
    w.rb.plain_write(w.slots(c))
    with caplog.at_level("WARNING"):
        assert w.rebuild([c]) == 0 and w.rebuild([c]) == 0
    assert len(w.appends) == appends_before
    assert sum("scratch extend: skipped" in r.message for r in caplog.records) == 1
    # control: a rebuild that skips the scratch free leaks the slots
    w2 = World(slots=24)
    d = w2.admit("d", 10, row=0, regime=PLAIN)
    before = w2.alloc.available_size()
    w2.alloc.free = lambda slots: None
    w2.rebuild([d])
    assert w2.alloc.available_size() == before - 10


def test_bad_inputs_are_refused():
    w = World()
    a = w.admit("a", 4, row=0, regime=PLAIN)
    a.output_ids = []                                          # fewer ids than committed positions
    a.kv_committed_len = 6
    with pytest.raises(RuntimeError, match="fewer than the 6 positions"):
        R.token_ids(a, 0, 6)
    with pytest.raises(ValueError, match="max_tokens"):
        R.DrafterRebuild(10, "cpu", max_tokens=0)
    bad = World()
    b = bad.admit("b", 4, row=0, regime=PLAIN)
    bad.target_forward = lambda fb: types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=None))
    free_before = bad.alloc.available_size()
    with pytest.raises(RuntimeError, match="expected 4 rows"):
        bad.rebuild([b])
    assert bad.alloc.available_size() == free_before          # scratch freed on the error path too


def test_the_worker_rebuilds_once_at_the_first_spec_launch_after_a_switch(monkeypatch):
    """The worker's hook: due from ``regime_state.STATE.switches`` (host), catch-up flushed first, the
    target's forward with batch=None and is_verify=True (no sampling), the drafter write unmarked by
    the override (the rebuild marks).  Control: a second launch without a switch runs nothing."""
    world = World()
    a = world.admit("a", 5, row=0, regime=SPEC)
    world.step(a, PLAIN, 3)
    order, target_calls = [], []

    def target_fbg(batch=None, forward_batch=None, is_verify=False, **kw):
        target_calls.append((batch, is_verify))
        order.append("extend")
        return world.target_forward(forward_batch)

    monkeypatch.setattr(W.DFlashWorkerV2, "_append_target_hidden_to_draft_kv_by_loc",
                        lambda self, **kw: world.append(**kw))
    w = W.DDTreeWorker.__new__(W.DDTreeWorker)
    w.algo_name = "DDTREE-GPU"
    w._rebuild = world.rb
    w._target_worker = types.SimpleNamespace(model_runner=world.mr, forward_batch_generation=target_fbg)
    w._catch_up = types.SimpleNamespace(rows=2, flush=lambda: (order.append("flush"),
                                                               setattr(w._catch_up, "rows", 0)))
    regime_state.enable(regime_state.SPEC)
    regime_state.request(regime_state.PLAIN)
    regime_state.switched()
    regime_state.request(regime_state.SPEC)
    regime_state.switched()
    batch = types.SimpleNamespace(reqs=[a], spec_algorithm=DDTREE)
    w._maybe_rebuild_drafter(batch)
    assert order == ["flush", "extend"] and target_calls == [(None, True)]
    assert world.drafter_exact(a) and world.target_untouched(a)
    w._maybe_rebuild_drafter(batch)
    assert target_calls == [(None, True)]                      # control: no switch, nothing runs


def test_a_rebuilds_time_is_taken_once_when_done_and_handed_to_the_regime_controller(monkeypatch):
    """``take_seconds``: the rebuild's time from its events (host clock on the CPU), each run taken
    once; a run whose end event the device has not reached stays for a later call; the worker hands
    what it takes to the policy before the launch's observation (the switch's time, not
    speculation's). Control: with nothing rebuilt since, nothing is handed over."""
    import time as _time
    w = World()
    a = w.admit("a", 6, row=2, regime=SPEC)
    w.step(a, PLAIN, 5)
    slow = w.target_forward

    def slow_forward(fb):
        _time.sleep(0.02)
        return slow(fb)
    w.target_forward = slow_forward
    assert w.rebuild([a]) == 5
    s = w.rb.take_seconds()
    assert 0.02 <= s < 5.0 and w.rb.take_seconds() == 0.0 and abs(w.rb.charged_s - s) < 1e-12

    class NotYet:
        def query(self):
            return False
    w.rb._timed.append((R._event("cpu"), NotYet()))
    assert w.rb.take_seconds() == 0.0 and len(w.rb._timed) == 1         # waits for nothing
    w.rb._timed.clear()

    # the worker: after the launch's observation, the controller told of a rebuild launched with
    # it, then handed the finished rebuilds' time
    charged, seen, told = [], [], []
    wk = W.DDTreeWorker.__new__(W.DDTreeWorker)
    wk._rebuild = w.rb
    wk._regime_launches, wk._regime_logged, wk._regime_shared = 0, 0.0, False
    wk.ps = types.SimpleNamespace(tp_rank=0)
    wk._launches = types.SimpleNamespace(view=lambda reqs, no_spec: "view")
    wk._policy = types.SimpleNamespace(regime_controller=object(), regime_charge=charged.append,
                                       regime_rebuilt=lambda: told.append(len(seen)),
                                       regime=lambda v: (seen.append(list(charged)),
                                                         types.SimpleNamespace(pending=None))[1])
    regime_state.enable(regime_state.SPEC)
    w.rb._timed.append((R._event("cpu"), R._event("cpu")))
    wk._regime_launch(types.SimpleNamespace(reqs=[a]), no_spec=False, rebuilt=True)
    assert seen == [[]] and told == [1] and len(charged) == 1 and charged[0] >= 0.0
    wk._regime_launch(types.SimpleNamespace(reqs=[a]), no_spec=False)
    assert len(charged) == 1 and told == [1]                             # control: nothing new
