"""Hook: ``Scheduler.get_next_batch_to_run`` (AROUND) -- switch the running batch between the spec and
the plain regime at a safe point (issue 52 item 1, ``docs/plain_regime_design.md`` section 2(b)).

Why: SGLang 0.5.16 picks the speculative or the plain decode path per batch from
``batch.spec_algorithm``.  New batches get the regime's algorithm (``patches/regime_batch_algo.py``),
but the running batch keeps the one it was made with, with that regime's lengths and KV
reservation.  Under overlap scheduling the host lags one batch: converting it while the last decode
batch's result is unprocessed would prepare the next batch from stale lengths (spec -> plain: a
plain step at a stale ``seq_lens`` overwrites a reserved ``req_to_token`` entry and leaks its slot,
and K/V lands at the wrong position; plain -> spec: the in-flight plain batch's publish of
``seq_lens + 1`` can land after ours).

What it does, while ``regime_state.STATE`` is enabled and a switch is pending (one call = one
scheduler iteration; ``event_loop_overlap`` / ``event_loop_normal``, ``scheduler.py:1520-1623``):

* WAIT (call the original unchanged, switch later) when the last batch was a prefill (the original
  must merge it into the running batch first, ``scheduler.py:2739-2764``: a prefill made in the old
  regime merged into a converted batch would carry the old regime's ``spec_info`` / algorithm:
  ``ScheduleBatch.merge_batch`` keeps the running batch's ``spec_algorithm`` and
  ``DFlashDraftInputV2.merge_batch(None)`` fails; into an empty running batch it would *become* the
  running batch), or while a chunked prefill is in progress (its next chunk is a prefill anyway).
* DRAIN under overlap when the last batch was a decode batch whose result is still queued
  (``self.result_queue``): return ``NextBatchPlan(None, running_batch)`` without calling the
  original; the loop then runs ``pop_and_process()`` for it (it does whenever ``self.last_batch`` is
  set, ``scheduler.py:1610-1612``) and the next call sees ``last_batch`` None and exact host
  lengths.  Non-overlap mode (``disable_overlap_schedule``) processes results inside the iteration:
  no drain.
* CONVERT: filter finished requests out of the running batch (``ScheduleBatch.filter_batch``, as
  ``update_running_batch`` would), convert it (``sglang_ddtree.regime_transition.spec_to_plain`` /
  ``plain_to_spec``), ``regime_state.switched()``, swap the delayer, then call the original (which
  makes new batches in the new regime).
* Delayer: a DFlash-family server gets a ``MinFreeSlotsDelayer`` by default (``scheduler.py:883-891``,
  ``min_free_slots_delayer.py``: prefills wait until 2-4 running slots are free, because each
  DFlash admission pays a drafter prefill); base gets one only from ``--min-free-slots-delay``.
  While plain, ``scheduler.min_free_slots_delayer`` is what base would build
  (``resolve_min_free_slots(user value, max_running_requests, is_dflash_family=False)``: None unless
  the user asked for one), and the server's own is restored in spec.
* Every call while enabled checks that the returned batches (non-empty running batch, a prefill to
  run) are in the current regime, and raises a RuntimeError otherwise.

TP: every rank's scheduler sees the same batches, so the WAIT / DRAIN / CONVERT decision, counted in
batches, is the same on every rank provided ``STATE.pending`` is set at the same iteration on every
rank (the regime controller's decision, broadcast from rank 0: not done here).  DP attention (each
rank its own batches, lock-stepped by the MLP sync) is refused at a switch with a RuntimeError.

Checked against: SGLang 0.5.16 (``sglang/srt/managers/scheduler.py``, ``Scheduler.get_next_batch_to_run``,
``event_loop_overlap``, ``event_loop_normal``, ``run_batch``, ``_relay_forward_payload``;
``managers/schedule_batch.py``, ``ScheduleBatch.prepare_for_decode`` / ``merge_batch`` /
``filter_batch``, ``NextBatchPlan``; ``mem_cache/allocation.py``, ``alloc_for_decode``;
``managers/overlap_utils.py``, ``FutureMap``; ``managers/min_free_slots_delayer.py``).
"""
from __future__ import annotations

import logging

TARGET = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)

WAIT, DRAIN, CONVERT = "wait", "drain", "convert"

_SPEC_DELAYER = "_ddtree_spec_min_free_slots_delayer"      # the server's own, saved at the first call
_DELAYER_REGIME = "_ddtree_min_free_slots_delayer_regime"  # the regime the current delayer is for

logger = logging.getLogger(__name__)


def switch_step(scheduler, last_batch) -> str:
    """WAIT, DRAIN or CONVERT for a pending switch at this call (see the module docstring)."""
    if last_batch is not None and last_batch.forward_mode.is_extend():
        return WAIT
    if getattr(scheduler, "chunked_req", None) is not None:
        return WAIT
    queued = len(getattr(scheduler, "result_queue", None) or ())
    if scheduler.enable_overlap and queued:
        if last_batch is None:
            raise RuntimeError(f"regime transition: {queued} batch result(s) queued with no last batch "
                               "(the overlap loop processes the last batch's result every iteration)")
        return DRAIN
    return CONVERT


def _plain_delayer(scheduler):
    """The delayer a base (non-speculative) server with these arguments has."""
    from sglang.srt.managers.min_free_slots_delayer import MinFreeSlotsDelayer, resolve_min_free_slots

    n = resolve_min_free_slots(getattr(scheduler.server_args, "min_free_slots_delay", None),
                               scheduler.max_running_requests, is_dflash_family=False)
    return None if n is None else MinFreeSlotsDelayer(min_free_slots=n)


def sync_delayer(scheduler, regime: str) -> None:
    """``scheduler.min_free_slots_delayer`` for ``regime``: the server's own in spec, base's in plain."""
    from sglang_ddtree.regime_state import PLAIN

    if not hasattr(scheduler, _SPEC_DELAYER):
        setattr(scheduler, _SPEC_DELAYER, scheduler.min_free_slots_delayer)
        setattr(scheduler, _DELAYER_REGIME, None)
    if getattr(scheduler, _DELAYER_REGIME) == regime:
        return
    scheduler.min_free_slots_delayer = (_plain_delayer(scheduler) if regime == PLAIN
                                        else getattr(scheduler, _SPEC_DELAYER))
    setattr(scheduler, _DELAYER_REGIME, regime)


def convert_running_batch(scheduler, running_batch, to: str) -> None:
    """Filter finished requests out of ``running_batch``, then convert it to regime ``to`` in place
    (nothing to convert when it is empty: the next prefill replaces an empty running batch)."""
    from sglang_ddtree.regime_state import PLAIN, SPEC
    from sglang_ddtree.regime_transition import plain_to_spec, spec_to_plain

    if to not in (PLAIN, SPEC):
        raise ValueError(f"regime transition: unknown regime {to!r}")
    if running_batch.is_empty():
        return
    bs = running_batch.batch_size()
    running_batch.filter_batch()
    if running_batch.batch_size() < bs:
        running_batch.batch_is_full = False
    if running_batch.is_empty():
        return
    if to == PLAIN:
        freed = spec_to_plain(running_batch)
        logger.debug("regime transition -> plain: bs=%d, %d reserved KV slots freed", bs, sum(freed))
    else:
        plain_to_spec(running_batch, future_map=scheduler.future_map, spec_algorithm=scheduler.spec_algorithm)


def check_regime(plan, regime: str) -> None:
    """RuntimeError when the plan's non-empty running batch or its prefill is not in ``regime``."""
    from sglang_ddtree.regime_state import PLAIN

    def wrong(b):
        return b.spec_algorithm is not None and b.spec_algorithm.is_none() != (regime == PLAIN)

    rb, b = plan.running_batch, plan.batch_to_run
    if rb is not None and not rb.is_empty() and wrong(rb):
        raise RuntimeError(f"regime transition: the running batch is in spec_algorithm "
                           f"{rb.spec_algorithm!r} while the regime is {regime!r}")
    if b is not None and b is not rb and b.forward_mode.is_extend() and wrong(b):
        raise RuntimeError(f"regime transition: a new prefill batch has spec_algorithm "
                           f"{b.spec_algorithm!r} while the regime is {regime!r} "
                           "(is patches/regime_batch_algo.py installed?)")


def get_next_batch_at_regime_switch(original, self, running_batch, last_batch, *args, **kwargs):
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    from sglang_ddtree import regime_state

    st = regime_state.STATE
    if not st.enabled:
        return original(self, running_batch, last_batch, *args, **kwargs)
    sync_delayer(self, st.regime)
    if st.pending is not None:
        if getattr(self, "require_mlp_sync", False):
            raise RuntimeError("regime transition: regime switches are not supported with DP attention "
                               "(require_mlp_sync: the ranks' batches differ)")
        step = switch_step(self, last_batch)
        if step == DRAIN:
            return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
        if step == CONVERT:
            convert_running_batch(self, running_batch, st.pending)
            regime_state.switched()
            sync_delayer(self, st.regime)
    plan = original(self, running_batch, last_batch, *args, **kwargs)
    check_regime(plan, st.regime)
    return plan


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, get_next_batch_at_regime_switch, HookType.AROUND)
