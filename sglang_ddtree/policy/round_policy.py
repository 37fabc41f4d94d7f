"""The round's policy behind two calls (issue 52 item 3): :class:`RoundPolicy`.

A decode round asks once for its plan and reports once what happened::

    plan = policy.plan(BatchView(bs, reqs, kv_tokens))          # before the draft (host values only)
    ...draft if plan.drafts, build the tree of plan.width, estimate = plan.estimate(...) if
       plan.estimates, verify (plan.width == NO_SPEC: SGLang's plain decode step), accept...
    policy.observe(RoundOutcome(width, path, accept_len, tree_depth, prefix, reqs, estimate))

Behind them: the width controller (``adaptive.WidthController``: the regime and width choice, its
probes, its measured overheads, ``budget_policy.BudgetPolicy``), the opt-in acceptance statistics
(``round_stats.AcceptanceStats``: stats file, Prometheus) and the round's counterfactual counts,
counted once for both (``round_stats.RoundCounterfactual``).  Without a controller (a fixed budget:
``SGLANG_DDTREE_ADAPTIVE=0``, or no CUDA graphs to time) every plan is the server's width.

Besides the round the worker calls :meth:`RoundPolicy.interrupt` for every other batch it launches
(prefill, mixed extend, idle: their time is no round's overhead), and at start-up
:meth:`RoundPolicy.start` (the controller, once the verify states and the cost table exist) and
:meth:`RoundPolicy.report_to` (the statistics and the round profiler), in whichever order SGLang
builds them.

The regime (plain decoding or speculation, ``regime.py``, design ``docs/plain_regime_design.md``):
the scheduler hook (not built yet) will ask :meth:`RoundPolicy.regime` at every decode launch and
call :meth:`RoundPolicy.regime_switched` after making a pending switch; without a controller
(:meth:`RoundPolicy.start_regime`, which nothing calls yet) the answer is always speculation, so
serving is unchanged.

Shapes: ``bs`` requests, drafter depth ``D``, verify width ``N`` (budget ``N - 1``), top-``K``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Tuple

import torch

from . import accept_estimate, adaptive_config
from .budget_policy import NO_SPEC
from .regime import SPEC, RegimeController, RegimeDecision, SchedView
from .round_stats import RoundCounterfactual


@dataclasses.dataclass(frozen=True)
class BatchView:
    """What the policy reads of a decode batch before its round (host values only)."""
    bs: int                               # requests in the batch
    reqs: Optional[Sequence] = None       # the batch's SGLang requests: pinned budgets, ages, token limits
    kv_tokens: Optional[int] = None       # host upper bound of the batch's committed KV tokens (summed)


@dataclasses.dataclass(frozen=True)
class RoundEstimate:
    """The tree's own expected acceptance (``accept_estimate.expected_accept``), measured by the round
    for the policy.  ``for_stats`` [bs, len(plan.stats_widths)] fp32 (None: not asked);
    ``for_controller`` [bs, len(plan.controller_widths)] fp32 (None: not a prediction round)."""
    for_stats: Optional[torch.Tensor] = None
    for_controller: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """What one round runs.

    ``width``: the verify width N (``NO_SPEC`` = 1: no speculation, SGLang's decode step of the
    bonus token).  ``predict``: the controller wants every width of its set estimated from the tree
    of width ``predict_from`` (its widest); with ``width == NO_SPEC`` this is a draft-only probe (the
    drafter block and that tree, no verify).  ``controller_widths``: the widths predicted for the
    controller (empty unless ``predict``).  ``stats_widths``: the widths the statistics want
    estimated (a tree round with statistics on; None: none)."""
    width: int
    predict: bool = False
    predict_from: Optional[int] = None
    controller_widths: Tuple[int, ...] = ()
    stats_widths: Optional[Tuple[int, ...]] = None

    @property
    def drafts(self) -> bool:
        """The round runs the drafter block: a tree round, or a draft-only probe."""
        return self.width > NO_SPEC or self.predict

    @property
    def estimates(self) -> bool:
        """The round must hand :meth:`estimate`'s result to ``observe``."""
        return self.predict or self.stats_widths is not None

    def estimate(self, tree, log_probs: torch.Tensor, token_ids: torch.Tensor,
                 build_tree: Callable[[int], object]) -> RoundEstimate:
        """The estimate this plan asks for, read off the round's ``tree`` (``width`` slots) and the
        drafter's top-K ``log_probs`` / ``token_ids`` [bs, D, K].  A prediction reads the tree of
        width ``predict_from`` (the round's own when that is its width, else ``build_tree(width)``:
        the widest tree of the same draft; prefix-closed, so the round's tree is its first slots),
        once for the controller's and the statistics' widths."""
        for_stats = for_controller = None
        if self.predict:
            wide = tree if self.width == self.predict_from else build_tree(self.predict_from)
            k = len(self.controller_widths)
            est = accept_estimate.expected_accept(wide, log_probs, token_ids,
                                                  list(self.controller_widths) + list(self.stats_widths or []))
            for_controller = est[:, :k]
            if self.stats_widths is not None:
                for_stats = est[:, k:]
        elif self.stats_widths is not None:   # opt-in telemetry: the tree's own acceptance estimate
            for_stats = accept_estimate.expected_accept(tree, log_probs, token_ids, list(self.stats_widths))
        return RoundEstimate(for_stats=for_stats, for_controller=for_controller)


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """What one round measured, on the device, for :meth:`RoundPolicy.observe`.

    ``width``: the verify width it ran (host int); ``path`` [bs, D + 1] int: the accepted slots,
    root first, -1 padded; ``accept_len`` [bs]: accepted non-root nodes; ``tree_depth`` [bs, N] int:
    the round's tree's slot depths; ``prefix`` [bs]: the committed lengths before the round;
    ``reqs``: the batch's SGLang requests (None: not known; request-rounds past their
    ``max_new_tokens`` are then counted); ``estimate``: the plan's :meth:`RoundPlan.estimate`
    (None: it asked for none)."""
    width: int
    path: torch.Tensor
    accept_len: torch.Tensor
    tree_depth: torch.Tensor
    prefix: torch.Tensor
    reqs: Optional[Sequence] = None
    estimate: Optional[RoundEstimate] = None


class RoundPolicy:
    """The verify width of each round and what the rounds teach it (module docstring).

    ``num_verify``: the server's width, every round's without a controller.  ``controller``
    (:meth:`start`), ``stats`` (:meth:`report_to`): None while absent."""

    def __init__(self, num_verify: int):
        self.num_verify = int(num_verify)
        self.controller: Optional["adaptive.WidthController"] = None   # noqa: F821
        self.stats = None          # round_stats.AcceptanceStats (opt-in)
        self._profiler = None      # profiling.RoundProfiler: the controller's snapshot in its records
        self._counterfactual: Optional[RoundCounterfactual] = None
        self.regime_controller: Optional[RegimeController] = None

    # ------------------------------------------------------------------ start-up
    def start(self, controller) -> None:
        """The width controller (``adaptive.WidthController``), once its states and cost table exist."""
        self.controller = controller
        self._attach_snapshot()

    def report_to(self, *, stats=None, profiler=None) -> None:
        """The acceptance statistics (None: off) and the round profiler of this worker."""
        self.stats = stats
        self._profiler = profiler
        self._attach_snapshot()

    def _attach_snapshot(self) -> None:
        """The controller's state in every profile record (``RoundProfiler.extra``): SGLang may build
        the CUDA graphs (and so the controller) before or after the worker's profiler exists, so this
        runs from both :meth:`start` and :meth:`report_to` and attaches once both are there."""
        prof, ctl = self._profiler, self.controller
        if prof is not None and ctl is not None and prof.enabled:
            prof.extra = ctl.snapshot

    def start_regime(self, controller: RegimeController) -> None:
        """The regime controller (``regime.RegimeController``; its ``optimistic`` bound is usually
        :meth:`optimistic_spec_ratio`)."""
        self.regime_controller = controller

    # ------------------------------------------------------------------ regime (per decode launch)
    def regime(self, view: SchedView) -> RegimeDecision:
        """The regime of the decode batch being launched and a pending switch (host values only);
        always speculation without a regime controller."""
        ctl = self.regime_controller
        return RegimeDecision(SPEC) if ctl is None else ctl.observe(view)

    def regime_switched(self) -> None:
        """The scheduler hook made the pending switch (drain, conversion, rebuild done)."""
        self.regime_controller.switched()

    def regime_rebuilt(self) -> None:
        """The drafter's rebuild was launched with the batch just observed (``RegimeController.rebuilt``)."""
        if self.regime_controller is not None:
            self.regime_controller.rebuilt()

    def regime_charge(self, seconds: float) -> None:
        """A rebuild's measured time, the switch's cost (``RegimeController.charge``)."""
        if self.regime_controller is not None:
            self.regime_controller.charge(seconds)

    def optimistic_spec_ratio(self, bs: int) -> Optional[float]:
        """What speculation could serve over plain decoding at ``bs`` by the width controller's model
        (``BudgetPolicy.tokens_per_ms``: the start-up cost table, the measured overheads and
        admissions) if every tree width accepted ``WidthController.PROBE_OPTIMISM`` x its last
        estimate: the best tree width's tokens per ms over plain decoding's.  The regime controller's
        excursion bound (design section 4 (ii)); None without a controller or a tree width at ``bs``."""
        ctl = self.controller
        pol = None if ctl is None else ctl.policy
        if pol is None:
            return None
        trees = [w for w in pol.candidates(bs) if w != NO_SPEC]
        if not trees:
            return None
        best = max(bs * (1.0 + ctl.PROBE_OPTIMISM * (pol.tokens_per_request(w) - 1.0)) / pol.round_ms(bs, w)
                   for w in trees)
        return best / pol.tokens_per_ms(bs, NO_SPEC)

    # ------------------------------------------------------------------ per batch
    def interrupt(self) -> None:
        """A batch other than a decode round is being launched (prefill, mixed extend, idle)."""
        if self.controller is not None:
            self.controller.interrupt()

    def plan(self, view: BatchView) -> RoundPlan:
        """This round's plan: the server's width, or the controller's choice (a forced test cycle,
        the narrowest budget a request pins, a probe, or ``BudgetPolicy.choose``; host values only)."""
        ctl = self.controller
        if ctl is None:
            width, predict = self.num_verify, False
        else:
            width = ctl.next_width(view.bs, adaptive_config.requested_width(view.reqs), view.reqs,
                                   kv_tokens=view.kv_tokens)
            predict = bool(ctl.predict)
        stats_widths = (tuple(self.stats.predicted_widths(width))
                        if self.stats is not None and width > 1 else None)
        return RoundPlan(width=width, predict=predict,
                         predict_from=ctl.cfg.widest if predict else None,
                         controller_widths=tuple(ctl.spec_widths) if predict else (),
                         stats_widths=stats_widths)

    def observe(self, out: RoundOutcome) -> None:
        """Count the round: its counterfactual acceptance at every smaller budget (once, for both
        consumers), into the statistics and the controller's window."""
        if self.stats is None and self.controller is None:
            return
        cf_stats, cf_window = self._round_counterfactual(out.path.device)(out.path, out.width)
        est = out.estimate
        if self.stats is not None:
            self.stats.record(out.path, out.accept_len, tree_depth=out.tree_depth, width=out.width,
                              predicted=None if est is None else est.for_stats, cf=cf_stats)
        if self.controller is not None:
            # request-rounds past a request's max_new_tokens (overlap scheduling runs a finished
            # request one more round) are not counted in the acceptance estimate
            self.controller.record(out.path, out.width, out.reqs, out.prefix.view(-1),
                                   predicted=None if est is None else est.for_controller, cf=cf_window)

    def _round_counterfactual(self, device) -> RoundCounterfactual:
        """The counterfactual counter of the statistics' and the controller's budgets (built at the
        first round: both exist by then)."""
        if self._counterfactual is None:
            self._counterfactual = RoundCounterfactual(
                [None if self.stats is None else self.stats.budgets,
                 None if self.controller is None else self.controller.window.budgets], device)
        return self._counterfactual
