"""The round policy of DDTREE-GPU: which verify width each round runs (no speculation included) and
the statistics that choice is made from.  The worker reaches it through two calls a round,
:meth:`RoundPolicy.plan` and :meth:`RoundPolicy.observe` (``round_policy.py``).

Modules:

- ``round_policy.py``: the two calls and their dataclasses (``BatchView``, ``RoundPlan``,
  ``RoundEstimate``, ``RoundOutcome``);
- ``adaptive.py``: ``WidthController``, the per-round choice (forced cycle, pinned budgets,
  probes, draft-only probes, the measured round overheads and admissions);
- ``regime.py``: ``RegimeController``, plain decoding or speculation per window of wall time
  (``docs/plain_regime_design.md``; owned by ``RoundPolicy``, not yet called by serving code);
- ``budget_policy.py``: ``BudgetPolicy``, the choice from the start-up cost table, the overheads
  and the acceptance per request-age bucket; ``NO_SPEC`` (width 1, no speculation);
- ``adaptive_config.py``: the adaptive settings (``SGLANG_DDTREE_BUDGETS`` / ``_ADAPTIVE``, the
  switches) and a request's pinned budget;
- ``accept_estimate.py``: every width's expected acceptance read off the tree itself;
- ``round_stats.py``: the counterfactual counts (``RoundCounterfactual``, the controller's
  ``CounterfactualWindow``), the opt-in acceptance statistics (stats file, Prometheus) and the
  worker's round observers.
"""
from .budget_policy import NO_SPEC
from .round_policy import BatchView, RoundEstimate, RoundOutcome, RoundPlan, RoundPolicy

__all__ = ["NO_SPEC", "BatchView", "RoundEstimate", "RoundOutcome", "RoundPlan", "RoundPolicy"]
