"""Convert SGLang's running ``ScheduleBatch`` between the spec and the plain regime (issue 52 item 1,
``docs/plain_regime_design.md`` section 2(b), "The transition").

SGLang 0.5.16 takes the speculative or the plain path per batch from ``batch.spec_algorithm``; a
running batch made in one regime carries that regime's bookkeeping, which the other path would
misread.  The two functions here rewrite it; ``patches/regime_transition.py`` calls them at a safe
point (every request's host length exact, see there).  ``S/`` below is ``sglang/srt/`` of 0.5.16.

Lengths, as SGLang keeps them (host ``req.kv_committed_len`` = C, ``req.kv.kv_allocated_len`` = A,
once the last batch's result was processed):

* Both regimes: C = the tokens whose target K/V is written, ``len(origin_input_ids) +
  len(output_ids) - 1``; the last output token (plain: the sampled token; spec: the round's bonus) is
  NOT in the K/V, it is the next step's input, at position C, and it sits in
  ``FutureMap.output_tokens_buf[req_pool_idx]`` (``S/managers/scheduler.py:3517
  _relay_forward_payload``: ``next_draft_input.bonus_tokens`` for a spec batch, ``next_token_ids``
  for a plain one, ``FutureMap.stash``, ``S/managers/overlap_utils.py:501``).  Prefill sets C = A = the prompt
  length (``S/managers/schedule_batch.py:2220``, ``S/mem_cache/allocation.py:399``).
* Plain: ``prepare_for_decode`` (``schedule_batch.py:2785``) allocates one slot at position
  ``batch.seq_lens`` (``alloc_for_decode``, ``allocation.py:539``: ``req_to_token[row, seq_lens] =
  new slot``, A += 1), then C += 1 and ``seq_lens`` / ``seq_lens_cpu`` / ``orig_seq_lens`` += 1
  before the forward.  So after a plain step (processed or not) C = A = ``seq_lens`` =
  ``seq_lens_cpu``: the host is never behind in plain decoding (one token a step).  The step's
  publish is ``seq_lens + 1`` (``scheduler.py:3355``), one past spec's meaning; plain batches never
  read it (``resolve_seq_lens_cpu`` needs ``spec_info.future_indices``).
* Spec (DFlash v2, DDTree): ``DFlashDraftInputV2.prepare_for_decode``
  (``S/speculative/dflash_info_v2.py:113``) leaves C alone, reserves A = max(A, C + 2N) (wider
  under ``patches/dflash_prepare_for_decode.py``) and seeds ``seq_lens_cpu`` = C; under overlap the
  device ``seq_lens`` is re-read from ``FutureMap.new_seq_lens_buf`` (``resolve_seq_lens_cpu``,
  ``overlap_utils.py:412``), which the round publishes as C + accepted; result processing adds the
  accepted count to C (``batch_result_processor.py:591``).  ``_forward_isolation``
  (``scheduler.py:3246``) restores the batch's ``seq_lens`` after the round, so the running batch's
  ``seq_lens`` / ``seq_lens_cpu`` lag one round and A > C (the unused reservation).
"""
from __future__ import annotations

from typing import List

import torch


def _live_reqs_check(batch, where: str) -> None:
    """Every request of ``batch`` holds its KV row (finished ones must be filtered out first)."""
    rows = []
    for i, req in enumerate(batch.reqs):
        if req.kv is None or req.req_pool_idx is None:
            raise RuntimeError(f"{where}: request {req.rid!r} (batch row {i}) has released its KV "
                               "(finished or retracted): filter the batch (ScheduleBatch.filter_batch) "
                               "before converting it")
        rows.append(int(req.req_pool_idx))
    idx_cpu = [int(x) for x in batch.req_pool_indices_cpu.tolist()] \
        if batch.req_pool_indices_cpu is not None else None
    if idx_cpu is not None and idx_cpu != rows:
        raise RuntimeError(f"{where}: batch.req_pool_indices_cpu {idx_cpu} disagrees with the requests' "
                           f"req_pool_idx {rows}")
    if len(set(rows)) != len(rows):
        raise RuntimeError(f"{where}: a req_to_token row appears twice in the batch: {rows}")


def _free_over_allocation(req, committed: int, allocated: int, tree_cache) -> None:
    """Give ``req_to_token[row, committed:allocated]`` back to the token allocator: SGLang's own
    finish-time trim (``S/mem_cache/common.py:177 _release_overallocated_kv_indices``: from
    ``ceil_align(committed, page_size)`` with pages, the partial page stays with the request)."""
    from sglang.srt.mem_cache.common import _release_overallocated_kv_indices

    _release_overallocated_kv_indices(req, committed, allocated, tree_cache)


def _lengths_to_device(values: List[int], device, dtype) -> torch.Tensor:
    from sglang.srt.utils.common import is_pin_memory_available

    host = torch.tensor(values, dtype=dtype, pin_memory=is_pin_memory_available(device))
    return host.to(device, non_blocking=True)


def _set_lengths(batch, committed: List[int]) -> None:
    """``seq_lens`` (device int64), ``seq_lens_cpu`` (int64), ``orig_seq_lens`` (device int32) and
    ``seq_lens_sum`` = the committed lengths [bs]."""
    batch.seq_lens = _lengths_to_device(committed, batch.device, torch.int64)
    batch.seq_lens_cpu = torch.tensor(committed, dtype=torch.int64)
    batch.orig_seq_lens = _lengths_to_device(committed, batch.device, torch.int32)
    batch.seq_lens_sum = int(sum(committed))


def spec_to_plain(batch) -> List[int]:
    """Make the spec running ``batch`` (bs requests, ``spec_algorithm`` a DFlash-family one) a plain
    one; returns the slots given back to the allocator per request ([bs] ints).

    Precondition: every request's host C (``req.kv_committed_len``) is exact, i.e. the last batch's
    result was processed (the hook's drain), and finished requests were filtered out.  Per request
    ``req_to_token[row, C:A]`` (the spec reservation) goes back to the allocator and A := C; then
    ``seq_lens`` / ``seq_lens_cpu`` / ``orig_seq_lens`` = C, ``seq_lens_sum`` = sum C,
    ``spec_info = None``, ``spec_algorithm = NONE``, ``input_ids = None``.  The next plain
    ``prepare_for_decode`` then finds C = A = ``seq_lens`` (what plain decoding keeps) and allocates
    exactly one slot, at position C, where the bonus token's K/V goes.  The input token itself is
    ``FutureMap.output_tokens_buf[req_pool_indices]``: the spec round's relay stashed its bonus there
    (``scheduler.py:3517``, ``RelayPayload.from_draft_input``); SGLang gathers it for a plain batch
    only when the map's ``spec_algo`` is NONE (``overlap_utils.py:105``), so on a DDTREE server the
    worker (or ``patches/regime_forward_inputs.py``) gathers it when ``input_ids is None``."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if batch.spec_algorithm is None or batch.spec_algorithm.is_none():
        raise RuntimeError("spec_to_plain: the batch is not a speculative batch "
                           f"(spec_algorithm={batch.spec_algorithm!r})")
    _live_reqs_check(batch, "spec_to_plain")
    committed, freed = [], []
    for req in batch.reqs:
        c, a = int(req.kv_committed_len), int(req.kv.kv_allocated_len)
        if a < c:
            raise RuntimeError(f"spec_to_plain: request {req.rid!r} has kv_committed_len {c} > "
                               f"kv_allocated_len {a}")
        before = batch.token_to_kv_pool_allocator.available_size()
        if a > c:
            _free_over_allocation(req, c, a, batch.tree_cache)
        req.kv.kv_allocated_len = c
        freed.append(batch.token_to_kv_pool_allocator.available_size() - before)
        committed.append(c)
    _set_lengths(batch, committed)
    batch.spec_info = None
    batch.spec_algorithm = SpeculativeAlgorithm.NONE
    batch.input_ids = None
    batch.out_cache_loc = None
    return freed


def plain_to_spec(batch, *, future_map, spec_algorithm) -> None:
    """Make the plain running ``batch`` (bs requests, ``spec_algorithm`` NONE) a spec one of
    ``spec_algorithm`` (the server's DFlash-family algorithm, e.g. DDTREE-GPU).

    Precondition: the last batch's result was processed (its publish and stash on the forward
    stream are complete, so nothing overwrites what is written here) and finished requests were
    filtered out.  A plain request has C = A (asserted: a plain batch never over-allocates) and its
    next input token, at position C, in ``future_map.output_tokens_buf[row]``.  Sets
    ``spec_info = make_draft_input_v2(bonus_tokens=output_tokens_buf[rows], new_seq_lens=C)`` with,
    under overlap scheduling (``batch.enable_overlap``), ``future_indices = req_pool_indices`` (as
    ``run_batch``'s overlap branch leaves it, ``scheduler.py:3404-3409``: ``resolve_seq_lens_cpu`` and
    ``_resolve_spec_extras`` gather through it; the latter re-reads the bonus from the same buffer on
    the forward stream).  Without overlap ``future_indices`` stays None as ``run_batch``'s synchronous
    branch leaves it (l.3423): ``DFlashDraftInputV2.filter_batch`` / ``merge_batch`` then carry
    ``bonus_tokens`` itself, which the worker reads.  Publishes C
    (``future_map.publish(rows, C)``: the next ``resolve_seq_lens_cpu`` sets ``seq_lens`` = C, where
    plain's own publish left C + 1), sets ``seq_lens`` / ``seq_lens_cpu`` / ``seq_lens_sum`` = C
    (what the non-overlap spec path reads directly), ``spec_algorithm`` and ``input_ids = None``.
    The next spec ``prepare_for_decode`` reserves from A = C."""
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    if batch.spec_algorithm is None or not batch.spec_algorithm.is_none():
        raise RuntimeError("plain_to_spec: the batch is not a plain batch "
                           f"(spec_algorithm={batch.spec_algorithm!r})")
    if spec_algorithm is None or spec_algorithm.is_none() or not spec_algorithm.is_dflash_family():
        raise ValueError(f"plain_to_spec: {spec_algorithm!r} is not a DFlash-family speculative algorithm")
    if future_map is None:
        raise ValueError("plain_to_spec: no FutureMap (the spec path relays through it)")
    _live_reqs_check(batch, "plain_to_spec")
    committed = []
    for req in batch.reqs:
        c, a = int(req.kv_committed_len), int(req.kv.kv_allocated_len)
        if a != c:
            raise RuntimeError(f"plain_to_spec: request {req.rid!r} has kv_allocated_len {a} != "
                               f"kv_committed_len {c} (a plain batch allocates one slot a step)")
        committed.append(c)
    _set_lengths(batch, committed)
    rows = batch.req_pool_indices
    draft_input = make_draft_input_v2(bonus_tokens=future_map.output_tokens_buf[rows],
                                      new_seq_lens=batch.seq_lens)
    if batch.enable_overlap:
        draft_input.future_indices = rows
    future_map.publish(rows, batch.seq_lens)
    batch.spec_info = draft_input
    batch.spec_algorithm = spec_algorithm
    batch.input_ids = None
    batch.out_cache_loc = None
