"""Choosing the verify width per round from measured cost and counterfactual acceptance (issue 17).

The decision, separate from the worker so it is testable on the CPU and cheap to call:

* ``widths``: the verify widths the server can run (one captured target-verify graph each;
  ``N = budget + 1``), plus ``NO_SPEC`` = width 1 = budget 0: no speculation this round (a plain
  decode step).
* the **cost table**: milliseconds per round for (batch size, width), measured at start-up (graph
  replays) or online; ``base_ms[bs]`` is the plain decode step.  Batch sizes between measured ones
  are interpolated linearly, beyond them clamped (a cost table is at most a few dozen numbers).
* the **acceptance**: tokens accepted per request-round at each width, from
  ``tree_ops.counterfactual_accept_len`` (one round of the widest tree gives the exact count for
  every smaller budget: a best-first tree is prefix-closed), kept per width as decayed sums
  ``S_w <- d * S_w + sum``, ``C_w <- d * C_w + count`` (every width decays at every window of
  rounds, measured or not, ``d`` = ``ema``; a measured width's past is first cut to at most
  ``count / (1 - d)`` request-rounds, see :meth:`BudgetPolicy.update_sums`), read as ``S_w / C_w``:
  the mean of the recent request-rounds that measured the width, each weighted by its age.  A
  width measured only by probes (one round in a few dozen) is the mean of its recent probes, and a
  window of many requests weighs more than one of few.  Measured on the
  H200 (Qwen3-8B-shaped chain pair, c = 16, ``raw/scalechain_s15_run4_profile_auto_snapshot.jsonl``)
  with the EMA of window means this replaced: the estimates started from the warm-up windows
  (0.04 accepted), a probe-only width moved only on windows that held a probe, and after ~50 rounds
  they read 1.31 / 2.15 / 0.73 at widths 8 / 16 / 32 against true means ~2.2 / 2.7 / 3.0.  A round
  yields accepted + 1 tokens (the bonus).
* the **choice** for a batch of ``bs`` requests: the width maximising tokens per millisecond,
  ``bs * (1 + accept[w]) / cost(bs, w)`` against ``bs / base_ms(bs)`` for no speculation, a tree
  width's score divided by ``1 + spec_margin (1 - 1/bs)`` where no speculation is a choice, and on a
  batch whose requests would finish together by the unbatched admissions a spread costs over the
  plain decoding time left (speculation must win by that margin: :meth:`score`); a new choice must beat the current one by ``hysteresis`` (a fraction) to
  switch, so noise in the EMA does not flap between graphs.
* the **round overhead**: what a round costs outside the measured GPU graph (scheduler, output
  processing, the worker's host work where it is not hidden): one value for every batch size, the
  median of the last ``overhead_window`` signed samples "host-clock interval of a round minus the
  table's cost" (``observe_interval`` collects them, ``overhead_of`` reduces them; the worker shares
  rank 0's value across TP ranks).  A median, not a mean, and not per batch size: events that cost
  per request (an admission, a finish) land in single rounds as spikes of 10-30 ms, and they do not
  scale with the number of rounds, so they must not count as a per-round cost; measured per batch
  size (H200, same run as above) the rare sizes around finishes read 12-28 ms against 0-1.5 ms at
  the steady ones, and interpolation spread those spikes over the common sizes.  Two values, one per
  kind of round: a no-speculation round (SGLang's decode step replayed, no drafter, no tree:
  ``plain_decode.py``) and a tree round at any width.  Measured on the H200 (Qwen3-8B-shaped chain
  pair, c = 16, ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s26_plain.md``, profile records):
  plain rounds took 5.7-5.8 ms of wall clock for a 5.0 ms table cost, width-8 rounds 9.2-9.5 ms for
  7.98; with one shared value (1.3-1.5 ms) the plain round read ~0.6 ms dearer than it was, the
  policy chose width 8 at an estimated 9 % gain where the two served the same tokens per second, and
  its width-61 probes (26 ms) came on top.  Within a kind the overhead is added to every width, so a
  heavy per-round overhead makes tokens per round worth more.  When the controller knows the batch's
  KV length, each choice is instead priced at that context from its own recent rounds
  (:meth:`BudgetPolicy.width_overhead`, issue 41 item 3): the table is timed with almost no KV.
* the **admissions** (prefills between rounds): SGLang admits every waiting request in one prefill
  batch after the round in which others finished, so under load a prefill follows nearly every
  round and its cost is mostly fixed per batch (launches, no CUDA graph): measured on the H200
  (Qwen3-8B-shaped chain pair, outputs of 32-96 tokens, ``raw/scalechain_ab_qwen3-8b_h200_s16_run1``)
  plain decoding at c = 64 took 19 ms of wall clock per step for a 5.6 ms GPU step, width 8 30.8 ms
  for 16.9; from the GPU table alone the policy chose plain decoding half the time at c = 64 and
  served 4746 tok/s where the fixed width-8 arm served 6516.  Model: finishes per round are Poisson
  with mean ``finish_rate * bs * tokens_per_request_round`` (a request finishes after a number of
  tokens, not of rounds), a prefill follows a round with at least one finish and costs
  ``prefill_ms``: expected ``prefill_ms * (1 - exp(-finish_rate * bs * t_w))`` per round at width
  ``w``.  Wider trees finish requests in fewer rounds, so they pay fewer prefill batches per token;
  plain decoding at high load pays one every second round or so.  The controller measures both
  figures (``adaptive.WidthController``).  Measured on the H200
  (kimicost pair, c = 64, before this term: ``bench/results/raw/ab_h200_kimicost_chain_run1.md``): a
  no-speculation round took 9.7 ms on the GPU and 23 ms at the client; from the GPU table alone the
  policy chose plain decode, and the DFLASH arm of the same run served 1.9x the adaptive arm's tokens
  per second (part of that gap was the probes: ``adaptive.WidthController``).

``BudgetPolicy.update`` takes the per-request counterfactual counts of one round (a host tensor or
list); ``update_sums`` takes per-width sums and counts of a window of rounds, which is what the
worker hands over (``adaptive.WidthController``, from the device accumulator ``round_stats.CounterfactualWindow``,
so the round itself stays free of host synchronisation).
"""
from __future__ import annotations

import bisect
import collections
import math
import statistics

import numpy as np
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

NO_SPEC = 1   # the verify width of "no speculation this round" (budget 0): a plain decode step; the
              # one encoding of it inside the plugin (the worker's plain state, the policy's choice)


def check_age_edges(edges: Sequence[int]) -> Tuple[int, ...]:
    """Request-age bucket edges (output tokens) as a tuple: distinct, ascending, each >= 1 (empty: one
    bucket).  Raises ValueError."""
    out = tuple(int(e) for e in edges)
    if list(out) != sorted(set(out)) or (out and out[0] < 1):
        raise ValueError(f"age_edges must be distinct, ascending and >= 1, got {list(edges)}")
    return out


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
    decode step, ``draft_ms[bs]`` (optional) for the drafter's block forward alone (included in every
    verify width's cost; what a draft-only probe adds to a plain step).  Every value must be a
    positive finite number."""

    verify_ms: Dict[int, Dict[int, float]]
    base_ms: Dict[int, float]
    draft_ms: Optional[Dict[int, float]] = None

    def __post_init__(self):
        if not self.verify_ms:
            raise ValueError("the cost table needs at least one verify width")
        for w, row in self.verify_ms.items():
            if int(w) < 2:
                raise ValueError(f"verify width must be >= 2 (budget >= 1), got {w}")
            self._check_row(f"verify_ms[{w}]", row)
        self._check_row("base_ms", self.base_ms)
        if self.draft_ms is not None:
            self._check_row("draft_ms", self.draft_ms)

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

    def draft_cost(self, bs: int) -> Optional[float]:
        """The drafter block's ms at ``bs`` (None when the table has no draft row or ``bs`` is past
        its largest batch: the drafter would run without its graph)."""
        return None if not self.draft_ms or bs > max(self.draft_ms) else _interp(self.draft_ms, bs)

    def covers(self, bs: int, width: int) -> bool:
        """``bs`` is within the batch sizes timed for ``width`` (its CUDA graphs): past them a round
        runs eagerly, and the table, clamped there, would price it as the largest graph."""
        row = self.base_ms if width == NO_SPEC else self.verify_ms[width]
        return bs <= max(row)


@dataclass
class BudgetPolicy:
    """Decayed acceptance per width + the cost table + the round overhead -> the next round's width."""

    costs: CostTable
    ema: float = 0.9            # decay of the acceptance sums per update (weight of the past)
    hysteresis: float = 0.03    # a new choice must be this much better (tokens / ms) to switch
    spec_margin: float = 0.10   # a tree width must beat no speculation by this much (see :meth:`score`)
    sync_margin: float = 1.0    # at most this much when the batch's requests would finish together
    sync_admission_ms: float = 30.0   # what one admission prefill loses when it is no longer batched
    synced_left: Optional[float] = None   # the next choice's batch finishes together under plain
                                # decoding, this many tokens from now on average (None: not synced;
                                # the controller sets it per round: ``adaptive.synced_tokens_left``)
    allow_no_spec: bool = True  # include "no speculation" (plain decode) among the choices
    prior_accept: float = 0.0   # acceptance assumed before any round was seen
    accept: Dict[int, float] = field(default_factory=dict)
    overhead_ms: float = 0.0    # per-round ms outside the table, every batch size (signed; read floored)
    overhead_plain_ms: Optional[float] = None   # the same for no-speculation rounds (None: not yet
                                                # measured, tree rounds' value used)
    overhead_window: int = 64   # samples the median is taken over
    prefill_ms: float = 0.0     # ms of a prefill batch between rounds (measured from the wall clock)
    finish_rate: float = 0.0    # finishes per output token (Poisson rate; measured)
    rounds_seen: int = 0
    current: Optional[int] = None
    seen: Set[int] = field(default_factory=set)   # widths with a measured round
    paired: bool = False        # an update carried ``below``: estimates chain same-round gains
    samples: Deque[float] = field(default=None)   # this policy's own overhead samples (newest last)
    samples_plain: Deque[float] = field(default=None)   # ... of no-speculation rounds
    age_edges: Tuple[int, ...] = ()   # request-age buckets (output tokens; see update_window)
    shrink: float = 4.0         # request-rounds of the pooled mean in each bucket's estimate
    # decayed sums per age bucket and width: accepted tokens, request-rounds, and what the next
    # narrower width accepted on the same request-rounds
    bucket_sum: List[Dict[int, float]] = field(default=None)
    bucket_count: List[Dict[int, float]] = field(default=None)
    bucket_below: List[Dict[int, float]] = field(default=None)
    bucket_accept: List[Dict[int, float]] = field(default=None)   # per-bucket estimates
    batch_accept: Optional[Dict[int, float]] = None   # the last choice's batch (choose with ages)
    # the tree's own estimate (update_window's ``pred``): decayed by ``pred_ema`` per window, the
    # predicted accepted tokens per age bucket and width and the request-rounds they cover; and,
    # decayed by ``cal_ema``, the calibration pairs per width (prediction, exact count, request-rounds)
    pred_ema: float = 0.5
    cal_ema: float = 0.95
    cal_shrink: float = 8.0     # request-rounds of the narrower width's ratio in each width's ratio
    pred_sum: List[Dict[int, float]] = field(default=None)
    pred_n: List[float] = field(default=None)
    # calibration pairs per age bucket and width: prediction, exact count, request-rounds
    cal_pred_b: List[Dict[int, float]] = field(default=None)
    cal_exact_b: List[Dict[int, float]] = field(default=None)
    cal_n_b: List[Dict[int, float]] = field(default=None)
    ratio: Dict[int, float] = field(default=None)   # pooled exact / predicted per width (after a prediction)
    bucket_ratio: List[Dict[int, float]] = field(default=None)   # ... per age bucket
    # the context axis (see :meth:`width_overhead`): the next round's batch KV tokens in thousands
    # (None: unknown, the per-kind overhead above is used), each choice's fitted overhead
    # {choice: (a, b, n)} = a + b * K ms from n recent rounds at that choice (:func:`fit_width_overhead`;
    # the controller fits its own samples and shares rank 0's), and the drafter block size (the
    # prior's width-free part of a tree round's context cost, in verify-query equivalents)
    kv_k: Optional[float] = None
    width_fit: Dict[int, Tuple[float, float, int]] = field(default_factory=dict)
    draft_queries: int = 16
    width_min_samples: int = 4

    def __post_init__(self):
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.hysteresis < 0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")
        if not self.spec_margin >= 0 or not self.sync_margin >= 0 or not self.sync_admission_ms >= 0:
            raise ValueError(f"spec_margin, sync_margin and sync_admission_ms must be >= 0, got "
                             f"{self.spec_margin}, {self.sync_margin}, {self.sync_admission_ms}")
        if int(self.overhead_window) < 1:
            raise ValueError(f"overhead_window must be >= 1, got {self.overhead_window}")
        self.age_edges = check_age_edges(self.age_edges)
        if not self.shrink >= 0:
            raise ValueError(f"shrink must be >= 0, got {self.shrink}")
        nb = len(self.age_edges) + 1
        ws = self.costs.widths
        for w in ws:
            self.accept.setdefault(w, float(self.prior_accept))
        self.bucket_sum = [dict.fromkeys(ws, 0.0) for _ in range(nb)]
        self.bucket_count = [dict.fromkeys(ws, 0.0) for _ in range(nb)]
        self.bucket_below = [dict.fromkeys(ws, 0.0) for _ in range(nb)]
        self.bucket_accept = [dict(self.accept) for _ in range(nb)]
        for name, val in (("pred_ema", self.pred_ema), ("cal_ema", self.cal_ema)):
            if not 0.0 <= val < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {val}")
        if not self.cal_shrink >= 0:
            raise ValueError(f"cal_shrink must be >= 0, got {self.cal_shrink}")
        self.pred_sum = [dict.fromkeys(ws, 0.0) for _ in range(nb)]
        self.pred_n = [0.0] * nb
        self.cal_pred_b, self.cal_exact_b, self.cal_n_b = (
            [dict.fromkeys(ws, 0.0) for _ in range(nb)] for _ in range(3))
        if self.samples is None:
            self.samples = deque(maxlen=int(self.overhead_window))
        if self.samples_plain is None:
            self.samples_plain = deque(maxlen=int(self.overhead_window))

    @property
    def buckets(self) -> int:
        return len(self.age_edges) + 1

    def bucket_of(self, age: int) -> int:
        """The age bucket of a request that has emitted ``age`` output tokens."""
        return bisect.bisect_right(self.age_edges, int(age))

    def _pooled(self, table: List[Dict[int, float]]) -> Dict[int, float]:
        return {w: sum(t[w] for t in table) for w in self.accept}

    @property
    def accept_sum(self) -> Dict[int, float]:
        """Decayed accepted tokens per width, every age bucket together."""
        return self._pooled(self.bucket_sum)

    @property
    def cal_pred(self) -> Dict[int, float]:
        """Decayed predictions of the calibration pairs per width, every age bucket together."""
        return self._pooled(self.cal_pred_b)

    @property
    def cal_exact(self) -> Dict[int, float]:
        """Decayed exact counts of the calibration pairs per width, every age bucket together."""
        return self._pooled(self.cal_exact_b)

    @property
    def cal_n(self) -> Dict[int, float]:
        """Decayed request-rounds of the calibration pairs per width, every age bucket together."""
        return self._pooled(self.cal_n_b)

    @property
    def accept_count(self) -> Dict[int, float]:
        """Decayed request-rounds per width, every age bucket together."""
        return self._pooled(self.bucket_count)

    def update(self, counterfactual: Sequence[Sequence[int]], widths: Sequence[int]) -> None:
        """One round: ``counterfactual[r][j]`` = tokens request r would have accepted at verify width
        ``widths[j]`` (``tree_ops.counterfactual_accept_len`` with budgets ``w - 1``).  Widths not in
        the cost table are ignored; a width of the table missing here keeps its average.  One age
        bucket only."""
        rows = [list(map(float, r)) for r in counterfactual]
        if not rows:
            return
        if any(len(r) != len(widths) for r in rows):
            raise ValueError(f"each row needs one count per width ({len(widths)})")
        order = sorted(range(len(widths)), key=lambda j: widths[j])
        below = {widths[j]: (sum(r[order[i - 1]] for r in rows) if i else 0.0) for i, j in enumerate(order)}
        self.update_sums({w: sum(r[j] for r in rows) for j, w in enumerate(widths)},
                         {w: len(rows) for w in widths}, below)

    def update_sums(self, sums: Mapping[int, float], counts: Mapping[int, float],
                    below: Optional[Mapping[int, float]] = None) -> None:
        """One window of a policy without age buckets: :meth:`update_window` with one bucket."""
        if self.buckets != 1:
            raise ValueError(f"this policy has {self.buckets} age buckets: use update_window")
        self.update_window([sums], [counts], None if below is None else [below])

    def update_window(self, sums: Sequence[Mapping[int, float]], counts: Sequence[Mapping[int, float]],
                      below: Optional[Sequence[Mapping[int, float]]] = None,
                      pred: Optional[Mapping[str, Sequence[Mapping[int, float]]]] = None) -> None:
        """One window, per age bucket ``b`` (``round_stats.CounterfactualWindow`` with this policy's
        ``age_edges``): ``sums[b][w]`` tokens accepted over ``counts[b][w]`` request-rounds of
        requests in bucket ``b`` that measured verify width ``w``.  What follows holds per bucket.

        ``sums[w]`` tokens accepted over ``counts[w]`` request-rounds that measured
        verify width ``w`` (a width absent or with count 0 was not measured: a window of narrow
        rounds says nothing about wider trees).  Every width's sums decay by ``ema`` first, in every
        window, measured or not (the past ages by rounds, not by measurements); widths outside the
        table are ignored.  A window that measured no width changes no estimate, only the weight of
        the past.  Then a measured width's past is scaled down (sums and count alike, so its mean
        stays) to at most ``n / (1 - ema)`` request-rounds, ``n`` this window's count: what the
        current flow of measurements weighs in steady state.  Why both: measured on the H200
        (``bench/results/raw/scalechain_ab_qwen3-30b-a3b_h200_s20_logs.tgz``, MoE chain pair) the
        start-up warm-up batch (49 fresh requests, 11 rounds, ~0.1 accepted) put ~450 request-rounds
        of near-zero acceptance into the sums; at c = 1 the policy then chose plain decoding, whose
        windows measured nothing and did not age that past, and the probes (one request-round every
        ~55 rounds) moved the estimate by ~0.2 % each: 1,100 plain rounds before it speculated
        again, and the level served 302 tok/s against 484 for a fixed budget.  The dense pair at
        c = 64 (``..._qwen3-8b_h200_s20_logs.tgz``) did the same from each repeat's first batch of
        64 fresh requests: plain decoding for most of the level, 5,491 tok/s against 6,763 at
        budget 7.

        Without ``below``: ``accept[w]`` is the age-weighted mean of the request-rounds that measured
        ``w``.  With ``below[w]`` (what the next narrower width of the table accepted on the same
        request-rounds as ``sums[w]``; ``round_stats.CounterfactualWindow`` hands it out): the
        narrowest width's mean over every round, times each wider width's same-round gain
        ``sum(sums[w]) / sum(below[w])`` in turn (decayed sums).  Why: a wide width is measured only
        on the rounds that ran it (its choices and probes), and those are not a random sample of
        the rounds: measured on the H200 (Qwen3-8B-shaped chain pair, c = 16 / 64, the width-32
        rounds ran at the tails of levels, late in long requests), its mean read 4.5-7.1 accepted
        tokens against 3.4-3.8 on rounds that all ran it
        (``bench/results/raw/scalechain_ab_qwen3-8b_h200_s18_run2_pins_logs.tgz``), and the policy
        chose it where width 16 served 1.12x the tokens per second.  The gain measured on the same
        rounds does not depend on which rounds those were, as long as wider trees gain in
        proportion.

        **Age buckets** (``age_edges``: output tokens a request has emitted; one bucket without
        edges): acceptance depends on a request's age, so a width's mean over the request-rounds that
        measured it depends on which ages those were, and the rounds a width runs see different ages
        from those another width would see.  Measured on the H200 (MoE chain pair, c = 1,
        ``raw/scalechain_ab_qwen3-30b-a3b_h200_s21_logs.tgz``, profile records of the pinned arms):
        with every round at width 16 the width-8 counterfactual read 1.65 accepted tokens, rounds
        pinned at width 8 read 2.1; on the CPU (toy chain pair, ``bench/scale/acceptance_by_age.py
        --run-budget 7 / 15``, 12 prompts) width 8's counterfactual from width-16 rounds says 2.74
        tokens per round, width-8 rounds emit 3.27: a request's first ~10 tokens accept almost
        nothing and acceptance keeps rising with age, and a wider tree spends fewer rounds at the
        late, high ages.  So the estimate is kept per bucket (``bucket_accept[b][w]``: the chain
        below on the bucket's sums, each shrunk towards the pooled mean by ``shrink`` request-rounds
        so a sparse bucket reads the pooled value) and :meth:`choose` weighs the buckets by the ages
        of the batch it chooses for.  That is also what a burst of fresh requests needs: their
        low-acceptance rounds land in the young buckets and leave the older ones' estimates alone.
        ``accept`` (no batch mix given) is the pooled estimate over every bucket.

        **The tree's own estimate** (``pred``: ``round_stats.CounterfactualWindow``'s, per age bucket
        ``{width: value}``: ``all`` / ``n`` the predicted accepted tokens and request-rounds over
        every request-round that carried a prediction, ``on`` / ``exact`` / ``on_n`` the prediction,
        the exact count and the request-rounds where both exist).  Once any arrived, the estimate of
        every width is ``ratio[w] * predicted mean[w]`` (:meth:`_pred_estimate`): the predicted mean
        decays by ``pred_ema`` per window (0.5: a change of workload shows within a window or two,
        where the counts above need ~10), read per age bucket (shrunk towards the pooled mean by
        ``shrink`` request-rounds); the calibration ratio ``exact / predicted`` decays by ``cal_ema``
        over the request-rounds where both exist, so a wide width measured only by probes keeps its
        ratio between probes and its estimate still follows the predictions of every round."""
        nb = self.buckets
        if pred is not None:
            self._fold_pred(pred)
        if len(sums) != nb or len(counts) != nb or (below is not None and len(below) != nb):
            raise ValueError(f"sums, counts and below need one entry per age bucket ({nb})")
        known = []
        for b in range(nb):
            kb = {int(w): (float(sums[b].get(w, 0.0)), float(c)) for w, c in counts[b].items()
                  if int(w) in self.accept and float(c) > 0}
            for w, (total, n) in kb.items():
                if total < 0:
                    raise ValueError(f"negative acceptance at width {w}: {total}")
                if below is not None and float(below[b].get(w, 0.0)) < 0:
                    raise ValueError(f"negative acceptance below width {w}: {below[b].get(w)}")
            known.append(kb)
        for table in (self.bucket_sum, self.bucket_count, self.bucket_below):   # the past ages by windows
            for t in table:
                for w in t:
                    t[w] *= self.ema
        if not any(known):
            if pred is not None:
                self._estimate()
            return
        if below is not None:
            self.paired = True
        for b, kb in enumerate(known):
            S, C, B = self.bucket_sum[b], self.bucket_count[b], self.bucket_below[b]
            for w, (total, n) in kb.items():
                # the past weighs at most what the current flow would in steady state (n / (1 - ema)):
                # a burst of request-rounds (a warm-up batch, a level's fresh requests) cannot
                # outweigh a narrow batch's or a probe's measurements for long
                cap = n / (1.0 - self.ema) if self.ema > 0 else 0.0
                if C[w] > cap:
                    f = cap / C[w]
                    S[w] *= f
                    C[w] *= f
                    B[w] *= f
                S[w] += total
                C[w] += n
                if below is not None:
                    B[w] += float(below[b].get(w, 0.0))
                self.seen.add(w)
        self._estimate()
        self.rounds_seen += 1

    def _fold_pred(self, pred: Mapping[str, Sequence[Mapping[int, float]]]) -> None:
        """Decay, then add one window's predictions (see :meth:`update_window`)."""
        nb = self.buckets
        parts = {k: pred[k] for k in ("all", "n", "on", "exact", "on_n")}
        if any(len(v) != nb for v in parts.values()):
            raise ValueError(f"pred needs one entry per age bucket ({nb}) in all, n, on, exact, on_n")
        for k, v in parts.items():
            for row in v:
                for w, x in row.items():
                    if not float(x) >= 0:
                        raise ValueError(f"pred[{k!r}] at width {w}: {x!r} (must be >= 0)")
        d, dc = self.pred_ema, self.cal_ema
        for b in range(nb):
            self.pred_n[b] *= d
            n_b = max((float(x) for x in parts["n"][b].values()), default=0.0)
            self.pred_n[b] += n_b
            for w in self.pred_sum[b]:
                self.pred_sum[b][w] = d * self.pred_sum[b][w] + float(parts["all"][b].get(w, 0.0))
        for b in range(nb):
            for table, key in ((self.cal_pred_b, "on"), (self.cal_exact_b, "exact"), (self.cal_n_b, "on_n")):
                t = table[b]
                for w in t:
                    t[w] = dc * t[w] + float(parts[key][b].get(w, 0.0))

    def _pred_estimate(self) -> bool:
        """``accept`` / ``bucket_accept`` as calibrated predictions (see :meth:`update_window`); False
        (nothing changed) before any prediction.

        The ratio ``exact / predicted`` is kept per age bucket and width.  Measured on the CPU (text
        pair, ``bench/results/accept_calibration_cpu.md``): pooled it is 0.95-0.96 at every budget,
        but 0.79-0.83 for requests' first 16 tokens and 1.02-1.05 past 256 (the chain pair: 0.64-0.77
        young, 1.3-1.55 later), so one pooled ratio over-predicts fresh requests by 16-20 % (1.9x on
        the chain pair).  Pooled: the narrowest width's ratio starts from 1 (the drafter taken at its
        word) with ``cal_shrink`` request-rounds of weight, each wider width's from the narrower
        width's ratio with that weight, so a width without pairs reads its neighbour's.  Per bucket:
        each width's ratio is shrunk towards the pooled ratio of that width by ``cal_shrink``
        request-rounds, so a sparse bucket reads the pooled value.  Estimates are made non-decreasing
        in the width (a wider tree holds the narrower one) and at most ``w - 1`` (the tree's nodes)."""
        n_pool = sum(self.pred_n)
        if n_pool <= 0:
            return False
        ws = sorted(self.accept)
        k = float(self.cal_shrink)

        def shrunk(P, E, n, prior):
            if n > 0 and P > 0:
                pbar = P / n
                return (E + k * prior * pbar) / (P + k * pbar)
            return prior

        CP, CE, CN = self.cal_pred, self.cal_exact, self.cal_n
        ratio, prev = {}, 1.0
        for w in ws:
            prev = ratio[w] = shrunk(CP[w], CE[w], CN[w], prev)
        self.ratio = ratio
        self.bucket_ratio = [dict(ratio)] if self.buckets == 1 else [
            {w: shrunk(self.cal_pred_b[b][w], self.cal_exact_b[b][w], self.cal_n_b[b][w], ratio[w]) for w in ws}
            for b in range(self.buckets)]

        def calibrated(mean: Mapping[int, float], r: Mapping[int, float]) -> Dict[int, float]:
            out, best = {}, 0.0
            for w in ws:
                best = max(best, min(r[w] * mean[w], float(w - 1)))
                out[w] = best
            return out

        pm = {w: sum(t[w] for t in self.pred_sum) / n_pool for w in ws}
        ks = float(self.shrink)
        per_bucket = []
        for b in range(self.buckets):
            nb_ = self.pred_n[b]
            mean = {w: (self.pred_sum[b][w] + ks * pm[w]) / (nb_ + ks) if nb_ + ks > 0 else pm[w] for w in ws}
            per_bucket.append(calibrated(mean, self.bucket_ratio[b]))
        if self.buckets == 1:
            self.accept.update(per_bucket[0])
        else:   # pooled: the buckets' estimates weighed by their predicted request-rounds
            self.accept.update({w: sum(self.pred_n[b] * per_bucket[b][w] for b in range(self.buckets)) / n_pool
                                for w in ws})
        self.bucket_accept = per_bucket
        return True

    def _chain(self, S: Mapping[int, float], C: Mapping[int, float], B: Mapping[int, float]) -> Dict[int, float]:
        """Estimates of the seen widths from decayed sums (see :meth:`update_window`)."""
        out = {}
        if not self.paired:
            for w in self.seen:
                if C[w] > 0:
                    out[w] = S[w] / C[w]
            return out
        prev = None
        for w in sorted(self.accept):
            if w not in self.seen or C[w] <= 0:
                prev = None            # a gap: the next measured width starts its own chain
                continue
            mean = S[w] / C[w]
            if prev is None:
                out[w] = mean
            elif B[w] > 1e-9:
                out[w] = out[prev] * (S[w] / B[w])
            else:                      # the narrower width accepted nothing on these rounds: its gain
                out[w] = out[prev] + mean
            prev = w
        return out

    def _estimate(self) -> None:
        """``accept`` (pooled) and ``bucket_accept`` from the decayed sums (see :meth:`update_window`):
        the calibrated predictions once there are any, else the counts alone."""
        if self._pred_estimate():
            return
        S, C = self.accept_sum, self.accept_count
        B = self._pooled(self.bucket_below)
        self.accept.update(self._chain(S, C, B))
        if self.buckets == 1:
            self.bucket_accept[0] = dict(self.accept)
            return
        k = float(self.shrink)
        for b in range(self.buckets):
            Sb, Cb, Bb = {}, {}, {}
            for w in self.accept:
                n = C[w]
                Sb[w] = self.bucket_sum[b][w] + (k * S[w] / n if n > 0 else 0.0)
                Bb[w] = self.bucket_below[b][w] + (k * B[w] / n if n > 0 else 0.0)
                Cb[w] = self.bucket_count[b][w] + (k if n > 0 else 0.0)
            est = dict(self.accept)
            est.update(self._chain(Sb, Cb, Bb))
            self.bucket_accept[b] = est

    def mix_accept(self, ages: Sequence[int]) -> Dict[int, float]:
        """Expected accepted tokens per request at each width for requests of these ages (output
        tokens emitted): the mean of their buckets' estimates (the pooled estimate without ages or
        without buckets)."""
        if self.buckets == 1 or not ages:
            return dict(self.accept)
        hist = collections.Counter(self.bucket_of(a) for a in ages)
        n = float(len(ages))
        return {w: sum(c * self.bucket_accept[b][w] for b, c in hist.items()) / n for w in self.accept}

    def overhead(self, bs: int, width: Optional[int] = None) -> float:
        """Per-round ms outside the cost table (0 until observed; never below 0) of a round at
        ``width``.  With the batch's KV length known (``kv_k``) and a fitted choice of the round's
        kind: :meth:`width_overhead`.  Else one value per kind: no speculation (NO_SPEC) has its own
        once measured, every tree width shares one.  One value for every batch size (``bs`` is
        accepted so callers need not know that)."""
        if self.kv_k is not None and width is not None:
            est = self.width_overhead(width, float(self.kv_k))
            if est is not None:
                return max(0.0, est)
        if width == NO_SPEC and self.overhead_plain_ms is not None:
            return max(0.0, float(self.overhead_plain_ms))
        return max(0.0, float(self.overhead_ms))

    def _fitted(self) -> Dict[int, Tuple[float, float, int]]:
        """The fits with at least ``width_min_samples`` rounds."""
        return {c: f for c, f in self.width_fit.items() if f[2] >= self.width_min_samples}

    def width_overhead(self, choice: int, K: float) -> Optional[float]:
        """Overhead ms of a round at ``choice`` when the batch holds ``K`` thousand KV tokens, from the
        rounds measured at each choice (issue 41 item 3).  The start-up table is timed with almost no
        KV, so at a long context a round's attention and the drafter's (which grow with the context)
        land here, and they differ by width: one shared tree overhead priced a narrow width with the
        wide tree's verify and plain decoding with the whole tree's context cost (in a simulation of
        32k- and 128k-token requests, ``tests/test_policy_simulation.py``, the controller then served
        0.35-0.64x the best fixed choice).  A choice measured in at least ``width_min_samples``
        recent rounds: its own fit ``a + b K``.  Otherwise the fitted tree widths' line
        ``c0 + c1 w`` (:meth:`_tree_line`; one fitted width: its estimate scaled by
        ``(draft_queries + w) / (draft_queries + m)``), and for no speculation ``c1``, one verify
        query's cost with no drafter and no host work, which errs cheap: a plain round gets run and
        measured.  None when no tree width is fitted (the per-kind overhead then applies)."""
        fits = self._fitted()
        own = fits.get(choice)
        if own is not None:
            return own[0] + own[1] * K
        line = self._tree_line(K)
        if line is None:
            return None
        c0, c1 = line
        return c1 if choice == NO_SPEC else max(0.0, c0 + c1 * choice)

    def _tree_line(self, K: float) -> Optional[Tuple[float, float]]:
        """(c0, c1): the fitted tree widths' overhead at ``K`` as ``c0 + c1 w`` (c1: one verify
        query's cost, c0: the width-free part, the drafter's block and host work), None without a
        fitted tree width.  Two or more: their least-squares line (slope floored at 0); one, width
        ``m`` with estimate ``e``: ``c1 = e / (draft_queries + m)``, ``c0 = draft_queries c1`` (the
        drafter's block priced as ``draft_queries`` verify queries)."""
        trees = {w: f[0] + f[1] * K for w, f in self._fitted().items() if w != NO_SPEC}
        if not trees:
            return None
        if len(trees) == 1:
            (m, est), = trees.items()
            c1 = est / (float(self.draft_queries) + m)
            return float(self.draft_queries) * c1, c1
        ws = sorted(trees)
        mw = sum(ws) / len(ws)
        me = sum(trees[w] for w in ws) / len(ws)
        slope = max(0.0, sum((w - mw) * (trees[w] - me) for w in ws) / sum((w - mw) ** 2 for w in ws))
        return me - slope * mw, slope

    def tokens_per_request(self, width: int) -> float:
        """Tokens a request emits in a round at ``width`` (accepted + the bonus; 1 without speculation):
        for the batch of the last :meth:`choose` given ages, else the pooled estimate."""
        if width == NO_SPEC:
            return 1.0
        return 1.0 + (self.accept if self.batch_accept is None else self.batch_accept)[width]

    def admission_ms(self, bs: int, width: int) -> float:
        """Expected ms of prefill per round of ``bs`` requests at ``width``: ``prefill_ms`` times the
        chance that at least one request finishes in it (Poisson, ``finish_rate`` per token)."""
        if self.prefill_ms <= 0 or self.finish_rate <= 0:
            return 0.0
        lam = self.finish_rate * bs * self.tokens_per_request(width)
        return float(self.prefill_ms) * (1.0 - math.exp(-lam))

    def round_ms(self, bs: int, width: int) -> float:
        """Predicted ms of a round of ``bs`` requests at ``width``: the table's cost + the overhead
        + the expected admission prefill after it."""
        return self.round_cost(bs, width) + self.admission_ms(bs, width)

    def draft_overhead(self) -> float:
        """The drafter block's ms beyond its table row at the batch's context (``kv_k``): the
        width-free part of the fitted tree widths' overhead (:meth:`_tree_line`'s c0, floored at 0),
        0 without a fit or a known context.  What a draft-only probe costs on top of
        ``CostTable.draft_cost``."""
        line = None if self.kv_k is None else self._tree_line(float(self.kv_k))
        return 0.0 if line is None else max(0.0, line[0])

    def round_cost(self, bs: int, width: int) -> float:
        """The table's cost + the overhead of a round (no admission term): what a probe at ``width``
        costs."""
        return self.costs.cost(bs, width) + self.overhead(bs, width)

    @staticmethod
    def fit_width_overhead(samples: Sequence[Tuple[float, float]], min_spread: float = 1.0
                           ) -> Optional[Tuple[float, float, int]]:
        """(a, b, n): ms = a + b * K over ``samples`` [(residual ms, K thousand KV tokens)] (None when
        empty).  Robust (Theil-Sen): b = the median slope over the pairs of samples whose K differ by
        at least ``min_spread`` / 2, floored at 0, when the samples' K span (10th to 90th percentile)
        is at least ``min_spread`` thousand and a quarter of the median K, and at least 8 such pairs
        exist; else b = 0 (one context length: the residual's median).  a = the median of
        residual - b K.  A spike (an admission, a GC pause) moves neither."""
        n = len(samples)
        if n == 0:
            return None
        r = np.fromiter((x for x, _ in samples), dtype=np.float64, count=n)
        k = np.fromiter((y for _, y in samples), dtype=np.float64, count=n)
        b = 0.0
        if n >= 4:
            lo, mid, hi = np.percentile(k, (10, 50, 90))
            if hi - lo >= max(min_spread, 0.25 * mid):
                dk = k[None, :] - k[:, None]
                keep = dk >= 0.5 * min_spread          # each pair once (dk > 0), far enough apart
                if int(keep.sum()) >= 8:
                    b = max(0.0, float(np.median((r[None, :] - r[:, None])[keep] / dk[keep])))
        a = float(np.median(r - b * k))
        return a, b, n

    @staticmethod
    def overhead_of(samples: Sequence[float]) -> Optional[float]:
        """The overhead a set of samples says: their median (None without samples)."""
        return float(statistics.median(samples)) if len(samples) else None

    def observe_interval(self, bs: int, width: int, interval_ms: float,
                         into: Optional[Deque[float]] = None) -> bool:
        """One host-clock interval that measures a round of ``bs`` requests at ``width`` (which one:
        ``adaptive.WidthController``).  Appends ``interval - cost(bs, width)`` to ``into`` (default:
        this policy's ring of the round's kind, ``samples_plain`` for NO_SPEC else ``samples``, and
        ``overhead_plain_ms`` / ``overhead_ms`` becomes its median; the controller keeps each rank's
        own rings and shares rank 0's medians at windows), signed: a round faster than the
        table pulls the median down, so noise in the host clock (an interval that is partly the
        previous round's) cancels instead of only ever adding.  Returns False (ignored) for an
        interval longer than 4x the cost + 20 ms (the server was idle or prefilling, not a round's
        overhead) or not a positive finite number."""
        plain = width == NO_SPEC
        ring = into if into is not None else (self.samples_plain if plain else self.samples)
        cost = self.costs.cost(bs, width)
        ms = float(interval_ms)
        if not (ms > 0 and ms < float("inf")) or ms > 4 * cost + 20.0:
            return False
        ring.append(ms - cost)
        if into is None:
            setattr(self, "overhead_plain_ms" if plain else "overhead_ms", self.overhead_of(ring))
        return True

    def tokens_per_ms(self, bs: int, width: int) -> float:
        """Expected output tokens per millisecond of a round of ``bs`` requests at ``width``."""
        return bs * self.tokens_per_request(width) / self.round_ms(bs, width)

    def score(self, bs: int, width: int, tokens_per_ms: Optional[float] = None,
              margin: Optional[float] = None) -> float:
        """What :meth:`choose` compares: :meth:`tokens_per_ms` (or the given value), for a tree width
        divided by ``1 + spec_margin (1 - 1/bs)`` when no speculation is among the choices, and on a
        synced batch (:attr:`synced_left` given, bs >= 2) by ``1 + m`` with the larger
        ``m = min(sync_margin, (bs - 1) sync_admission_ms / (synced_left x plain round ms))``: the
        admissions a spread costs, over the plain decoding time they are paid back in (:meth:`margin`;
        ``margin``: that value when the caller already has it for ``bs``).

        Why a margin: the estimate a tree is chosen on is the one that happened to read high, and
        speculation has a cost the per-round model does not price.  Requests that plain decoding
        finishes in the same round (a benchmark's fixed output length, admitted together) finish in
        different rounds once their trees accept different lengths, and the server then pays up to
        ``bs`` admission prefills per wave instead of one batched prefill (``1 - 1/bs``: the share of
        admissions that lose their batch; none at bs 1).  Measured on the H100 (Qwen3-8B-shaped chain
        pair, random ids 512 in / 256 out, c = 16,
        ``bench/results/raw/serving_h100_qwen3-8bchain_random_s32.md`` and its profile records):
        without a margin the policy ran trees in 20-26 % of the rounds of two repeats at estimated
        gains of 3-20 % (10 of 101 records with trees above 13 %), and those repeats served 1721 and
        1743 tok/s (TPOT 8.8 ms) where the repeat that stayed plain served 1853 and the forced
        no-speculation server 1874-1893 (TPOT 7.9).  The split: the rounds' own GPU time per repeat
        rose by ~2 % (28.8 s against 28.2: the tree rounds about broke even), the wall clock outside
        the rounds from 3.3 s to 5.2-5.3 s (the admissions, no longer batched: TTFT median 47-60 ms
        against 160-175).

        Synced (``adaptive.synced_tokens_left``: a few distinct numbers of tokens left, as such
        requests admitted in one to three prefill batches have): the spread is for good (with fixed
        lengths the finishes never line up again), a one-time cost of up to ``bs - 1`` unbatched
        admissions that only the gain over the tokens left pays back.  ``sync_admission_ms`` = 30 is
        s32's: the two repeats with trees spent 1.9-2.0 s more outside the rounds than the plain one
        over 4 waves of 16 requests, ~32 ms for each of the 60 admissions that lost their batch.
        At bs 16, 256 tokens out and a 7.9 ms plain round that asks 22 % at a wave's start (more as
        it runs down: near its end trees cannot pay back, ``sync_margin`` caps it), at 1024 tokens out
        6 %.  On ``tests/test_policy_simulation.py``'s lock-step server (``run_waves``: bs 16, 256
        tokens out) a marginal workload served less than 0.99x plain decoding on some seed without the
        margins, and with ``spec_margin`` alone a short excursion into trees where width 8 broke even
        cost 3 % for the rest of the level.

        What they give up at bs 16: from no speculation, a tree width whose estimated gain is below
        ~12.6 % (9.4 % and ``hysteresis``; synced: the margin above and ``hysteresis``); a running
        tree width stays while its
        estimated gain is above ~6 %.  In the long-context simulation (not synced) one of three seeds
        at 8k tokens and bs 4 then serves 0.92x the best fixed choice (width 16, 1.16x plain
        decoding) where it served 0.98x or more without ``spec_margin``."""
        tpm = self.tokens_per_ms(bs, width) if tokens_per_ms is None else float(tokens_per_ms)
        if width != NO_SPEC and self.allow_no_spec:
            return tpm / (1.0 + (self.margin(bs) if margin is None else margin))
        return tpm

    def margin(self, bs: int) -> float:
        """The fraction a tree width's tokens per ms must beat no speculation by at ``bs`` (:meth:`score`)."""
        m = self.spec_margin * (1.0 - 1.0 / max(int(bs), 1))
        if self.synced_left is not None and bs >= 2:
            wave_ms = max(float(self.synced_left), 1.0) * self.round_ms(bs, NO_SPEC)
            m = max(m, min(self.sync_margin, (bs - 1) * self.sync_admission_ms / max(wave_ms, 1e-9)))
        return m

    def candidates(self, bs: Optional[int] = None) -> List[int]:
        """The choices for a batch of ``bs`` requests: no speculation (if allowed) and every tree
        width whose graphs cover ``bs``; when no-speculation is allowed, a batch past every tree
        width's graphs (``spec_algo.SPEC_GRAPH_MAX_BS`` by default) runs plain decoding only; when it
        is not, every width stays (eager past its graphs).  ``bs`` None: every choice."""
        ws = self.costs.widths
        if bs is not None and self.allow_no_spec:
            ws = [w for w in ws if self.costs.covers(bs, w)]
        return ([NO_SPEC] if self.allow_no_spec else []) + ws

    def choose(self, bs: int, ages: Optional[Sequence[int]] = None) -> int:
        """The verify width for the next round of ``bs`` requests (NO_SPEC: plain decode); ``ages``:
        the output tokens each of them has emitted (the acceptance is then :meth:`mix_accept` of
        them, kept in ``batch_accept`` until the next choice; without: the pooled estimate)."""
        if bs < 1:
            raise ValueError(f"batch size must be >= 1, got {bs}")
        self.batch_accept = None if not ages or self.buckets == 1 else self.mix_accept(ages)
        m = self.margin(bs)          # one per batch size: every tree width is held to the same bar
        scores = {w: self.score(bs, w, margin=m) for w in self.candidates(bs)}
        best = max(scores, key=lambda w: (scores[w], -w))   # ties: the narrower (cheaper) width
        if self.current in scores and scores[best] <= scores[self.current] * (1 + self.hysteresis):
            return self.current
        self.current = best
        return best
