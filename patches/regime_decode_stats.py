"""Hook: ``SchedulerMetricsReporter.report_decode_stats`` (AROUND) -- a log interval of plain-regime batches only.

Why: SGLang 0.5.16's decode log line (every ``decode_log_interval`` decode batches) computes the
speculative acceptance as ``spec_num_accept_tokens / spec_num_forward_ct`` whenever the SERVER's
algorithm is speculative.  A DDTREE server in the plain regime (``sglang_ddtree/regime_state.py``)
runs batches that SGLang processes as plain decoding's, which add nothing to those counters, so a
log interval made only of them divided by zero and killed the scheduler (GPU test bed, s36: every
``_regimeplain`` / ``_regimecycle`` stage).  For such an interval this hook logs as plain decoding
does (SGLang's ``spec_algorithm.is_none()`` branch: acceptance fields 0), by showing the call the
NONE algorithm; an interval with speculative rounds keeps SGLang's own line.

Checked against: SGLang 0.5.16 (``sglang/srt/managers/scheduler_components/metrics_reporter.py``,
``SchedulerMetricsReporter.report_decode_stats(can_run_cuda_graph, running_batch=None,
num_correct_drafts=0)``, which reads ``self.scheduler.spec_algorithm`` and divides at l.763).
"""
from __future__ import annotations

TARGET = ("sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter"
          ".report_decode_stats")
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def report_plain_interval(original, self, *args, **kwargs):
    sched = self.scheduler
    algo = sched.spec_algorithm
    if self.spec_num_forward_ct or algo.is_none():
        return original(self, *args, **kwargs)
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ddtree.spec_algo import is_ddtree

    if not is_ddtree(algo):
        return original(self, *args, **kwargs)
    sched.spec_algorithm = SpeculativeAlgorithm.NONE
    try:
        return original(self, *args, **kwargs)
    finally:
        sched.spec_algorithm = algo


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, report_plain_interval, HookType.AROUND)
