"""The adaptive budget's per-round choice (issues 17, 39): :class:`WidthController`.

Each round it picks the verify width (a forced cycle of the A/B's switch ``budget_cycle``, a request's
own budget, a probe, or the policy's choice, ``budget_policy.BudgetPolicy``), measures the host
interval between launches as the round's overhead, and feeds the policy the counterfactual counts of
``round_stats.CounterfactualWindow``.  Switch ``probe_every`` (default 16): at most every k-th round
runs a wider tree than the chosen one (a probe, paid from 5 % of the rounds' cost) so the
counterfactual acceptance of wider widths stays measured; a no-speculation stretch pays draft-only
probes (the drafter block and the widest tree for the tree's own estimate, ``accept_estimate.py``),
and a tree stretch pays plain probes (a plain round) while plain decoding's estimate is stale (cold
samples of the warm-up, or aged out: ``WidthController._recent``, ``_plain_probe``).
The settings are ``adaptive_config.py``; the target states per width and the start-up cost table
``verify_states.py``; the no-speculation round's tree ``ddtree.root_only_tree``.  CPU-tested with
fakes for cost and acceptance (``tests/test_adaptive_*.py``, ``tests/test_policy_simulation.py``).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from .adaptive_config import AdaptiveConfig
from .budget_policy import NO_SPEC, BudgetPolicy
from .round_stats import CounterfactualWindow

logger = logging.getLogger(__name__)

PREDICT_EVERY = 4        # a tree round narrower than the widest predicts every width on every k-th round
DRAFT_PROBE_SHARE = 0.005  # a no-speculation stretch pays draft-only probes from 0.5 % of its rounds' time
CLOSE_DRAFT_PROBE_SHARE = 0.01   # ... 1 % while a tree width could win at PROBE_OPTIMISM x its estimate
PLAIN_PROBE_SHARE = 0.04  # while plain decoding's estimate is stale, a tree stretch pays plain probes
                          # (one plain round each) from 4 % of its rounds' time (WidthController._plain_probe)



class WidthController:
    """Per round: :meth:`next_width` (host values only), then :meth:`record` with the accepted path.

    Order of the choice: the forced cycle (test switch); before the first window of counts, the
    widest width whose cost is at most twice the narrowest tree's at this batch size (the counts of
    every narrower width come with it); else ``policy.choose(bs)``, except on a probe round.

    Probes keep the acceptance of widths wider than the chosen one measured (a narrow round says
    nothing about a wider tree).  A probe runs the widest width that could still win
    (:meth:`_probe_target`; none: no probe) and is paid from a credit of
    ``probe_share`` (default 5 %) of each round's predicted time (``BudgetPolicy.round_ms``: the
    table's cost + the measured overhead + the expected admission): it runs when at least
    ``probe_every`` rounds have passed since the last one and the credit covers its extra GPU cost
    over the chosen width, which the credit then loses (so probes add at most ~5 % to the rounds'
    time).  Until session 20 the credit was 5 % of the table's GPU cost alone: on the MoE chain
    pair at c = 1 (H200, ``bench/results/raw/scalechain_ab_qwen3-30b-a3b_h200_s20_logs.tgz``) a plain
    round's table cost was 2.06 ms and its wall time ~4 ms, so a probe came every ~55 rounds, and
    after a burst of fresh requests the estimate needed several probes to recover.  A
    width-32 probe at bs 64 costs 15 plain decode steps on the Kimi-widths pair (H200 cost table,
    ``bench/results/raw/ab_h200_kimicost_chain_run1_auto_server_log.txt``); probing it every 16th
    round, as this class did, made the mean round at c = 64 about 65 % longer than the median
    (16.9 vs 10.2 ms, ``raw/ab_h200_kimicost_chain_run1_profile_auto.jsonl``).  No probe is needed
    while the widest width is the choice.  The reverse, a plain probe, keeps plain decoding's cost
    measured while trees run (:meth:`_plain_probe`), and estimates are made from fresh samples
    (:meth:`_recent`: past the warm-up, at most FRESH_ROUNDS old) once there are enough of them.

    The round overhead (``BudgetPolicy.observe_interval``): the host clock between consecutive batch
    launches (``next_width`` for a round, :meth:`interrupt` for any other batch: the worker calls it
    for every prefill / extend / idle batch), attributed to the batch that interval measures.  Under
    SGLang's overlap scheduler (``lag=1``) the host launches batch i + 1 only after it has processed
    the result of batch i - 1, so the interval from launch i to launch i + 1 is the GPU time of batch
    i - 1, not of batch i (lag 0 without overlap).  An interval that measures a prefill or idle batch
    is not observed.  Measured on the H200 (Qwen3-8B-shaped chain pair,
    ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s15_run2_logs.tgz``): with the interval attributed to
    the batch launched at its start (lag 0 under overlap), every admission prefill's 5-20 ms landed
    in the following round's overhead and every switch from a wide to a narrow width (a probe, say)
    added the wide round's extra cost to the narrow one's; the policy then chose widths 16-32 where
    width 8 served 8-18 % more tokens per second.  Each rank measures its own, so ``share`` (the worker: TP rank 0's object
    broadcast to every rank) is applied when a window of counts arrives, at the same round on every
    rank; until then the policy keeps the last shared values.  Every rank thus sees the same rounds,
    counts and overheads (``CounterfactualWindow`` applies a window at a fixed round), so TP ranks
    choose alike."""

    def __init__(self, cfg: AdaptiveConfig, *, policy: Optional[BudgetPolicy], device,
                 window_every: int = 8, window_lag: int = 4, probe_share: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter,
                 share: Optional[Callable[[dict], dict]] = None, lag: int = 0,
                 plain_probe_share: float = PLAIN_PROBE_SHARE):
        if not 0.0 <= probe_share < 1.0:
            raise ValueError(f"probe_share must be in [0, 1), got {probe_share}")
        if not 0.0 <= plain_probe_share < 1.0:
            raise ValueError(f"plain_probe_share must be in [0, 1), got {plain_probe_share}")
        if lag not in (0, 1):
            raise ValueError(f"lag must be 0 (no overlap scheduling) or 1 (overlap), got {lag}")
        self.cfg = cfg
        self.policy = policy
        self.spec_widths = [b + 1 for b in cfg.budgets]
        self.window = CounterfactualWindow(list(cfg.budgets), device=device, every=window_every,
                                           lag=window_lag, age_edges=policy.age_edges if policy else ())
        self.round = 0
        self.chosen: Dict[int, int] = {}
        self.probes = 0
        self.probe_share = float(probe_share)
        self.probe_credit = 0.0
        self._since_probe = 0
        # plain probes: a no-speculation round instead of the chosen tree (:meth:`_plain_probe`)
        self.plain_probe_share = float(plain_probe_share)
        self.plain_probes = 0
        self.plain_credit = 0.0
        self._since_plain = 0
        # rank 0's fresh no-speculation samples at the last window (shared; None: none ever taken)
        self.plain_fresh: Optional[int] = None
        # this round hands the policy the tree's own estimate of every width (``predict``); in a
        # no-speculation round that is a draft-only probe (the drafter block and the widest tree, no
        # verify), paid from ``draft_credit``
        self.predict = False
        self.draft_probes = 0
        self.draft_credit = 0.0
        self._limits = None   # (key, [2, bs] device tensor) of the last batch: token limits, prompt lengths
        self._clock = clock
        self._share = share
        self.lag = int(lag)
        # the last lag + 1 launched batches, oldest first: (bs, width, K or None) of a round, None for
        # any other
        self._launched: List[Optional[Tuple[int, int, Optional[float]]]] = []
        self._t_launch: Optional[float] = None   # host clock of the last launch
        # this rank's overhead samples (its median is shared at windows: every rank the same value)
        self._local_overhead = deque(maxlen=int((policy or BudgetPolicy).overhead_window))
        self._local_overhead_plain = deque(maxlen=int((policy or BudgetPolicy).overhead_window))
        # ... and per choice, with the batch's KV length: [(residual ms, K thousand KV tokens)]
        self._local_width: Dict[int, Deque[Tuple[float, float]]] = {}
        # the round (``self.round``) each of those samples was taken at, ring by ring (:meth:`_recent`)
        self._taken: Dict[int, Deque[int]] = {}
        self._kv_k: Optional[float] = None     # this round's batch KV tokens / 1000 (next_width)
        self.intervals = {"observed": 0, "ignored": 0, "other_batch": 0}
        # admissions, from the wall clock: this window's sums (host ms between launches, the table
        # cost of the rounds those intervals measured, ...) and decayed sums over windows
        self._acc = dict.fromkeys(self._ACC_KEYS, 0.0)
        self._adm = dict.fromkeys(("excess", "prefills", "flagged", "rounds", "tokens"), 0.0)

    def _launch(self, batch: Optional[Tuple[int, int, Optional[float]]]) -> None:
        """A batch is being launched now (``(bs, width, K)`` of a round, K its thousand KV tokens or
        None, and None for any other batch): the
        interval since the previous launch measures the batch launched ``lag`` launches before that
        one; fold it into this rank's overhead samples if that batch was a round, and into the
        window's wall-clock sums (``_close_window``) either way."""
        now = self._clock()
        measuring = self.policy is not None and self.cfg.overhead
        if measuring and self._t_launch is not None and len(self._launched) > self.lag:
            measured = self._launched[-1 - self.lag]
            ms = (now - self._t_launch) * 1e3
            acc = self._acc
            est = None       # the measured round's overhead at its context (the context axis)
            max_gap = self.MAX_GAP_MS
            if measured is None:
                self.intervals["other_batch"] += 1
            else:
                bs, w, K = measured
                cost = self.policy.costs.cost(bs, w)
                ring = self._local_overhead_plain if w == NO_SPEC else self._local_overhead
                ok = self.policy.observe_interval(bs, w, ms, into=ring)
                if ok:
                    self._stamp(ring)
                self.intervals["observed" if ok else "ignored"] += 1
                if K is not None:
                    est = self.policy.width_overhead(w, K)
                    self._width_sample(w, ms - cost, K)
                    if est is not None:   # a long context's rounds may take longer than MAX_GAP_MS
                        max_gap = max(max_gap, 4.0 * (cost + est) + 20.0)
            if 0.0 < ms <= max_gap:                  # longer: the server was idle
                acc["host"] += ms
                if measured is None:
                    acc["prefills"] += 1
                elif est is not None:                # table + this round's own overhead estimate
                    acc["table"] += cost + max(0.0, est)
                else:
                    acc["table"] += cost
                    acc["measured_plain" if w == NO_SPEC else "measured_rounds"] += 1
        if measuring:
            if batch is None:
                if self._launched and self._launched[-1] is not None:
                    self._acc["flagged"] += 1         # the first prefill after a round
            else:
                bs, w = batch[:2]
                self._acc["rounds"] += 1
                self._acc["tokens"] += bs * self.policy.tokens_per_request(w)
        self._launched = (self._launched + [batch])[-(self.lag + 1):]
        self._t_launch = now

    MAX_GAP_MS = 250.0   # a longer gap between launches is idle time, not a batch
    WIDTH_WINDOW = 32    # recent rounds per choice in its context fit (BudgetPolicy.width_overhead)

    def _width_sample(self, choice: int, residual: float, K: float) -> None:
        """One round's residual (host interval - table cost, ms) at ``K`` thousand KV tokens into the
        choice's ring.  Not through ``observe_interval``'s filter (4x the table cost + 20 ms), which
        at a long context rejects every round (the table has no context in it); instead a residual
        above 4x the ring's median + 20 ms (an idle gap, once the ring holds 4) is left out."""
        if not math.isfinite(residual):
            return
        ring = self._local_width.setdefault(choice, deque(maxlen=self.WIDTH_WINDOW))
        if len(ring) >= 4 and residual > 4.0 * max(statistics.median(r for r, _ in ring), 0.0) + 20.0:
            return
        ring.append((float(residual), float(K)))
        self._stamp(ring)

    WARM_ROUNDS = 64       # samples of the controller's first rounds are cold (see _recent)
    FRESH_ROUNDS = 1024    # ... and samples older than this many rounds stale

    def _stamp(self, ring: Deque) -> None:
        """The sample just appended to ``ring`` was taken at this round."""
        taken = self._taken.setdefault(id(ring), deque(maxlen=ring.maxlen))
        taken.append(self.round)

    def _fresh_from(self) -> int:
        """The first round whose samples are fresh: past the warm-up and at most FRESH_ROUNDS old."""
        return max(self.WARM_ROUNDS, self.round - self.FRESH_ROUNDS)

    def _fresh_count(self, ring: Deque) -> int:
        cut = self._fresh_from()
        return sum(1 for r in self._taken.get(id(ring), ()) if r >= cut)

    def _recent(self, ring: Deque) -> list:
        """The samples of ``ring`` an estimate is made from: its fresh ones (:meth:`_fresh_from`) once
        there are ``width_min_samples`` of them, else all it holds.  Why: a choice that stops running
        keeps its last samples for good, and if they were taken cold (the server's first requests,
        JIT, first allocations) its estimate stays wrong and nothing runs it again.  Measured on the
        H100 (code pair, c = 1 and 16, ``bench/results/raw/codepair_default_h100_profile_ddtree.jsonl.gz``):
        plain decoding's 8 samples of the first ~30 rounds read 7.4 ms over the table (a plain round
        took 2.5 ms of GPU time then) and stayed the estimate for 2300+ intervals; the widest width's
        first fit read 7.7 ms where its later ones read 3.4-4.0.  A fresh estimate replaces the old
        one whole rather than being blended into its median (8 cold samples outvote 7 fresh ones);
        until it has enough samples the old one stands."""
        cut = self._fresh_from()
        taken = self._taken.get(id(ring), ())
        if len(taken) != len(ring):          # a ring filled without stamps (tests): all of it
            return list(ring)
        fresh = [x for x, r in zip(ring, taken) if r >= cut]
        n = self.policy.width_min_samples if self.policy is not None else 4
        return fresh if len(fresh) >= n else list(ring)
    _ACC_KEYS = ("host", "table", "measured_rounds", "measured_plain", "prefills", "flagged", "rounds", "tokens")

    def _close_window(self) -> Dict[str, Optional[float]]:
        """Fold this window's sums into the decayed ones (decay ``policy.ema``, as the acceptance)
        and return this rank's figures for the policy (None: not measured yet): the round overhead
        (median of the interval samples), the prefill batch's ms (decayed excess wall clock per
        prefill, at least 0) and the finish rate per output token: from the share p of rounds
        followed by a prefill and their mean emitted tokens T (decayed sums), the Poisson rate
        -ln(1 - p) / T (p capped at 0.98; needs 8 rounds' weight).
        The prefills' time is what the wall clock left over: host ms between launches - the table
        cost of the rounds they measured - those rounds x the median round overhead.  A ratio of
        sums over the window, so it does not depend on which interval the overlap scheduler's lag
        puts a prefill in: measured on the H200 (dense, c = 64, ``raw/..._s16_run2_logs.tgz``,
        records of 16 rounds at bs ~60: GPU 17.5 ms, wall 29.3 ms, 12 prefills), the intervals
        attributed to prefills read 7.5 ms (median) where the wall clock says ~15.7."""
        acc, adm, d = self._acc, self._adm, self.policy.ema
        over = self.policy.overhead_of(self._recent(self._local_overhead))
        over_plain = self.policy.overhead_of(self._recent(self._local_overhead_plain))
        for k in adm:
            adm[k] *= d
        if acc["prefills"] > 0:
            adm["excess"] += (acc["host"] - acc["table"] - acc["measured_rounds"] * (over or 0.0)
                              - acc["measured_plain"] * (over_plain if over_plain is not None else (over or 0.0)))
            adm["prefills"] += acc["prefills"]
        for k in ("flagged", "rounds", "tokens"):
            adm[k] += acc[k]
        self._acc = dict.fromkeys(self._ACC_KEYS, 0.0)
        out = {"overhead_ms": over, "overhead_plain_ms": over_plain, "prefill_ms": None, "finish_rate": None}
        if self._local_width:    # the context axis (rounds told their batch's KV tokens)
            out["width_fit"] = {c: BudgetPolicy.fit_width_overhead(self._recent(r))
                                for c, r in self._local_width.items() if r}
        if self._local_overhead_plain:   # plain decoding's fresh samples (shared: the plain probes' rate)
            out["plain_fresh"] = float(self._fresh_count(self._local_overhead_plain))
        if adm["prefills"] > 0:
            out["prefill_ms"] = max(0.0, adm["excess"] / adm["prefills"])
        if adm["rounds"] >= 8 and adm["tokens"] > 0:
            p = min(adm["flagged"] / adm["rounds"], 0.98)
            out["finish_rate"] = -math.log(1.0 - p) / (adm["tokens"] / adm["rounds"])
        return out

    def interrupt(self) -> None:
        """A batch other than a decode round is being launched (a prefill, a mixed extend, an idle
        batch): the interval that measures it is not a round's overhead sample (it counts in the
        window's wall-clock sums, which give the prefills' cost).
        Measured on the H200 (Qwen3-8B-shaped chain pair, c = 64,
        ``bench/results/raw/scalechain_ab_qwen3-8b_h200_run1_logs.tgz``, profile records): groups of
        rounds at a constant batch of 63-64 took 0-2 ms a round over their GPU time, groups with
        admissions in them 10-20 ms; folded in as a per-round cost, the admissions made every round
        look expensive, which favours the widest trees and never plain decoding (a prefill stalls
        the batch once per admitted request, whatever the width)."""
        self._launch(None)

    def snapshot(self) -> dict:
        """The policy's state for the round profiler's records (host values, no device work): the
        acceptance averages per width (pooled, for the last choice's batch, per age bucket), their
        weights (decayed request-round counts), the shared
        overhead and this rank's sample count, the rounds per width, probes and the interval counts."""
        out = {"chosen": {str(w): n for w, n in sorted(self.chosen.items())}, "probes": self.probes,
               "draft_probes": self.draft_probes, "plain_probes": self.plain_probes,
               "intervals": dict(self.intervals), "lag": self.lag}
        taken = self._taken.get(id(self._local_overhead_plain))
        if taken:   # plain decoding's estimate: rounds since its newest sample, its fresh samples
            out["plain_age"] = self.round - taken[-1]
            out["plain_fresh"] = self._fresh_count(self._local_overhead_plain)
        if self.policy is not None:
            pol = self.policy
            out["accept"] = {str(w): round(a, 4) for w, a in sorted(pol.accept.items())}
            out["accept_weight"] = {str(w): round(c, 2) for w, c in sorted(pol.accept_count.items())}
            if pol.ratio is not None:             # the tree's estimate: calibration and its weight
                out["calibration"] = {str(w): round(r, 4) for w, r in sorted(pol.ratio.items())}
                out["calibration_weight"] = {str(w): round(c, 2) for w, c in sorted(pol.cal_n.items())}
                out["predicted_weight"] = round(sum(pol.pred_n), 2)
            if pol.batch_accept is not None:      # the last choice's batch, weighed by its ages
                out["accept_batch"] = {str(w): round(x, 4) for w, x in sorted(pol.batch_accept.items())}
            if pol.buckets > 1:                   # per age bucket (its lower edge) with any weight
                lows = (0,) + pol.age_edges
                out["accept_by_age"] = {
                    str(lows[b]): {str(w): round(x, 3) for w, x in sorted(pol.bucket_accept[b].items())}
                    for b in range(pol.buckets) if max(pol.bucket_count[b].values()) >= 1.0}
            out["overhead_ms"] = round(float(pol.overhead_ms), 3)
            out["overhead_samples"] = len(self._local_overhead)
            if pol.overhead_plain_ms is not None:
                out["overhead_plain_ms"] = round(float(pol.overhead_plain_ms), 3)
                out["overhead_plain_samples"] = len(self._local_overhead_plain)
            if pol.width_fit:      # the context axis: each choice's a + b K (ms, K = thousand KV tokens)
                out["width_fit"] = {str(c): [round(f[0], 3), round(f[1], 4), f[2]]
                                    for c, f in sorted(pol.width_fit.items())}
            if pol.kv_k is not None:
                out["kv_k"] = round(float(pol.kv_k), 2)
            out["prefill_ms"] = round(float(pol.prefill_ms), 3)
            out["finish_rate"] = round(float(pol.finish_rate), 5)
            out["prefills_weight"] = round(self._adm["prefills"], 2)
        return out

    def _first_width(self, bs: int) -> int:
        if self.policy is None:
            return self.cfg.widest
        ws = [w for w in self.policy.candidates(bs) if w != NO_SPEC]
        if not ws:                     # past every tree width's graphs: plain decoding
            return NO_SPEC
        cost = self.policy.costs.cost
        cap = 2.0 * cost(bs, ws[0])
        return max(w for w in ws if cost(bs, w) <= cap)

    def _draft_probe(self, bs: int) -> bool:
        """A no-speculation round chosen by the policy: True when it should also run the drafter block
        and predict every width from the widest tree (a draft-only probe), paid from
        :data:`DRAFT_PROBE_SHARE` of the rounds' predicted time, at most every ``probe_every`` rounds;
        :data:`CLOSE_DRAFT_PROBE_SHARE` while a tree width could still win (:meth:`_probe_target`):
        the estimate of a stretch without trees moves only with these probes, and a low draw then
        kept the simulated server of ``tests/test_policy_simulation.py`` (32k-token requests, where
        width 16 served 1.19x plain decoding) on plain decoding for 500 rounds.  Over four seeds of
        that simulation (32k at bs 1 and 4, 8k at bs 1) the worst case served 0.84x the best fixed
        choice at 0.5 %, 0.97x at 1 %, 0.98x at 2 %; where plain decoding is right the probes cost up
        to their share of its time, hence 1 %.
        It replaces the widest-width verify probe there: at c = 64 on the Qwen3-8B-shaped chain pair
        (H200, ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s26_plain.md``) a width-61 verify probe
        took 99 ms at bs 63, 14 plain steps, where the drafter block is part of one."""
        cost = self.policy.costs.draft_cost(bs) + self.policy.draft_overhead()   # at the batch's context
        share = CLOSE_DRAFT_PROBE_SHARE if self._probe_target(bs, 1) is not None else DRAFT_PROBE_SHARE
        if not self._paid("draft_credit", share, bs, 1, cost):
            return False
        self.draft_probes += 1
        return True

    def _paid(self, credit: str, share: float, bs: int, w: int, cost: float, gap: str = "_since_probe") -> bool:
        """One round at choice ``w``: the credit named ``credit`` earns ``share`` of the round's
        predicted wall time (table + overhead + admission, not its GPU time alone), capped at the
        probe's ``cost`` (no burst of probes after a long stretch).  True, the credit paid and the gap
        (the counter named ``gap``) restarted, when ``probe_every`` rounds have passed since the last
        probe and it covers ``cost``."""
        since = getattr(self, gap) + 1
        setattr(self, gap, since)
        earned = min(getattr(self, credit) + share * self.policy.round_ms(bs, w), cost)
        setattr(self, credit, earned)
        if since < self.cfg.probe_every or earned < cost - 1e-9:
            return False
        setattr(self, credit, earned - cost)
        setattr(self, gap, 0)
        return True

    def _plain_probe(self, bs: int, w: int) -> bool:
        """A tree width ``w`` chosen by the policy: True when this round should run plain decoding
        instead (a plain probe) because plain decoding's estimate is stale: fewer than
        ``width_min_samples`` fresh samples (:meth:`_recent`: none since the warm-up, or all older
        than FRESH_ROUNDS).  Nothing else measures plain decoding while trees run (probes only go
        wider, :meth:`_probe_target`), and an estimate that read high once froze it out for good: on
        the H100 (code pair, c = 1 and 16,
        ``bench/results/raw/codepair_default_h100_profile_ddtree.jsonl.gz``) its 8 samples of the
        first ~30 rounds read 7.4 ms over its table cost against 3.5-4.2 ms for the tree widths, and
        the policy ran trees in 99 % of the rounds where plain decoding (SGLang's) served 1.4x /
        2.2x their tokens per second (the A/B at c = 1 / 16).  A plain round is lossless.  A plain
        decoding never measured is not probed: the policy prices it from the tree widths' line
        (``BudgetPolicy.width_overhead``), which errs cheap, and runs it itself.

        Paid as the other probes (:meth:`_paid`, its own credit and gap): the credit earns
        ``plain_probe_share`` (default :data:`PLAIN_PROBE_SHARE`, 4 %) of each tree round's predicted
        time and a probe costs the predicted time of the tree round it replaces, not the plain
        round's own (that is the estimate in doubt, and a high one would make probes rarer).  So a
        stale estimate is replaced (``width_min_samples`` = 4 probes) within ~100 rounds, and once
        fresh no probe runs until its samples age: over any FRESH_ROUNDS rounds at most ~4 plain
        probes (0.4 % of 1024 rounds; a few more if their intervals are filtered out), and never
        more than 4 % of the rounds' time.  What one costs is less than the tree round it replaces
        (a plain round takes less time, for fewer tokens), so where trees win the throughput lost
        is below those shares.  Off in the warm-up (a probe would measure the same cold server),
        without overhead measurement (switch ``round_overhead``: nothing would be learnt) and where
        plain decoding is no choice.  Staleness is rank 0's count at the last window
        (``plain_fresh``), so every TP rank probes at the same rounds."""
        if (self.plain_probe_share <= 0.0 or self.plain_fresh is None or not self.cfg.overhead
                or self.round <= self.WARM_ROUNDS or NO_SPEC not in self.policy.candidates(bs)):
            return False
        if self.plain_fresh >= self.policy.width_min_samples:
            self._since_plain, self.plain_credit = 0, 0.0
            return False
        if not self._paid("plain_credit", self.plain_probe_share, bs, w, self.policy.round_ms(bs, w),
                          gap="_since_plain"):
            return False
        self.plain_probes += 1
        return True

    def _probe_or(self, bs: int, w: int) -> int:
        """``w`` (the policy's choice) or, on a probe round, the widest width that could still win
        (:meth:`_probe_target`; its counts give every narrower width's too), once the credit covers
        its extra cost over ``w``.  A no-speculation choice with a drafter cost row probes with the
        drafter alone (:meth:`_draft_probe`)."""
        if w == NO_SPEC and self.policy.costs.draft_cost(bs) is not None:
            self.predict = self._draft_probe(bs)
            return w
        if w != NO_SPEC and self._plain_probe(bs, w):
            return NO_SPEC
        target = self._probe_target(bs, w)
        if target is None:              # no wider width could win: nothing worth measuring
            self._since_probe, self.probe_credit = 0, 0.0
            return w
        pol = self.policy     # with their overheads: at a long context the table alone misses most of it
        extra = max(pol.round_cost(bs, target) - pol.round_cost(bs, w), 0.0)
        if not self._paid("probe_credit", self.probe_share, bs, w, extra):
            return w
        self.probes += 1
        self.predict = True          # a probe's pairs calibrate the wide widths
        return target

    PROBE_OPTIMISM = 1.3   # a wider width is worth a probe if it wins with this much more acceptance

    def _probe_target(self, bs: int, w: int) -> Optional[int]:
        """The widest tree width above ``w`` (with graphs at ``bs``) that would beat ``w`` in tokens per
        ms if it accepted :attr:`PROBE_OPTIMISM` x its estimate, else None.  Its counts measure it and
        every narrower width, so one probe covers them all; a width that cannot win even so is not
        worth one.  Why 1.3: the tree's own estimate follows the workload, a probe only refreshes the
        calibration ratio, whose per-prompt spread was 0.76-1.21 (10th-90th percentile) on the text pair
        (``bench/results/accept_calibration_cpu.md``).  Measured on the H200 before this rule (Qwen3-8B-
        shaped chain pair, ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s26_plain.md``): the
        width-61 probes cost 26 ms at bs 16 and 99 ms at bs 63 where width 8 or plain decoding won by
        far."""
        pol = self.policy
        here = pol.score(bs, w)
        out = None
        for x in self.spec_widths:
            if x <= w or x not in pol.candidates(bs):
                continue
            a = pol.tokens_per_request(x) - 1.0
            if pol.score(bs, x, bs * (1.0 + self.PROBE_OPTIMISM * a) / pol.round_ms(bs, x)) > here:
                out = x
        return out

    def next_width(self, bs: int, requested: Optional[int] = None, reqs=None,
                   kv_tokens: Optional[int] = None) -> int:
        """The verify width of this round (1 = no speculation).  ``requested``: the width the batch's
        requests pin (:func:`requested_width`; a width of this controller's set), used instead of
        the policy's choice (the forced test cycle still wins).  ``reqs``: the batch's SGLang
        requests; with age buckets the policy weighs them by their ages (output tokens so far, the
        host's view: one round behind under overlap scheduling).  ``kv_tokens``: the batch's KV
        tokens (the host's committed lengths, summed): each choice is then priced at that context
        (``BudgetPolicy.width_overhead``) and the round's interval sample is kept with it."""
        self._kv_k = None if kv_tokens is None else float(kv_tokens) / 1000.0
        if self.policy is not None:
            self.policy.kv_k = self._kv_k
        for sums, counts, below, pred in self.window.due():
            if self.policy is not None:
                ws = self.spec_widths
                by_width = None if pred is None else {
                    k: [dict(zip(ws, x)) for x in v] for k, v in pred.items()}
                self.policy.update_window([dict(zip(ws, x)) for x in sums], [dict(zip(ws, x)) for x in counts],
                                          [dict(zip(ws, x)) for x in below], pred=by_width)
                local = self._close_window()
                shared = dict(self._share(local) if self._share else local)
                fresh = shared.pop("plain_fresh", None)
                if fresh is not None:
                    self.plain_fresh = int(fresh)
                for key, val in shared.items():
                    if val is not None:
                        setattr(self.policy, key, dict(val) if isinstance(val, dict) else float(val))
        r = self.round
        self.round += 1
        cfg = self.cfg
        self.predict = False
        if cfg.cycle is not None:
            b = cfg.cycle[r % len(cfg.cycle)]
            w = b + 1
        elif requested is not None:
            # checked at admission; a value that got past it runs the nearest narrower width
            w = max((x for x in self.cfg.widths if x <= requested), default=self.cfg.widths[0])
        elif self.policy is None or self.policy.rounds_seen == 0:
            w = self._first_width(bs)
        else:
            ages = None
            if reqs is not None and self.policy.buckets > 1 and all(hasattr(r, "output_ids") for r in reqs):
                ages = [len(r.output_ids) for r in reqs]
            self.policy.synced_left = synced_tokens_left(reqs)
            c = self.policy.choose(bs, ages)
            w = self._probe_or(bs, c)
        if w > 1 and r % PREDICT_EVERY == 0:
            self.predict = True
        self.chosen[w] = self.chosen.get(w, 0) + 1
        # a draft-only probe's interval holds the drafter block: not a plain round's context sample
        self._launch((int(bs), w, None if (w == NO_SPEC and self.predict) else self._kv_k))
        return w

    def record(self, path: torch.Tensor, width: int, reqs=None, seq_lens: Optional[torch.Tensor] = None,
               predicted: Optional[torch.Tensor] = None, cf: Optional[torch.Tensor] = None) -> None:
        """path [bs, D + 1] (root first, -1 padded): the round's accepted slots at ``width``; with the
        batch's SGLang requests and its committed lengths ``seq_lens`` [bs] (device), request-rounds
        past a request's max_new_tokens are not counted (:meth:`remaining_and_age`; see
        ``round_stats.CounterfactualWindow``) and each counts in its request's age bucket.
        ``predicted`` [bs, len(spec_widths)] (a round with :attr:`predict`): every width's expected
        acceptance from the widest tree (``accept_estimate.expected_accept``).  ``cf``: the round's
        counterfactual counts at the budgets its tree holds (``round_stats.RoundCounterfactual``;
        None: the window counts them)."""
        n_valid = sum(1 for w in self.spec_widths if w <= width)
        left = age = None
        # a no-speculation round without a prediction counts nothing: no device work for it
        if reqs is not None and seq_lens is not None and (n_valid or predicted is not None):
            left, age = self.remaining_and_age(reqs, seq_lens)
        self.window.record(path, n_valid, left, age, predicted=predicted, cf=cf)

    def remaining_and_age(self, reqs, seq_lens: torch.Tensor):
        """(:func:`remaining_tokens`, :func:`output_tokens`) for a batch of SGLang requests, [bs] each
        on the device; (None, None) when its requests do not carry what they need.  The limits and
        prompt lengths go to the device (pinned, behind the stream, no sync) once per batch
        composition and are reused while it stays."""
        reqs = list(reqs)
        if len(reqs) != seq_lens.shape[0] or not all(hasattr(r, "origin_input_ids") for r in reqs):
            return None, None
        key = (str(seq_lens.device), tuple(token_limits(reqs)), tuple(len(r.origin_input_ids) for r in reqs))
        if self._limits is None or self._limits[0] != key:
            consts = torch.tensor([key[1], key[2]], dtype=torch.int64).reshape(2, len(reqs))
            if seq_lens.device.type == "cuda":
                consts = consts.pin_memory().to(seq_lens.device, non_blocking=True)
            self._limits = (key, consts)
        consts = self._limits[1]
        return remaining_tokens(consts[0], seq_lens), output_tokens(consts[1], seq_lens)


NO_TOKEN_LIMIT = 1 << 40   # a request without max_new_tokens


def synced_tokens_left(reqs) -> Optional[float]:
    """The mean number of tokens the batch's requests have left when plain decoding would finish them
    in a few waves, else None: at least two requests, each with a ``max_new_tokens``, whose numbers
    of tokens left take at most ``max(1, bs // 4)`` distinct values (host values: output tokens so
    far, one round behind under overlap scheduling, alike for all).  A benchmark's fixed-length
    requests sent at once are admitted in one to three prefill batches (s28: 1 + 15, 11 + 4), so they
    finish in as many rounds and their successors are admitted as many batches.  None without
    requests or when any lacks them (``BudgetPolicy.margin``)."""
    if reqs is None:
        return None
    reqs = list(reqs)
    bound = max(1, len(reqs) // 4)
    left, total = set(), 0
    for req in reqs:
        mnt = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
        out = getattr(req, "output_ids", None)
        if mnt is None or out is None:
            return None
        n = int(mnt) - len(out)
        left.add(n)
        total += n
        if len(left) > bound:
            return None
    return total / len(reqs) if len(reqs) >= 2 else None


def token_limits(reqs) -> List[int]:
    """Per request: prompt length + max_new_tokens, the committed length (``seq_lens``) at which it
    has emitted all its tokens plus one (host values, fixed per request)."""
    out = []
    for req in reqs:
        mnt = getattr(req.sampling_params, "max_new_tokens", None)
        out.append(len(req.origin_input_ids) + (NO_TOKEN_LIMIT if mnt is None else int(mnt)))
    return out


def remaining_tokens(limits: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Tokens each request may still emit in a round that starts at committed length ``seq_lens``:
    a request of prompt length P has emitted ``seq_lens - P + 1`` tokens then (the KV holds the prompt
    and every output token but the last, which is the round's root), so ``limits - seq_lens - 1``
    with ``limits = P + max_new_tokens`` (:func:`token_limits`).  [bs] int64, device, no sync."""
    return limits.to(torch.int64) - seq_lens.to(torch.int64) - 1


def output_tokens(prompt_lens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Output tokens each request has emitted before a round that starts at committed length
    ``seq_lens`` (see :func:`remaining_tokens`): ``seq_lens - P + 1``.  [bs] int64, device, no sync."""
    return seq_lens.to(torch.int64) - prompt_lens.to(torch.int64) + 1
