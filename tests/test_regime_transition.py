"""The running batch's transition between the spec and the plain regime (issue 52 item 1,
``docs/plain_regime_design.md`` section 5 "transitions"): ``sglang_ddtree/regime_transition.py`` and
``patches/regime_transition.py``.

On SGLang 0.5.16's real objects on the CPU: ``Req``, ``ScheduleBatch`` (its ``prepare_for_decode``,
``filter_batch``, ``merge_batch``, ``copy``), ``ReqToTokenPool``, ``TokenToKVPoolAllocator``,
``ChunkCache``, ``release_kv_cache``, the DDTree algorithm's ``FutureMap``; the plain step runs
SGLang's ``alloc_for_decode``, the spec step ``DFlashDraftInputV2.prepare_for_decode`` with
``alloc_for_spec_decode`` (its row-assignment Triton kernel replaced by the same
contract in torch, :func:`_assign_rows`).  The GPU is modelled by
:class:`Sim`: a device length per request (the K/V it wrote), a round that commits 1..N tokens at the
device length and checks every position it writes against the host's reservation and the slot the
host assigned.  :func:`audit` checks KV ownership: every slot is owned by exactly one live
``req_to_token`` entry or is free.  Each property has a control that injects the bug and shows the
checker flags it."""
import collections
import random
import types

import pytest
import torch

pytest.importorskip("sglang.srt.speculative.dflash_info_v2")

from sglang.srt.managers.schedule_batch import (FINISH_LENGTH, ForwardMode, NextBatchPlan, Req,  # noqa: E402
                                                ReqKvInfo, ScheduleBatch)
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.managers.min_free_slots_delayer import MinFreeSlotsDelayer  # noqa: E402
from sglang.srt.managers.overlap_utils import RelayPayload  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_ddtree import regime_state  # noqa: E402
from sglang_ddtree import regime_transition as RT  # noqa: E402
from sglang_ddtree.patches import regime_transition as HOOK  # noqa: E402
from sglang_ddtree.spec_algo import DDTreeGPUSpecAlgo  # noqa: E402

N = 4                 # verify width (speculative_num_draft_tokens): DFlash reserves C + 2N
POOL = 4000           # KV slots
ROWS = 24             # req_to_token rows
CTX = 256             # req_to_token row width
CPU = torch.device("cpu")


class SimError(AssertionError):
    """The modelled GPU or the KV audit found the host's bookkeeping wrong."""


def _assign_rows(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size):
    """``allocation.assign_req_to_token_pool_func``'s contract in torch (its Triton kernel trips the
    NumPy scalar-conversion error this suite enables, under the interpreter): row i's entries
    ``[start_i, end_i)`` get the next ``end_i - start_i`` slots of ``out_cache_loc``."""
    off = 0
    for i in range(batch_size):
        s, e = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[off:off + e - s].to(req_to_token.dtype)
        off += e - s


@pytest.fixture(autouse=True)
def server_args(monkeypatch):
    import sglang.srt.mem_cache.allocation as allocation

    monkeypatch.setattr(allocation, "assign_req_to_token_pool_func", _assign_rows)
    with get_context().override_server_args(page_size=1, speculative_algorithm="DDTREE-GPU",
                                            speculative_num_draft_tokens=N):
        yield
    regime_state.disable()


def ddtree():
    return DDTreeGPUSpecAlgo("DDTREE-GPU", lambda sa: None, supports_overlap=True)


class Pools:
    """SGLang's real request-row pool, token allocator and chunk cache on the CPU."""

    def __init__(self):
        self.r2t = ReqToTokenPool(size=ROWS, max_context_len=CTX, device="cpu", enable_memory_saver=False)
        self.alloc = TokenToKVPoolAllocator(size=POOL, dtype=torch.float16, device="cpu", kvcache=None,
                                            need_sort=False)
        self.cache = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=self.r2t,
                                                token_to_kv_pool_allocator=self.alloc, page_size=1))


class _Sampling:
    """The sampling_info surface ScheduleBatch's decode, filter and merge touch (no penalties)."""
    penalizer_orchestrator = types.SimpleNamespace(is_required=False)

    def merge_batch(self, other):
        pass

    def filter_batch(self, keep, keep_device):
        pass


def audit(pools, reqs):
    """KV ownership: the live requests' ``req_to_token[row, :kv_allocated_len]`` entries are distinct,
    assigned (slot 0 is the padding slot), disjoint from the free list, and with it cover the pool.
    Raises SimError naming what is wrong."""
    owned = []
    for r in reqs:
        if r.kv is None:
            continue
        row = pools.r2t.req_to_token[r.req_pool_idx, :r.kv.kv_allocated_len].tolist()
        if 0 in row:
            raise SimError(f"{r.rid}: unassigned req_to_token entry inside [0, {r.kv.kv_allocated_len})")
        owned += row
    free = torch.cat([pools.alloc.free_pages, pools.alloc.release_pages]).tolist()
    if len(set(owned)) != len(owned):
        raise SimError("a KV slot is owned twice")
    if set(owned) & set(free):
        raise SimError(f"{len(set(owned) & set(free))} owned KV slot(s) are also free")
    if len(free) != len(set(free)):
        raise SimError("a KV slot is free twice")
    if len(owned) + len(free) != POOL:
        raise SimError(f"KV leak: {POOL - len(owned) - len(free)} slot(s) neither owned nor free")


def admit(pools, fm, lens, algo, rng, max_new=10 ** 6, rid0=0, overlap=True):
    """A prefill batch of ``len(lens)`` requests as ``prepare_for_extend`` and the run leave it: row
    and prompt slots allocated, C = A = prompt length, the first output token sampled and relayed."""
    reqs = []
    for i, L in enumerate(lens):
        r = Req(f"r{rid0 + i}", "", [rng.randrange(1, 1000) for _ in range(L)],
                SamplingParams(max_new_tokens=max_new))
        reqs.append(r)
    pools.r2t.alloc(reqs)
    for r in reqs:
        L = len(r.origin_input_ids)
        pools.r2t.write((r.req_pool_idx, slice(0, L)), pools.alloc.alloc(L).to(torch.int32))
        r.kv = ReqKvInfo(kv_allocated_len=L, swa_evicted_seqlen=0)
        r.kv_committed_len = L
    b = ScheduleBatch(reqs=reqs, req_to_token_pool=pools.r2t, token_to_kv_pool_allocator=pools.alloc,
                      tree_cache=pools.cache, model_config=types.SimpleNamespace(is_encoder_decoder=False),
                      spec_algorithm=algo, device="cpu", enable_overlap=overlap, forward_mode=ForwardMode.EXTEND)
    b.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    b.req_pool_indices_cpu = b.req_pool_indices.clone()
    b.seq_lens = torch.tensor(lens, dtype=torch.int64)
    b.seq_lens_cpu = b.seq_lens.clone()
    b.orig_seq_lens = b.seq_lens.to(torch.int32)
    b.seq_lens_sum = sum(lens)
    b.sampling_info = _Sampling()
    return b


class Sim:
    """SGLang 0.5.16's event loop (``event_loop_overlap`` / ``event_loop_normal``) around the hooked
    ``get_next_batch_to_run``, with a reduced original (merge the last prefill, admit, else decode
    the running batch through the real ``prepare_for_decode``) and a modelled GPU (``run``)."""

    def __init__(self, rng, *, overlap=True, admit_every=5, max_new=(6, 30)):
        self.rng, self.pools = rng, Pools()
        self.spec_algorithm = ddtree()
        self.future_map = self.spec_algorithm.create_future_map(CPU, self.pools.r2t)
        self.enable_overlap, self.chunked_req, self.require_mlp_sync = overlap, None, False
        self.server_args = types.SimpleNamespace(min_free_slots_delay=None)
        self.max_running_requests = 16
        self.min_free_slots_delayer = MinFreeSlotsDelayer(min_free_slots=2)
        self.result_queue = collections.deque()
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.last_batch = None
        self.waiting = 0
        self.admit_every, self.max_new, self.it, self.next_rid = admit_every, max_new, 0, 0
        self.dev_len, self.dev_tok = {}, {}          # device truth per rid: K/V written, last token
        self.all_reqs, self.steps = [], []

    # --- the original get_next_batch_to_run, reduced ------------------------------------------------
    def original(self, _self, running, last):
        if last is not None and last.forward_mode.is_extend():
            last.filter_batch()
            if not last.is_empty():
                if running.is_empty():
                    running = last
                else:
                    running.merge_batch(last)
        if self.waiting and len(running.reqs) < self.max_running_requests:
            k = min(self.waiting, 3)
            self.waiting -= k
            algo = regime_state.batch_algorithm(self.spec_algorithm)     # patches/regime_batch_algo.py
            b = admit(self.pools, self.future_map, [self.rng.randrange(3, 40) for _ in range(k)], algo,
                      self.rng, max_new=self.rng.randrange(*self.max_new), rid0=self.next_rid,
                      overlap=self.enable_overlap)
            self.next_rid += k
            self.all_reqs += b.reqs
            return NextBatchPlan(batch_to_run=b, running_batch=running)
        if running.is_empty():
            return NextBatchPlan(batch_to_run=None, running_batch=running)
        running.filter_batch()
        if running.is_empty():
            return NextBatchPlan(batch_to_run=None, running_batch=running)
        running.prepare_for_decode()
        return NextBatchPlan(batch_to_run=running, running_batch=running)

    def get_next_batch_to_run(self, running, last):
        return HOOK.get_next_batch_at_regime_switch(self.original, self, running, last)

    # --- the modelled GPU ------------------------------------------------------------------------
    def _check(self, cond, msg):
        if not cond:
            raise SimError(msg)

    def run(self, batch):
        fm, idx = self.future_map, batch.req_pool_indices
        spec = not batch.spec_algorithm.is_none()
        r2t = self.pools.r2t.req_to_token
        if batch.forward_mode.is_extend():
            toks = [self.rng.randrange(1, 1000) for _ in batch.reqs]
            for r, t in zip(batch.reqs, toks):
                self.dev_len[r.rid], self.dev_tok[r.rid] = r.kv_committed_len, t
            out = torch.tensor(toks, dtype=torch.int64)
            fm.publish(idx, batch.seq_lens if spec else batch.seq_lens + 1)
            fm.stash(idx, RelayPayload(bonus_tokens=out))
            if spec:
                batch.spec_info = make_draft_input_v2(bonus_tokens=out, new_seq_lens=batch.seq_lens)
                if self.enable_overlap:                        # run_batch's overlap branch only
                    batch.spec_info.future_indices = idx
            batch.input_ids = None
            return [[t] for t in toks]
        if not spec:
            inp = fm.output_tokens_buf[idx].tolist()           # the worker's gather (input_ids None)
            res = []
            for i, r in enumerate(batch.reqs):
                pos = int(batch.seq_lens[i]) - 1
                self._check(pos == self.dev_len[r.rid], f"plain step of {r.rid} writes position {pos}, "
                            f"the device holds {self.dev_len[r.rid]} tokens (stale length)")
                self._check(inp[i] == self.dev_tok[r.rid], f"plain step of {r.rid}: wrong input token")
                self._check(int(batch.out_cache_loc[i]) == int(r2t[r.req_pool_idx, pos]),
                            f"plain step of {r.rid}: out_cache_loc is not req_to_token[row, {pos}]")
                t = self.rng.randrange(1, 1000)
                self.dev_len[r.rid] += 1
                self.dev_tok[r.rid] = t
                res.append([t])
            out = torch.tensor([x[0] for x in res], dtype=torch.int64)
            fm.publish(idx, batch.seq_lens + 1)
            fm.stash(idx, RelayPayload(bonus_tokens=out))
            batch.input_ids = None
            return res
        before = batch.seq_lens
        if self.enable_overlap:
            fm.resolve_seq_lens_cpu(batch)                     # the real resolve, from the published lengths
            bonus = fm.output_tokens_buf[batch.spec_info.future_indices].tolist()
        else:
            bonus = batch.spec_info.bonus_tokens.tolist()
        res, new_lens = [], []
        for i, r in enumerate(batch.reqs):
            prefix = int(batch.seq_lens[i])
            self._check(prefix == self.dev_len[r.rid], f"spec round of {r.rid} at prefix {prefix}, the device "
                        f"holds {self.dev_len[r.rid]} tokens (stale length)")
            self._check(bonus[i] == self.dev_tok[r.rid], f"spec round of {r.rid}: wrong bonus token")
            k = self.rng.randint(1, N)
            for p in range(prefix, prefix + N):                # the verify writes N slots
                self._check(p < r.kv.kv_allocated_len and int(r2t[r.req_pool_idx, p]) != 0,
                            f"spec round of {r.rid} writes position {p} outside its reservation "
                            f"[0, {r.kv.kv_allocated_len})")
            toks = [self.rng.randrange(1, 1000) for _ in range(k)]
            self.dev_len[r.rid] += k
            self.dev_tok[r.rid] = toks[-1]
            res.append(toks)
            new_lens.append(self.dev_len[r.rid])
        new = torch.tensor(new_lens, dtype=torch.int64)
        bon = torch.tensor([x[-1] for x in res], dtype=torch.int64)
        fm.publish(idx, new)
        fm.stash(idx, RelayPayload(bonus_tokens=bon))
        if self.enable_overlap:
            batch.seq_lens = before                            # _forward_isolation's restore
        else:
            batch.seq_lens, batch.seq_lens_cpu = new, new.clone()
        batch.spec_info = make_draft_input_v2(bonus_tokens=bon, new_seq_lens=new)
        if self.enable_overlap:
            batch.spec_info.future_indices = idx
        batch.input_ids = None
        return res

    def process(self, batch, res):
        spec_decode = not batch.spec_algorithm.is_none() and batch.forward_mode.is_decode()
        for r, toks in zip(batch.reqs, res):
            if r.finished():
                continue
            if spec_decode:
                r.kv_committed_len += len(toks)                # _resolve_spec_v2_tokens
            r.output_ids.extend(toks)
            if len(r.output_ids) >= r.sampling_params.max_new_tokens:
                r.finished_reason = FINISH_LENGTH(length=len(r.output_ids))
                release_kv_cache(r, self.pools.cache)

    # --- the loop --------------------------------------------------------------------------------
    def iteration(self):
        if self.it % self.admit_every == 0 and self.it < 60:
            self.waiting += self.rng.randint(1, 3)
        self.it += 1
        plan = self.get_next_batch_to_run(self.running_batch, self.last_batch)
        self.running_batch, batch = plan.running_batch, plan.batch_to_run
        self.steps.append(None if batch is None else
                          ("extend" if batch.forward_mode.is_extend() else "decode",
                           "plain" if batch.spec_algorithm.is_none() else "spec"))
        if self.enable_overlap:
            if batch is not None:
                self.result_queue.append((batch.copy(), self.run(batch)))
            if self.last_batch is not None:
                self.process(*self.result_queue.popleft())
        elif batch is not None:
            self.process(batch, self.run(batch))
        self.last_batch = batch
        audit(self.pools, self.all_reqs)

    def done(self):
        return self.it > 60 and self.waiting == 0 and all(r.finished() for r in self.all_reqs) \
            and not self.result_queue


def cycle(rng, *, overlap, every=7, start=regime_state.SPEC, max_iters=400):
    """Serve with the regime flipped every ``every`` iterations (admissions every 5); returns the Sim."""
    regime_state.enable(start)
    sim = Sim(rng, overlap=overlap)
    while not sim.done():
        if sim.it % every == every - 1 and regime_state.STATE.pending is None:
            regime_state.request(regime_state.PLAIN if regime_state.STATE.regime == regime_state.SPEC
                                 else regime_state.SPEC)
        sim.iteration()
        if sim.it > max_iters:
            raise SimError("the simulation did not finish")
    return sim


def _rng(request):
    seed = random.randrange(1 << 30)
    print(f"seed={seed} ({request.node.name})")
    return random.Random(seed)


# ------------------------------------------------------------------------------ the conversions

def _spec_batch_after_round(pools, fm, rng, lens):
    """A spec running batch after one DDTree round was processed: the real DFlash prepare reserved
    C + 2N, the round committed 1..N tokens per request (host C += accepted, bonus relayed)."""
    b = admit(pools, fm, lens, ddtree(), rng)
    b.spec_info = make_draft_input_v2(bonus_tokens=torch.zeros(len(lens), dtype=torch.int64),
                                      new_seq_lens=b.seq_lens)
    b.spec_info.future_indices = b.req_pool_indices
    b.forward_mode = ForwardMode.DECODE
    b.prepare_for_decode()                                     # DFlashDraftInputV2.prepare_for_decode
    for r in b.reqs:
        assert r.kv.kv_allocated_len == r.kv_committed_len + 2 * N
        r.kv_committed_len += rng.randint(1, N)
    bonus = torch.tensor([rng.randrange(1, 1000) for _ in lens], dtype=torch.int64)
    fm.stash(b.req_pool_indices, RelayPayload(bonus_tokens=bonus))
    return b, bonus


def check_plain_step(pools, b, committed):
    """After a real plain ``prepare_for_decode``: one slot per request at position C, C = A =
    ``seq_lens`` = old C + 1, and the KV audit passes.  Raises SimError."""
    r2t = pools.r2t.req_to_token
    for i, (r, c) in enumerate(zip(b.reqs, committed)):
        if int(b.out_cache_loc[i]) != int(r2t[r.req_pool_idx, c]):
            raise SimError(f"{r.rid}: the plain slot is not at position {c}")
        if not (r.kv_committed_len == r.kv.kv_allocated_len == c + 1 == int(b.seq_lens[i])
                == int(b.seq_lens_cpu[i])):
            raise SimError(f"{r.rid}: lengths C={r.kv_committed_len} A={r.kv.kv_allocated_len} "
                           f"seq_lens={int(b.seq_lens[i])}, expected {c + 1}")
    audit(pools, b.reqs)


def test_spec_to_plain_frees_the_reservation_and_the_next_plain_step_takes_one_slot_at_committed(request):
    rng = _rng(request)
    pools = Pools()
    fm = ddtree().create_future_map(CPU, pools.r2t)
    b, bonus = _spec_batch_after_round(pools, fm, rng, [rng.randrange(3, 60) for _ in range(5)])
    over = [r.kv.kv_allocated_len - r.kv_committed_len for r in b.reqs]
    committed = [r.kv_committed_len for r in b.reqs]
    free_before = pools.alloc.available_size()
    freed = RT.spec_to_plain(b)
    assert freed == over and pools.alloc.available_size() - free_before == sum(over)
    assert [r.kv.kv_allocated_len for r in b.reqs] == committed
    assert b.seq_lens.dtype == torch.int64 and b.seq_lens.tolist() == committed
    assert b.seq_lens_cpu.tolist() == committed and b.seq_lens_sum == sum(committed)
    assert b.orig_seq_lens.dtype == torch.int32 and b.orig_seq_lens.tolist() == committed
    assert b.spec_info is None and b.spec_algorithm.is_none() and b.input_ids is None
    assert torch.equal(fm.output_tokens_buf[b.req_pool_indices], bonus)   # the plain step's input
    audit(pools, b.reqs)
    b.prepare_for_decode()                                     # SGLang's plain step: alloc_for_decode
    check_plain_step(pools, b, committed)


def test_control_spec_to_plain_without_the_trim_leaks(request, monkeypatch):
    """Control: the trim skipped (A set to C, the reservation kept in req_to_token): the audit flags
    the leak, and the plain step's checker flags it too."""
    rng = _rng(request)
    pools = Pools()
    fm = ddtree().create_future_map(CPU, pools.r2t)
    b, _ = _spec_batch_after_round(pools, fm, rng, [rng.randrange(3, 60) for _ in range(5)])
    committed = [r.kv_committed_len for r in b.reqs]
    monkeypatch.setattr(RT, "_free_over_allocation", lambda *a: None)
    RT.spec_to_plain(b)
    with pytest.raises(SimError, match="leak"):
        audit(pools, b.reqs)
    b.prepare_for_decode()
    with pytest.raises(SimError, match="leak"):
        check_plain_step(pools, b, committed)


def test_spec_to_plain_refuses_bad_state(request):
    rng = _rng(request)
    pools = Pools()
    fm = ddtree().create_future_map(CPU, pools.r2t)
    b, _ = _spec_batch_after_round(pools, fm, rng, [5, 7])
    b.reqs[0].kv_committed_len = b.reqs[0].kv.kv_allocated_len + 1
    with pytest.raises(RuntimeError, match="kv_committed_len .* > kv_allocated_len"):
        RT.spec_to_plain(b)
    b.reqs[0].kv_committed_len = 5
    release_kv_cache(b.reqs[1], pools.cache)                   # finished and released, not filtered
    with pytest.raises(RuntimeError, match="released its KV"):
        RT.spec_to_plain(b)
    p = admit(pools, fm, [4], SpeculativeAlgorithm.NONE, rng)
    with pytest.raises(RuntimeError, match="not a speculative batch"):
        RT.spec_to_plain(p)


def _plain_batch_after_steps(pools, fm, rng, lens, steps=3):
    """A plain running batch after ``steps`` real plain decode steps, each relayed and published as
    SGLang's plain overlap branch does (``output_tokens_buf``; ``seq_lens + 1``)."""
    b = admit(pools, fm, lens, SpeculativeAlgorithm.NONE, rng)
    fm.publish(b.req_pool_indices, b.seq_lens + 1)
    b.forward_mode = ForwardMode.DECODE
    for _ in range(steps):
        b.prepare_for_decode()
        fm.publish(b.req_pool_indices, b.seq_lens + 1)
        tok = torch.tensor([rng.randrange(1, 1000) for _ in lens], dtype=torch.int64)
        fm.stash(b.req_pool_indices, RelayPayload(bonus_tokens=tok))
    return b, tok


def check_spec_ready(pools, fm, b, committed, last_tok):
    """The next spec step after plain_to_spec: SGLang's DFlash prepare reserves from A = C, the real
    ``resolve_seq_lens_cpu`` reads C, the bonus is the last plain token.  Raises SimError."""
    b.prepare_for_decode()                                     # DFlashDraftInputV2.prepare_for_decode
    for r, c in zip(b.reqs, committed):
        if r.kv.kv_allocated_len != c + 2 * N:
            raise SimError(f"{r.rid}: reserved to {r.kv.kv_allocated_len}, expected {c + 2 * N}")
    fm.resolve_seq_lens_cpu(b)
    if b.seq_lens.tolist() != committed:
        raise SimError(f"the spec round reads seq_lens {b.seq_lens.tolist()}, committed is {committed}")
    if not torch.equal(fm.output_tokens_buf[b.spec_info.future_indices], last_tok) \
            or not torch.equal(b.spec_info.bonus_tokens, last_tok):
        raise SimError("the spec round's bonus is not the last plain token")
    audit(pools, b.reqs)


def _plain_batch_to_convert(request):
    """A DDTREE server's pools, FutureMap and a running plain batch of 5 requests after some steps:
    (pools, algo, fm, batch, last tokens, committed lengths)."""
    rng = _rng(request)
    pools = Pools()
    algo = ddtree()
    fm = algo.create_future_map(CPU, pools.r2t)
    b, tok = _plain_batch_after_steps(pools, fm, rng, [rng.randrange(3, 60) for _ in range(5)])
    return pools, algo, fm, b, tok, [r.kv_committed_len for r in b.reqs]


def test_plain_to_spec_publishes_committed_and_the_next_spec_step_reads_it(request):
    pools, algo, fm, b, tok, committed = _plain_batch_to_convert(request)
    assert fm.new_seq_lens_buf[b.req_pool_indices].tolist() == [c + 1 for c in committed]   # plain's publish
    RT.plain_to_spec(b, future_map=fm, spec_algorithm=algo)
    assert b.spec_algorithm is algo and b.input_ids is None
    assert torch.equal(b.spec_info.future_indices, b.req_pool_indices)
    assert b.seq_lens.tolist() == committed and b.seq_lens_cpu.tolist() == committed
    assert fm.new_seq_lens_buf[b.req_pool_indices].tolist() == committed
    check_spec_ready(pools, fm, b, committed, tok)


def test_control_plain_to_spec_without_the_publish_reads_a_stale_length(request, monkeypatch):
    """Control: plain_to_spec's publish skipped: resolve reads plain's C + 1, the checker flags it."""
    pools, algo, fm, b, tok, committed = _plain_batch_to_convert(request)
    real = type(fm).publish
    monkeypatch.setattr(type(fm), "publish", lambda *a, **k: None)
    RT.plain_to_spec(b, future_map=fm, spec_algorithm=algo)
    monkeypatch.setattr(type(fm), "publish", real)
    with pytest.raises(SimError, match="reads seq_lens"):
        check_spec_ready(pools, fm, b, committed, tok)


def test_plain_to_spec_refuses_bad_state(request):
    rng = _rng(request)
    pools = Pools()
    algo = ddtree()
    fm = algo.create_future_map(CPU, pools.r2t)
    b, _ = _plain_batch_after_steps(pools, fm, rng, [5, 6], steps=1)
    with pytest.raises(ValueError, match="not a DFlash-family"):
        RT.plain_to_spec(b, future_map=fm, spec_algorithm=SpeculativeAlgorithm.NONE)
    b.reqs[0].kv.kv_allocated_len += 3
    with pytest.raises(RuntimeError, match="kv_allocated_len .* != kv_committed_len"):
        RT.plain_to_spec(b, future_map=fm, spec_algorithm=algo)
    b.reqs[0].kv.kv_allocated_len -= 3
    b.req_pool_indices_cpu = b.req_pool_indices_cpu.flip(0)
    with pytest.raises(RuntimeError, match="disagrees"):
        RT.plain_to_spec(b, future_map=fm, spec_algorithm=algo)
    s, _ = _spec_batch_after_round(pools, fm, rng, [4])
    with pytest.raises(RuntimeError, match="not a plain batch"):
        RT.plain_to_spec(s, future_map=fm, spec_algorithm=algo)


# ------------------------------------------------------------------------------ the hook

class _Fake:
    """A batch of the given forward mode, as far as the hook's decision reads it."""

    def __init__(self, mode, algo=None):
        self.forward_mode = mode
        self.spec_algorithm = algo

    def is_empty(self):
        return False


def _fake_scheduler(overlap, queued):
    return types.SimpleNamespace(
        enable_overlap=overlap, result_queue=collections.deque([object()] * queued), chunked_req=None,
        require_mlp_sync=False, server_args=types.SimpleNamespace(min_free_slots_delay=None),
        max_running_requests=48, min_free_slots_delayer=MinFreeSlotsDelayer(min_free_slots=4),
        spec_algorithm=ddtree(), future_map=None)


def _call(sched, last, calls):
    running = ScheduleBatch(reqs=[], batch_is_full=False)

    def original(s, rb, lb):
        calls.append(lb)
        return NextBatchPlan(batch_to_run=None, running_batch=rb)
    return HOOK.get_next_batch_at_regime_switch(original, sched, running, last)


@pytest.mark.parametrize("to", [regime_state.PLAIN, regime_state.SPEC])
def test_hook_drains_once_after_a_decode_batch_under_overlap(to):
    regime_state.enable(regime_state.SPEC if to == regime_state.PLAIN else regime_state.PLAIN)
    regime_state.request(to)
    sched, calls = _fake_scheduler(True, 1), []
    plan = _call(sched, _Fake(ForwardMode.DECODE), calls)
    assert plan.batch_to_run is None and calls == [] and regime_state.STATE.pending == to   # the drain
    sched.result_queue.clear()                                 # the loop processed the last batch
    _call(sched, None, calls)
    assert calls == [None] and regime_state.STATE.regime == to and regime_state.STATE.pending is None


def test_hook_never_drains_after_a_prefill():
    regime_state.enable(regime_state.SPEC)
    regime_state.request(regime_state.PLAIN)
    sched, calls = _fake_scheduler(True, 1), []
    prefill = _Fake(ForwardMode.EXTEND)
    for _ in range(3):                                         # consecutive prefills: wait, original runs
        _call(sched, prefill, calls)
        assert calls[-1] is prefill and regime_state.STATE.pending == regime_state.PLAIN
    sched.chunked_req = object()                               # a chunked prefill in progress: wait too
    _call(sched, _Fake(ForwardMode.DECODE), calls)
    assert len(calls) == 4 and regime_state.STATE.pending == regime_state.PLAIN
    sched.chunked_req = None
    _call(sched, _Fake(ForwardMode.DECODE), calls)
    assert len(calls) == 4                                     # drained
    sched.result_queue.clear()
    _call(sched, None, calls)
    assert regime_state.STATE.regime == regime_state.PLAIN


def test_hook_without_overlap_switches_without_a_drain():
    regime_state.enable(regime_state.SPEC)
    regime_state.request(regime_state.PLAIN)
    sched, calls = _fake_scheduler(False, 0), []
    _call(sched, _Fake(ForwardMode.DECODE), calls)
    assert len(calls) == 1 and regime_state.STATE.regime == regime_state.PLAIN


def test_hook_refuses_dp_attention_and_an_inconsistent_queue():
    regime_state.enable(regime_state.SPEC)
    regime_state.request(regime_state.PLAIN)
    sched = _fake_scheduler(True, 1)
    with pytest.raises(RuntimeError, match="queued with no last batch"):
        _call(sched, None, [])
    sched.require_mlp_sync = True
    with pytest.raises(RuntimeError, match="DP attention"):
        _call(sched, _Fake(ForwardMode.DECODE), [])


def test_hook_is_a_pass_through_without_the_regime():
    sched, calls = _fake_scheduler(True, 1), []
    delayer = sched.min_free_slots_delayer
    _call(sched, _Fake(ForwardMode.DECODE), calls)
    assert len(calls) == 1 and sched.min_free_slots_delayer is delayer


def check_delayer(sched, spec_delayer, plain_min_free):
    """Spec: the server's own delayer object; plain: base's (None, or the user's threshold)."""
    d = sched.min_free_slots_delayer
    if regime_state.STATE.regime == regime_state.SPEC:
        if d is not spec_delayer:
            raise SimError("spec regime without the server's delayer")
    elif (None if d is None else d._min_free_slots) != plain_min_free:
        raise SimError(f"plain regime with delayer {d!r}, base has threshold {plain_min_free}")


@pytest.mark.parametrize("user_value,plain_min_free", [(None, None), (3, 3)])
def test_hook_swaps_the_delayer_and_restores_it(user_value, plain_min_free, monkeypatch):
    regime_state.enable(regime_state.SPEC)
    sched, calls = _fake_scheduler(False, 0), []
    sched.server_args.min_free_slots_delay = user_value
    spec_delayer = sched.min_free_slots_delayer
    for to in (regime_state.PLAIN, regime_state.SPEC, regime_state.PLAIN, regime_state.SPEC):
        regime_state.request(to)
        _call(sched, _Fake(ForwardMode.DECODE), calls)
        assert regime_state.STATE.regime == to
        check_delayer(sched, spec_delayer, plain_min_free)
    regime_state.enable(regime_state.PLAIN)                    # a forced-plain start: base's from the first call
    sched = _fake_scheduler(False, 0)
    sched.server_args.min_free_slots_delay = user_value
    spec_delayer = sched.min_free_slots_delayer
    _call(sched, _Fake(ForwardMode.DECODE), calls)
    check_delayer(sched, spec_delayer, plain_min_free)


def test_control_a_hook_that_keeps_the_delayer_is_flagged(monkeypatch):
    regime_state.enable(regime_state.SPEC)
    sched = _fake_scheduler(False, 0)
    spec_delayer = sched.min_free_slots_delayer
    monkeypatch.setattr(HOOK, "sync_delayer", lambda s, r: None)
    regime_state.request(regime_state.PLAIN)
    _call(sched, _Fake(ForwardMode.DECODE), [])
    with pytest.raises(SimError, match="plain regime with delayer"):
        check_delayer(sched, spec_delayer, None)


# ------------------------------------------------------------------------------ served cycles

@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("start", [regime_state.SPEC, regime_state.PLAIN])
def test_regime_cycles_are_exact_and_leak_nothing(request, overlap, start):
    """Flip the regime every 7 iterations while requests arrive and finish: every plain step and spec
    round the modelled GPU runs is at the device's length, inside the host's reservation, with the
    right input token; the KV audit passes after every iteration; at the end every slot is free."""
    sim = cycle(_rng(request), overlap=overlap, start=start)
    assert regime_state.STATE.switches >= 6
    kinds = set(s for s in sim.steps if s is not None)
    assert {("decode", "plain"), ("decode", "spec"), ("extend", "plain"), ("extend", "spec")} <= kinds
    if overlap:
        assert sim.steps.count(None) >= regime_state.STATE.switches // 2      # the drains
    assert sim.pools.alloc.available_size() == POOL and sim.pools.r2t.available_size() == ROWS


def test_control_switching_without_the_drain_is_flagged(request, monkeypatch):
    """Control: convert with the last decode batch unprocessed (overlap): the stale host length is
    caught (a step at the wrong position, a freed reservation the round writes into, or the audit)."""
    monkeypatch.setattr(HOOK, "switch_step", lambda s, last: HOOK.WAIT if last is not None
                        and last.forward_mode.is_extend() else HOOK.CONVERT)
    with pytest.raises((SimError, RuntimeError)) as e:
        for _ in range(5):
            cycle(_rng(request), overlap=True)
            regime_state.disable()
    print("flagged by", e.type.__name__, e.value)


def test_control_switching_without_the_trim_is_flagged(request, monkeypatch):
    monkeypatch.setattr(RT, "_free_over_allocation", lambda *a: None)
    with pytest.raises(SimError, match="leak"):
        cycle(_rng(request), overlap=True)


def test_control_switching_right_after_a_prefill_is_flagged(request, monkeypatch):
    """Control: switch right after a prefill made in the old regime: the original then merges it into
    the converted running batch (or makes it the running batch): caught by the hook's regime check,
    DFlash's merge, or the modelled GPU."""
    real = HOOK.switch_step
    monkeypatch.setattr(HOOK, "switch_step", lambda s, last: HOOK.CONVERT if last is not None
                        and last.forward_mode.is_extend() else real(s, last))
    with pytest.raises((SimError, RuntimeError, AttributeError, AssertionError)) as e:
        for _ in range(5):
            cycle(_rng(request), overlap=True, every=3)
            regime_state.disable()
    print("flagged by", e.type.__name__, e.value)


def test_check_regime_flags_a_batch_of_the_other_regime(request):
    """The hook's post-check: a non-empty running batch or a new prefill in the other regime raises
    (e.g. a plain prefill that became the running batch of a spec regime, or a server whose
    ``init_new`` hook is missing); an empty running batch and the regime's own batches pass."""
    rng = _rng(request)
    pools = Pools()
    fm = ddtree().create_future_map(CPU, pools.r2t)
    plain = admit(pools, fm, [4, 5], SpeculativeAlgorithm.NONE, rng)
    spec = admit(pools, fm, [6], ddtree(), rng)
    empty = ScheduleBatch(reqs=[], batch_is_full=False)
    HOOK.check_regime(NextBatchPlan(batch_to_run=plain, running_batch=empty), regime_state.PLAIN)
    HOOK.check_regime(NextBatchPlan(batch_to_run=spec, running_batch=spec), regime_state.SPEC)
    with pytest.raises(RuntimeError, match="running batch is in"):
        HOOK.check_regime(NextBatchPlan(batch_to_run=None, running_batch=plain), regime_state.SPEC)
    with pytest.raises(RuntimeError, match="new prefill batch"):
        HOOK.check_regime(NextBatchPlan(batch_to_run=spec, running_batch=empty), regime_state.PLAIN)


def test_the_hook_applies_to_sglangs_scheduler_through_the_hook_registry():
    """install() registers an AROUND hook on the real ``Scheduler.get_next_batch_to_run``: applied,
    a pending switch after a queued decode batch returns the drain plan without the original."""
    import inspect

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = Scheduler.__dict__["get_next_batch_to_run"]
    saved = (HookRegistry._hooks, HookRegistry._patched)
    Scheduler.get_next_batch_to_run = inspect.unwrap(before)
    HookRegistry._hooks, HookRegistry._patched = collections.defaultdict(list), set()
    try:
        HOOK.install()
        HookRegistry.apply_hooks()
        assert HOOK.TARGET in HookRegistry._patched
        assert Scheduler.get_next_batch_to_run is not inspect.unwrap(before)
        regime_state.enable(regime_state.SPEC)
        regime_state.request(regime_state.PLAIN)
        sched = _fake_scheduler(True, 1)
        running = ScheduleBatch(reqs=[], batch_is_full=False)
        plan = Scheduler.get_next_batch_to_run(sched, running_batch=running, last_batch=_Fake(ForwardMode.DECODE))
        assert plan.batch_to_run is None and plan.running_batch is running
    finally:
        Scheduler.get_next_batch_to_run = before
        HookRegistry._hooks, HookRegistry._patched = saved
