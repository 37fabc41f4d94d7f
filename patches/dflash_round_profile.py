"""Hook: ``DFlashWorkerV2.forward_batch_generation`` (AROUND) -- stock DFLASH rounds profiled with
the same CUDA events and stages as DDTree's (``sglang_ddtree/profiling.py``).

Why: the A/B compares DDTREE-GPU's round with DFLASH's; DDTree's worker records its stage split
(``SGLANG_DDTREE_PROFILE_FILE``) and stock DFLASH records none, so the report could not show where
the two rounds differ (issue 12 item 3). Only when that variable is set, on a decode round of a
worker that does not profile itself (stock ``DFlashWorkerV2``, not DDTree's subclass), this hook
records one CUDA event at each stage boundary, through thin wrappers on that worker's instance:
the drafter runner's ``forward`` returning (draft; tree = 0), the target worker's verify forward
(``is_verify=True``) starting and returning (verify_prep, verify), the drafter context append
``_append_target_hidden_to_draft_kv_by_loc`` starting (accept: DFLASH's accept and bonus), the
round returning (commit: the append and the rest). A round whose marks did not all come is dropped.
No host synchronisation: the events are read once complete. Without the variable: one env lookup.

Checked against: SGLang 0.5.16 (``sglang/srt/speculative/dflash_worker_v2.py``: the decode branch
of ``forward_batch_generation`` calls ``self.draft_model_runner.forward``, then
``self.target_worker.forward_batch_generation(..., is_verify=True, ...)``, then
``self._append_target_hidden_to_draft_kv_by_loc``).
"""
from __future__ import annotations

import functools
import os

TARGET = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)
_STATE = "_ddtree_dflash_profiler"


def _wrap(obj, name, before=None, after=None):
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*a, **k):
        if before is not None:
            before(a, k)
        out = fn(*a, **k)
        if after is not None:
            after(a, k)
        return out
    setattr(obj, name, wrapped)


def _profiler(worker):
    """The worker's RoundProfiler, its stage wrappers installed on first use."""
    prof = worker.__dict__.get(_STATE)
    if prof is not None:
        return prof
    from sglang_ddtree.profiling import RoundProfiler

    prof = RoundProfiler(dict(algo="DFLASH", budget=None, block_size=int(getattr(worker, "block_size", 0) or 0),
                              topk=1))

    def at(mark_count, marks=1):
        def step(a, k):
            if prof.marks == mark_count:
                for _ in range(marks):
                    prof.mark()
        return step

    def verify_only(step):
        return lambda a, k: step(a, k) if k.get("is_verify") else None

    _wrap(worker.draft_model_runner, "forward", after=at(0, marks=2))        # draft, tree (= 0)
    _wrap(worker.target_worker, "forward_batch_generation",
          before=verify_only(at(2)), after=verify_only(at(3)))              # verify_prep, verify
    _wrap(worker, "_append_target_hidden_to_draft_kv_by_loc", before=at(4))  # accept
    worker.__dict__[_STATE] = prof
    return prof


def profiled_round(original, self, batch, *args, **kwargs):
    from sglang_ddtree.profiling import ENV_FILE, STAGES

    if (not os.environ.get(ENV_FILE) or getattr(self, "_profiles_its_rounds", False)
            or batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle()):
        return original(self, batch, *args, **kwargs)
    prof = _profiler(self)
    prof.begin()
    try:
        out = original(self, batch, *args, **kwargs)
    except BaseException:
        prof.cancel()
        raise
    if prof.marks == len(STAGES) - 1:
        prof.mark()                                                           # commit
        prof.end(len(batch.seq_lens))
    else:
        prof.cancel()
    return out


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, profiled_round, HookType.AROUND)
