"""The drafter's context K/V after a plain stretch (issue 52 item 1, ``docs/plain_regime_design.md``
section 3 "Entering and leaving speculation", step 5 of section 6).

DFlash's drafter attends to a context K/V per target token, written at the token's target KV slot
from the token's target aux hidden state and position only (``DFlashWorkerV2.
_append_target_hidden_to_draft_kv_by_loc``).  The DDTree worker writes it at prefill, at every
round's commit and at the no-speculation catch-up's flush; plain-regime batches
(``DDTreeWorker._forward_plain_batch``) write target K/V only.  A request that lived through a plain
stretch, one admitted while plain, or one whose radix-cache prefix was computed while plain then
drafts against stale slots: its outputs stay exact (the verify decides), its acceptance collapses.

* :class:`DrafterOk`: ``[num_slots] uint8`` on the device, 1 where the drafter's context K/V at
  that target KV slot belongs to the slot's current target K/V.  Set by every drafter context write,
  cleared by every plain-regime target write; one scatter per batch, no host read.  Per slot, not
  per request: a cached prefix computed while plain is stale for every request that reads it.
* :class:`DrafterRebuild`: at the first speculative decode launch after a switch (the worker sees
  ``regime_state.STATE.switches`` change), for each request the first stale position ``s`` in
  ``[max(0, C - W), C)`` (C = ``req.kv_committed_len``), then ``[s, C)`` rebuilt: one target EXTEND
  forward (``CaptureHiddenMode.FULL``, prefix ``[0, s)`` read through ``req_to_token``) whose own
  K/V goes to SCRATCH slots, the drafter's context written at the REAL slots
  ``req_to_token[row, s:C]``, the scratch freed, the map set.

Why ``[s, C)`` whole and not only the stale positions: an extend computes a contiguous run after a
prefix, so the positions between two stale runs would be recomputed anyway; rewriting a valid
drafter slot from a recomputed hidden state changes it by bf16 noise only.  Why scratch slots:
recomputed target K/V is not bit-identical to the K/V the decode wrote, and the target's own K/V
must stay what plain decoding wrote so that outputs stay token-identical.

What a rebuild costs is measured and handed to the regime controller as the switch's time, not
speculation's (:meth:`DrafterRebuild.take_seconds`): two CUDA events, one recorded before the plan's
host read (it fires when the GPU has finished the work before the rebuild) and one after the
context write, so their interval holds the rebuild's GPU work and the bubble its host read leaves;
read without waiting (an event not yet reached stays for a later launch).

Host synchronisation: :meth:`DrafterRebuild.plan` reads the per-request first stale positions
(``[bs]`` ints) once per rebuild, i.e. once per plain -> spec switch (plus once per spec prefill
that hit a cached prefix after a plain stretch, :data:`RECHECK_CACHED_PREFIXES`).  Nothing else
reads a device value.  Without free KV for the scratch slots the rebuild shrinks to what fits or
is skipped (logged once): stale drafter context only lowers acceptance.

Checked against SGLang 0.5.16: ``ForwardBatch.init_new`` (``model_executor/forward_batch_info.py``)
from a ``ScheduleBatch`` (``managers/schedule_batch.py``) made for the rebuild; the extend backends
read the prefix through ``req_to_token`` (``layers/attention/triton_backend.py``
``init_forward_metadata`` kv_indices over ``extend_prefix_lens``; ``flashinfer_backend.py``
``update`` with ``use_ragged``: paged over ``prefix_lens``) and the extend tokens' K/V from the
forward's own k/v (triton ``extend_attention_fwd``; flashinfer ragged), or, in flashinfer's
paged-only mode, through ``req_to_token[row, s:C]``, i.e. the decode-time K/V at the real slots,
which is valid K/V of the same tokens (so the hidden states are valid either way, and the real
slots are never written: writes go to ``out_cache_loc``).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, List, Optional, Sequence

import torch

from .tree_ops import host_to_device

logger = logging.getLogger(__name__)

WINDOW: Optional[int] = None
"""Positions per request the rebuild looks at: ``[max(0, C - WINDOW), C)``; None: all of ``[0, C)``.
**Assumption, to be measured** (acceptance after re-entry against ``WINDOW``): the drafter needs
its recent context most, so a bound would lose little.  The total is capped anyway at one extend
(:class:`DrafterRebuild` ``max_tokens``), which keeps each request's most recent positions."""

RECHECK_CACHED_PREFIXES = True
"""After any plain-regime write, a speculative prefill that reuses a cached prefix asks for a rebuild
check at the next speculative decode launch (the prefix may have been computed while plain): one
host read each such time."""


class DrafterOk:
    """``valid [num_slots] uint8`` (device): 1 where the drafter's context K/V at that target KV slot is
    the one of the slot's current token.  Slot 0 is SGLang's padding slot (never handed out)."""

    def __init__(self, num_slots: int, device):
        if num_slots < 2:
            raise ValueError(f"DrafterOk needs a KV pool of at least one slot besides slot 0, got "
                             f"num_slots={num_slots}")
        self.valid = torch.zeros((int(num_slots),), dtype=torch.uint8, device=device)

    @property
    def num_slots(self) -> int:
        return int(self.valid.shape[0])

    def mark_drafted(self, cache_loc: torch.Tensor, *, cache_loc_2d: Optional[torch.Tensor] = None,
                     commit_lens: Optional[torch.Tensor] = None) -> None:
        """A drafter context write: ``cache_loc [T]`` slots valid; or, with ``cache_loc_2d [bs, B]`` and
        ``commit_lens [bs]`` (a round's commit, SGLang's prefix-valid write), slot ``[b, j]`` valid iff
        ``j < commit_lens[b]``, else invalid (the draft block's own forward wrote noise there)."""
        if cache_loc_2d is None:
            self.valid.index_fill_(0, cache_loc.reshape(-1).to(torch.int64), 1)
            return
        if commit_lens is None:
            raise ValueError("DrafterOk.mark_drafted: cache_loc_2d needs commit_lens")
        width = cache_loc_2d.shape[1]
        dev = cache_loc_2d.device
        ok = torch.arange(width, device=dev) < commit_lens.reshape(-1, 1).to(dev)      # [bs, B]
        self.valid.index_put_((cache_loc_2d.reshape(-1).to(torch.int64),), ok.reshape(-1).to(torch.uint8))

    def clear(self, cache_loc: torch.Tensor) -> None:
        """A target write without a drafter write (a plain-regime batch): ``cache_loc [T]`` stale."""
        self.valid.index_fill_(0, cache_loc.reshape(-1).to(torch.int64), 0)

    def first_stale(self, req_to_token: torch.Tensor, rows: torch.Tensor, committed: torch.Tensor,
                    lower: torch.Tensor, max_len: int) -> torch.Tensor:
        """Per request b the first position p in ``[lower[b], committed[b])`` whose slot
        ``req_to_token[rows[b], p]`` is stale, else ``committed[b]`` -> ``[bs]`` int64 (device).
        rows / committed / lower: ``[bs]`` int64 device; ``max_len`` >= max(committed) (host)."""
        if max_len <= 0:
            return committed.clone()
        pos = torch.arange(max_len, device=committed.device, dtype=torch.int64)
        slots = req_to_token[rows, :max_len].to(torch.int64)                # [bs, max_len]
        inside = (pos >= lower.view(-1, 1)) & (pos < committed.view(-1, 1))
        stale = inside & (self.valid[slots] == 0)
        big = torch.full_like(slots, max_len)
        first = torch.where(stale, pos.expand_as(slots), big).amin(dim=1)
        return torch.minimum(first, committed)


def token_ids(req, start: int, end: int) -> List[int]:
    """Token ids of ``req`` at positions ``[start, end)``: ``origin_input_ids + output_ids`` (SGLang
    0.5.16 ``Req``; position p < C holds the token whose target K/V is at ``req_to_token[row, p]``)."""
    origin, output = req.origin_input_ids, req.output_ids
    n0 = len(origin)
    if end > n0 + len(output):
        raise RuntimeError(f"drafter rebuild: request {req.rid!r} has {n0} prompt + {len(output)} output "
                           f"tokens, fewer than the {end} positions to rebuild")
    ids = [int(t) for t in origin[start:min(end, n0)]] if start < n0 else []
    if end > n0:
        ids += [int(t) for t in output[max(start - n0, 0):end - n0]]
    return ids


def cap_ranges(counts: Sequence[int], cap: int) -> List[int]:
    """Per-request token counts cut to a total of at most ``cap``: ``min(count, w)`` with the largest
    such per-request bound ``w`` (each request keeps its most recent positions)."""
    if cap <= 0:
        return [0] * len(counts)
    if sum(counts) <= cap:
        return list(counts)
    lo, hi = 0, max(counts)
    while lo < hi:                      # largest w with sum(min(c, w)) <= cap
        mid = (lo + hi + 1) // 2
        if sum(min(c, mid) for c in counts) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return [min(c, lo) for c in counts]


@dataclasses.dataclass
class RebuildPlan:
    """What one rebuild recomputes: ``reqs[i]`` at positions ``[starts[i], ends[i])`` (host ints, only
    requests with something to rebuild); ``stale_tokens``: what the map found before the cap."""

    reqs: list
    starts: List[int]
    ends: List[int]
    stale_tokens: int

    @property
    def tokens(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))


class DrafterRebuild:
    """The map and the rebuild at re-entry (module docstring).  ``num_slots``: the target KV pool's
    slots + 1 (slot 0 is the padding slot); ``max_tokens``: the most positions one rebuild recomputes
    (one extend; the server's ``max_prefill_tokens``); ``window``: :data:`WINDOW`."""

    def __init__(self, num_slots: int, device, *, max_tokens: int, window: Optional[int] = WINDOW,
                 algo: str = "DDTREE"):
        if max_tokens < 1:
            raise ValueError(f"DrafterRebuild: max_tokens must be >= 1, got {max_tokens}")
        if window is not None and window < 1:
            raise ValueError(f"DrafterRebuild: window must be None or >= 1, got {window}")
        self.ok = DrafterOk(num_slots, device)
        self.device = device
        self.max_tokens = int(max_tokens)
        self.window = window
        self.algo = algo
        self.pending = False            # a rebuild check is due at the next speculative decode launch
        self.plain_seen = False         # a plain-regime write happened (cached prefixes may be stale)
        self._switches_seen = 0
        self._logged = set()
        self.rebuilds = 0
        self.rebuilt_tokens = 0
        self.skipped_tokens = 0
        self._timed: List[tuple] = []   # (start, end) events of runs whose time is not yet taken
        self.charged_s = 0.0            # the time taken so far (s)

    # ---------------------------------------------------------------- the map's upkeep
    def drafted(self, cache_loc, *, cache_loc_2d=None, commit_lens=None) -> None:
        """Every drafter context write (prefill, commit, catch-up flush, rebuild)."""
        self.ok.mark_drafted(cache_loc, cache_loc_2d=cache_loc_2d, commit_lens=commit_lens)

    def plain_write(self, out_cache_loc: Optional[torch.Tensor]) -> None:
        """A plain-regime batch's target writes (``out_cache_loc [T]``, prefill or decode)."""
        if out_cache_loc is None:
            raise RuntimeError(f"{self.algo}: a plain-regime batch without out_cache_loc (its target "
                               "K/V slots must be marked stale for the drafter)")
        self.ok.clear(out_cache_loc)
        self.plain_seen = True

    def spec_prefill(self, prefix_lens: Sequence[int]) -> None:
        """A speculative prefill (host ``prefix_lens``): a cached prefix may be stale after plain."""
        if RECHECK_CACHED_PREFIXES and self.plain_seen and any(int(p) > 0 for p in prefix_lens):
            self.pending = True

    def due(self, switches: int) -> bool:
        """At a speculative decode launch: a rebuild check is due (a switch since the last one, or a
        cached prefix after plain).  Host values only."""
        if switches != self._switches_seen:
            self._switches_seen = switches
            self.pending = True
        return self.pending

    # ---------------------------------------------------------------- the rebuild
    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("%s drafter rebuild: " + msg, self.algo, *args)

    def plan(self, reqs, req_to_token: torch.Tensor, *, available: Optional[int] = None) -> RebuildPlan:
        """The positions to rebuild per request (the one host read: ``[bs]`` first stale positions).
        ``available``: free KV slots for the scratch (None: no bound)."""
        live, committed, rows = [], [], []
        for req in reqs:
            if any(getattr(req, f, None) is not None for f in ("multimodal_inputs", "input_embeds")):
                self._log_once("mm", "requests with multimodal inputs or input embeddings are not rebuilt "
                               "(their ids alone do not give their embeddings)")
                continue
            c = int(req.kv_committed_len)
            if c > 0:
                live.append(req)
                committed.append(c)
                rows.append(int(req.req_pool_idx))
        if not live:
            return RebuildPlan([], [], [], 0)
        lower = [0 if self.window is None else max(0, c - self.window) for c in committed]
        dev = req_to_token.device
        first = self.ok.first_stale(req_to_token, host_to_device(rows, dev, torch.int64),
                                    host_to_device(committed, dev, torch.int64),
                                    host_to_device(lower, dev, torch.int64), max(committed))
        first_host = first.tolist()            # the one host read per rebuild (module docstring)
        counts = [c - int(s) for c, s in zip(committed, first_host)]
        stale = sum(counts)
        cap = self.max_tokens if available is None else min(self.max_tokens, int(available))
        kept = cap_ranges(counts, cap)
        if sum(kept) < stale:
            self.skipped_tokens += stale - sum(kept)
            self._log_once("cap", "%d stale positions, %d rebuilt (max_tokens %d, free KV %s): each "
                           "request keeps its most recent ones", stale, sum(kept), self.max_tokens,
                           "n/a" if available is None else available)
        out = RebuildPlan([], [], [], stale)
        for req, c, k in zip(live, committed, kept):
            if k > 0:
                out.reqs.append(req)
                out.starts.append(c - k)
                out.ends.append(c)
        return out

    def run(self, reqs, *, req_to_token: torch.Tensor, allocator, build_forward_batch: Callable,
            target_forward: Callable, append: Callable) -> int:
        """Rebuild the stale drafter context of ``reqs`` (the speculative batch about to run); returns
        the positions rebuilt.

        ``allocator``: the target's token allocator (``available_size()``, ``alloc(n)`` -> ``[n]``
        slots or None, ``free(slots)``); ``build_forward_batch(plan, scratch [T])`` -> the EXTEND
        ``ForwardBatch`` (:func:`extend_forward_batch`); ``target_forward(fb)`` -> a result whose
        ``logits_output.hidden_states`` is ``[T, H_aux]``; ``append(target_hidden=, cache_loc=,
        positions=)``: the drafter's context write (not marking the map: done here)."""
        self.pending = False
        start = _event(req_to_token.device)
        try:
            return self._run(reqs, req_to_token, allocator, build_forward_batch, target_forward, append)
        finally:
            end = _event(req_to_token.device)
            self._timed.append((start, end))

    def take_seconds(self) -> float:
        """The time (s) of the finished rebuilds not yet taken, from their events; never waits (a
        rebuild the GPU has not finished stays for a later call)."""
        done = [(a, b) for a, b in self._timed if b.query()]
        if not done:
            return 0.0
        self._timed = [x for x in self._timed if x not in done]
        s = sum(max(0.0, a.elapsed_time(b)) for a, b in done) / 1e3
        self.charged_s += s
        return s

    def _run(self, reqs, req_to_token, allocator, build_forward_batch, target_forward, append) -> int:
        plan = self.plan(reqs, req_to_token, available=allocator.available_size())
        total = plan.tokens
        if total == 0:
            return 0
        scratch = allocator.alloc(total)
        if scratch is None:
            self.skipped_tokens += total
            self._log_once("alloc", "no %d free KV slots for the scratch extend: skipped (drafter context "
                           "stays stale: acceptance only, outputs exact)", total)
            return 0
        try:
            fb = build_forward_batch(plan, scratch)
            out = target_forward(fb)
            hidden = out.logits_output.hidden_states
            if hidden is None or hidden.shape[0] != total:
                raise RuntimeError(f"{self.algo} drafter rebuild: the target extend returned hidden states "
                                   f"{None if hidden is None else tuple(hidden.shape)}, expected {total} "
                                   "rows (CaptureHiddenMode.FULL and the drafter's aux layers)")
            positions = fb.positions.to(torch.int64)
            token_rows = host_to_device([int(r.req_pool_idx) for r, s, e in zip(plan.reqs, plan.starts, plan.ends)
                                         for _ in range(e - s)], req_to_token.device, torch.int64)
            real_loc = req_to_token[token_rows, positions].to(torch.int64)          # [T]
            append(target_hidden=hidden, cache_loc=real_loc, positions=positions)
            out.logits_output.hidden_states = None
        finally:
            allocator.free(scratch)
        self.ok.mark_drafted(real_loc)
        self.rebuilds += 1
        self.rebuilt_tokens += total
        return total


class _HostEvent:
    """:class:`torch.cuda.Event`'s four calls on the host clock, for a device without CUDA events
    (the CPU, where the work is done when the call returns)."""

    def __init__(self):
        import time
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


def _event(device):
    """A timing event recorded now on ``device``'s current stream (CUDA), or on the host clock."""
    if torch.device(device).type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return _HostEvent()


def extend_forward_batch(plan: RebuildPlan, scratch: torch.Tensor, *, model_runner, spec_algorithm,
                         device):
    """The rebuild's EXTEND ``ForwardBatch``: SGLang's ``ForwardBatch.init_new`` from a
    ``ScheduleBatch`` made for it (as a prefill batch carries them: ``prefix_lens`` = starts,
    ``extend_lens`` = ends - starts as host lists, ``seq_lens`` = ends, ``out_cache_loc`` = ``scratch``
    [T], ``input_ids`` [T] the requests' token ids at those positions, ``spec_algorithm`` the server's,
    no sampling info, no logprobs) with ``CaptureHiddenMode.FULL``.  init_new computes ``positions``
    and ``extend_start_loc`` (``compute_position``) and the device copies of the lengths."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    lens = [e - s for s, e in zip(plan.starts, plan.ends)]
    total = sum(lens)
    if scratch.shape[0] != total:
        raise ValueError(f"extend_forward_batch: {scratch.shape[0]} scratch slots for {total} tokens")
    ids: List[int] = []
    for req, s, e in zip(plan.reqs, plan.starts, plan.ends):
        ids += token_ids(req, s, e)
    rows = [int(r.req_pool_idx) for r in plan.reqs]
    sb = ScheduleBatch(
        reqs=list(plan.reqs), req_to_token_pool=model_runner.req_to_token_pool,
        token_to_kv_pool_allocator=getattr(model_runner, "token_to_kv_pool_allocator", None),
        model_config=model_runner.model_config, device=str(device), forward_mode=ForwardMode.EXTEND,
        input_ids=host_to_device(ids, device, torch.int64),
        req_pool_indices=host_to_device(rows, device, torch.int64),
        seq_lens=host_to_device(plan.ends, device, torch.int64),
        orig_seq_lens=host_to_device(plan.ends, device, torch.int32),
        seq_lens_cpu=torch.tensor(plan.ends, dtype=torch.int64), seq_lens_sum=int(sum(plan.ends)),
        out_cache_loc=scratch.to(torch.int64), prefix_lens=list(plan.starts), extend_lens=lens,
        extend_logprob_start_lens=list(lens), extend_num_tokens=total, is_extend_in_batch=True,
        return_logprob=False, spec_algorithm=spec_algorithm)
    return ForwardBatch.init_new(sb, model_runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                 return_hidden_states_before_norm=False)
