"""Choosing the verify width per round from measured cost and counterfactual acceptance (issue 17).

The decision, separate from the worker so it is testable on the CPU and cheap to call:

* ``widths``: the verify widths the server can run (one captured target-verify graph each;
  ``N = budget + 1``), plus the choice 0 = no speculation this round (a plain decode step).
* the **cost table**: milliseconds per round for (batch size, width), measured at start-up (graph
  replays) or online; ``base_ms[bs]`` is the plain decode step.  Batch sizes between measured ones
  are interpolated linearly, beyond them clamped (a cost table is at most a few dozen numbers).
* the **acceptance**: tokens accepted per request-round at each width, from
  ``tree_ops.counterfactual_accept_len`` (one round of the widest tree gives the exact count for
  every smaller budget: a best-first tree is prefix-closed), kept as an exponential moving average
  over rounds.  A round yields accepted + 1 tokens (the bonus).
* the **choice** for a batch of ``bs`` requests: the width maximising tokens per millisecond,
  ``bs * (1 + accept[w]) / cost(bs, w)`` against ``bs / base_ms(bs)`` for no speculation; a new
  choice must beat the current one by ``hysteresis`` (a fraction) to switch, so noise in the EMA
  does not flap between graphs.
* the **round overhead**: what a round costs outside the measured GPU graph (scheduler, output
  processing, the worker's host work where it is not hidden), ``overhead_ms[bs]``, an EMA of the
  host-clock interval between rounds minus the table's cost (``observe_interval``; the worker shares
  rank 0's values across TP ranks).  It is the same for every width of a round, so it is added to
  every choice: a heavy per-round overhead makes tokens per round worth more.  Measured on the H200
  (kimicost pair, c = 64, before this term: ``bench/results/raw/ab_h200_kimicost_chain_run1.md``): a
  no-speculation round took 9.7 ms on the GPU and 23 ms at the client; from the GPU table alone the
  policy chose plain decode, and the DFLASH arm of the same run served 1.9x the adaptive arm's tokens
  per second (part of that gap was the probes: ``adaptive.WidthController``).

``BudgetPolicy.update`` takes the per-request counterfactual counts of one round (a host tensor or
list); ``update_means`` takes per-width means of a window of rounds, which is what the worker hands
over (``adaptive.WidthController``, from the device accumulator ``round_stats.CounterfactualWindow``,
so the round itself stays free of host synchronisation).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set

NO_SPEC = 0   # the choice "no speculation this round": a plain decode step


def _interp(table: Mapping[int, float], bs: int) -> float:
    """Linear interpolation of a {batch size: ms} table at bs (clamped outside its range)."""
    if not table:
        raise ValueError("empty cost table")
    keys = sorted(table)
    if bs <= keys[0]:
        return float(table[keys[0]])
    if bs >= keys[-1]:
        return float(table[keys[-1]])
    j = bisect.bisect_left(keys, bs)
    lo, hi = keys[j - 1], keys[j]
    if hi == bs:
        return float(table[hi])
    t = (bs - lo) / (hi - lo)
    return float(table[lo]) * (1 - t) + float(table[hi]) * t


@dataclass
class CostTable:
    """Round cost in ms: ``verify_ms[width][bs]`` for each verify width, ``base_ms[bs]`` for a plain
    decode step.  Every value must be a positive finite number."""

    verify_ms: Dict[int, Dict[int, float]]
    base_ms: Dict[int, float]

    def __post_init__(self):
        if not self.verify_ms:
            raise ValueError("the cost table needs at least one verify width")
        for w, row in self.verify_ms.items():
            if int(w) < 2:
                raise ValueError(f"verify width must be >= 2 (budget >= 1), got {w}")
            self._check_row(f"verify_ms[{w}]", row)
        self._check_row("base_ms", self.base_ms)

    @staticmethod
    def _check_row(name, row):
        if not row:
            raise ValueError(f"{name} is empty")
        for bs, ms in row.items():
            if int(bs) < 1 or not (float(ms) > 0 and float(ms) < float("inf")):
                raise ValueError(f"{name}[{bs}] = {ms!r}: batch sizes >= 1, costs positive and finite")

    @property
    def widths(self) -> List[int]:
        return sorted(int(w) for w in self.verify_ms)

    def cost(self, bs: int, width: int) -> float:
        return _interp(self.base_ms, bs) if width == NO_SPEC else _interp(self.verify_ms[width], bs)


@dataclass
class BudgetPolicy:
    """EMA of counterfactual acceptance per width + the cost table -> the width of the next round."""

    costs: CostTable
    ema: float = 0.9            # weight of the past in the acceptance average
    hysteresis: float = 0.03    # a new choice must be this much better (tokens / ms) to switch
    allow_no_spec: bool = True  # include "no speculation" (plain decode) among the choices
    prior_accept: float = 0.0   # acceptance assumed before any round was seen
    accept: Dict[int, float] = field(default_factory=dict)
    overhead_ms: Dict[int, float] = field(default_factory=dict)   # {bs: ms per round outside the table}
    overhead_ema: float = 0.8   # weight of the past in the overhead average
    rounds_seen: int = 0
    current: Optional[int] = None
    seen: Set[int] = field(default_factory=set)   # widths update_means has averaged

    def __post_init__(self):
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.hysteresis < 0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")
        for w in self.costs.widths:
            self.accept.setdefault(w, float(self.prior_accept))

    def update(self, counterfactual: Sequence[Sequence[int]], widths: Sequence[int]) -> None:
        """One round: ``counterfactual[r][j]`` = tokens request r would have accepted at verify width
        ``widths[j]`` (``tree_ops.counterfactual_accept_len`` with budgets ``w - 1``).  Widths not in
        the cost table are ignored; a width of the table missing here keeps its average."""
        rows = [list(map(float, r)) for r in counterfactual]
        if not rows:
            return
        if any(len(r) != len(widths) for r in rows):
            raise ValueError(f"each row needs one count per width ({len(widths)})")
        for j, w in enumerate(widths):
            if int(w) not in self.accept:
                continue
            mean = sum(r[j] for r in rows) / len(rows)
            if mean < 0:
                raise ValueError(f"negative acceptance at width {w}: {mean}")
            old = self.accept[int(w)]
            self.accept[int(w)] = mean if self.rounds_seen == 0 else self.ema * old + (1 - self.ema) * mean
        self.rounds_seen += 1

    def update_means(self, means: Mapping[int, float]) -> None:
        """One window: ``means[w]`` = mean tokens accepted per request-round at verify width ``w``.
        A width seen for the first time takes the mean; a width absent keeps its average (a window
        of narrow rounds says nothing about wider trees); widths outside the table are ignored."""
        known = {int(w): float(m) for w, m in means.items() if int(w) in self.accept}
        if not known:
            return
        for w, m in known.items():
            if m < 0:
                raise ValueError(f"negative acceptance at width {w}: {m}")
            self.accept[w] = m if w not in self.seen else self.ema * self.accept[w] + (1 - self.ema) * m
            self.seen.add(w)
        self.rounds_seen += 1

    def overhead(self, bs: int) -> float:
        """Per-round ms outside the cost table at ``bs`` (0 until observed; interpolated between the
        batch sizes seen, clamped beyond them; never below 0)."""
        return max(0.0, _interp(self.overhead_ms, bs)) if self.overhead_ms else 0.0

    def round_ms(self, bs: int, width: int) -> float:
        """Predicted ms of a round of ``bs`` requests at ``width``: the table's cost + the overhead."""
        return self.costs.cost(bs, width) + self.overhead(bs)

    def observe_interval(self, bs: int, width: int, interval_ms: float,
                         into: Optional[Dict[int, float]] = None) -> bool:
        """One host-clock interval that measures a round of ``bs`` requests at ``width`` (which one:
        ``adaptive.WidthController``).  Folds ``interval - cost(bs, width)`` into the overhead EMA of
        ``bs`` in ``into`` (default: ``overhead_ms``; the controller keeps each rank's own until
        they are shared), signed: a round faster than the table lowers the average, so noise in
        the host clock (an interval that is partly the previous round's) averages out instead of
        only ever adding (``overhead`` floors the average at 0).  Returns False (ignored) for an
        interval longer than 4x the cost + 20 ms (the server was idle or prefilling, not a round's
        overhead) or not a positive finite number."""
        table = self.overhead_ms if into is None else into
        cost = self.costs.cost(bs, width)
        ms = float(interval_ms)
        if not (ms > 0 and ms < float("inf")) or ms > 4 * cost + 20.0:
            return False
        extra = ms - cost
        old = table.get(int(bs))
        table[int(bs)] = extra if old is None else self.overhead_ema * old + (1 - self.overhead_ema) * extra
        return True

    def tokens_per_ms(self, bs: int, width: int) -> float:
        """Expected output tokens per millisecond of a round of ``bs`` requests at ``width``."""
        per_req = 1.0 if width == NO_SPEC else 1.0 + self.accept[width]
        return bs * per_req / self.round_ms(bs, width)

    def candidates(self) -> List[int]:
        return ([NO_SPEC] if self.allow_no_spec else []) + self.costs.widths

    def choose(self, bs: int) -> int:
        """The verify width for the next round of ``bs`` requests (NO_SPEC: plain decode)."""
        if bs < 1:
            raise ValueError(f"batch size must be >= 1, got {bs}")
        scores = {w: self.tokens_per_ms(bs, w) for w in self.candidates()}
        best = max(scores, key=lambda w: (scores[w], -w))   # ties: the narrower (cheaper) width
        if self.current in scores and scores[best] <= scores[self.current] * (1 + self.hysteresis):
            return self.current
        self.current = best
        return best
