"""Acceptance statistics of DDTree rounds, accumulated on the device and read without a host sync
(issue 17 items 1 and 4; opt-in).  Every metric is documented in ``docs/metrics.md``.

On when the server runs with ``--enable-metrics`` (SGLang's Prometheus endpoint) or when
``SGLANG_DDTREE_STATS_FILE=/path/x.jsonl`` is set.  Per round the worker hands over the accepted
paths ``[bs, W]``, their lengths, the built tree's depths ``[bs, N]`` and the round's verify width
N (a host int); on the device this adds up, with static shapes and no host sync:

* ``request_rounds`` and ``accepted``: request-rounds and accepted draft tokens (bonus excluded);
* ``length_hist [D + 1]``: request-rounds by accepted length (0 .. draft depth);
* ``counterfactual [nb]``: accepted tokens every smaller budget in ``budgets`` would have given in the
  same rounds (``tree_ops.counterfactual_accept_len``: a best-first tree is prefix-closed, so one
  round of the budget-b tree gives the exact count for every b' <= b, no extra forward); a budget
  wider than the round's own tree (adaptive budget) is unknown in that round and not counted: its
  request-rounds (``counterfactual_request_rounds``) are counted on the host;
* ``tree_depth_hist [D + 1]`` and ``tree_depth_sum``: request-rounds by the depth of the built tree
  (its deepest node; 0 = root only), and the sum of those depths;
* ``predicted [nb]`` (when the worker hands it over): the accepted tokens each of those budgets was
  expected to give on the same request-rounds from the trees' own path scores
  (``accept_estimate.expected_accept``: the drafter's probability of each node's path, summed), in
  thousandths, so ``counterfactual / predicted`` is the drafter's calibration against the target;
* on the host: rounds by chosen budget (``N - 1``; 0 = no speculation).

Every ``every`` rounds (``SGLANG_DDTREE_STATS_EVERY``, default 64) the accumulators are copied to
pinned host memory with ``non_blocking=True`` behind a CUDA event and zeroed; a later round reads the
copy once the event has completed (``query()``, never ``synchronize()``), then
* adds it to the Prometheus metrics (multiprocess mode, as SGLang's own scheduler metrics; created
  once per process, only with ``--enable-metrics``), see :class:`_Prometheus`;
* appends one JSON line to the stats file (the same numbers, per window).

The round stage times of ``profiling.RoundProfiler`` go to Prometheus through :meth:`stage_sink`.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import List, Optional, Sequence

import torch

from .. import tree_ops
from .budget_policy import check_age_edges
from ..profiling import STAGES, RoundProfiler

ENV_FILE = "SGLANG_DDTREE_STATS_FILE"
ENV_EVERY = "SGLANG_DDTREE_STATS_EVERY"
PREFIX = "sglang:ddtree_"
logger = logging.getLogger(__name__)


def default_budgets(budget: int) -> List[int]:
    """The budgets reported: 7, 15, 31, 63, ... below the tree's budget, and the budget itself."""
    out, b = [], 7
    while b < budget:
        out.append(b)
        b = 2 * b + 1
    return out + [budget]


def _async_host_copy(t: torch.Tensor):
    """(event or None, host copy) of ``t``: on CUDA a pinned non-blocking copy behind an event (read it
    once ``event.query()``), elsewhere a clone."""
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return ev, host
    return None, t.clone()


# Stage-time histogram buckets (ms): a verify forward is ~1-50 ms on an H200, the tree ~0.05-1 ms.
MS_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 50.0, 100.0,
              250.0, 1000.0)


def _multiprocess_ready() -> Optional[str]:
    """None when prometheus_client writes multiprocess files (what SGLang's /metrics reads), else why not."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return "PROMETHEUS_MULTIPROC_DIR is not set"
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        return "prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set"
    return None


class _Prometheus:
    """The plugin's metrics in SGLang's Prometheus registry, created once per process (the first
    instance's ``chosen_budgets`` set the chosen-budget buckets).  ``registry``: prometheus_client's
    default unless given (in multiprocess mode the values live in PROMETHEUS_MULTIPROC_DIR's files)."""

    _made = None

    def __init__(self, labels: dict, *, chosen_budgets: Sequence[int] = (), registry=None):
        from prometheus_client import REGISTRY, Counter, Histogram

        if _Prometheus._made is None:
            why = _multiprocess_ready()
            if why:
                logger.warning("sglang_ddtree metrics: %s; they stay in this process and will not "
                               "appear on SGLang's /metrics", why)
            reg = REGISTRY if registry is None else registry
            base = sorted(labels)
            C = lambda name, doc, extra=(): Counter(PREFIX + name, doc, base + list(extra), registry=reg)  # noqa: E731
            H = lambda name, doc, extra, buckets: Histogram(PREFIX + name, doc, base + list(extra),  # noqa: E731
                                                            buckets=buckets, registry=reg)
            _Prometheus._made = dict(
                rounds=C("request_rounds", "DDTree request-rounds (one request, one verify)"),
                accepted=C("accepted_tokens", "Draft tokens accepted (bonus excluded)"),
                length=C("accept_length", "Request-rounds by accepted length", ["length"]),
                counterfactual=C("counterfactual_accepted_tokens",
                                 "Draft tokens a tree of this smaller budget would have accepted in the "
                                 "same rounds (exact: best-first trees are prefix-closed)", ["at_budget"]),
                cf_rounds=C("counterfactual_request_rounds",
                            "Request-rounds whose tree was at least this budget (the denominator of "
                            "counterfactual_accepted_tokens)", ["at_budget"]),
                depth=C("tree_depth", "Request-rounds by the depth of the built tree (deepest node)",
                        ["depth"]),
                depth_sum=C("tree_depth_sum", "Sum over request-rounds of the built tree's depth"),
                chosen=H("chosen_budget", "Tree budget (verify width - 1) chosen per round; 0 = no "
                         "speculation", [], sorted(set(int(b) for b in chosen_budgets) | {0})),
                stage=H("stage_ms", "GPU time of one round stage (CUDA events), ms",
                        ["stage", "chosen_budget"], MS_BUCKETS),
                round_ms=H("round_ms", "GPU time of one round, first to last stage event, ms",
                           ["chosen_budget"], MS_BUCKETS),
                host_ms=H("round_host_ms", "Host wall time of one round's worker call, ms",
                          ["chosen_budget"], MS_BUCKETS))
        self.m, self.labels = _Prometheus._made, labels
        self._kids = {}

    def add(self, rec: dict) -> None:
        m, lb = self.m, self.labels
        m["rounds"].labels(**lb).inc(rec["request_rounds"])
        m["accepted"].labels(**lb).inc(rec["accepted"])
        for length, n in enumerate(rec["length_hist"]):
            if n:
                m["length"].labels(**lb, length=str(length)).inc(n)
        for b, n, r in zip(rec["budgets"], rec["counterfactual"], rec["counterfactual_request_rounds"]):
            m["counterfactual"].labels(**lb, at_budget=str(b)).inc(n)
            m["cf_rounds"].labels(**lb, at_budget=str(b)).inc(r)
        for d, n in enumerate(rec["tree_depth_hist"]):
            if n:
                m["depth"].labels(**lb, depth=str(d)).inc(n)
        m["depth_sum"].labels(**lb).inc(rec["tree_depth_sum"])
        chosen = m["chosen"].labels(**lb)
        for b, n in sorted(rec["chosen_budget_rounds"].items()):
            for _ in range(n):
                chosen.observe(int(b))

    def add_round_times(self, done: Sequence[tuple]) -> None:
        """done: profiler rounds ``(stage ms list, round ms, host ms, bs, width or None[, host stage ms])``."""
        for stages, round_ms, host_ms, _bs, width, *_ in done:
            hs = self._round_children(self.labels["budget"] if width is None else str(int(width) - 1))
            for h, ms in zip(hs[:len(STAGES)], stages):
                h.observe(ms)
            hs[-2].observe(round_ms)
            hs[-1].observe(host_ms)

    def _round_children(self, cb: str) -> list:
        """The labelled histograms of chosen budget ``cb``: one per stage, round_ms, host_ms (cached)."""
        kids = self._kids.get(cb)
        if kids is None:
            m, lb = self.m, self.labels
            kids = [m["stage"].labels(**lb, stage=name, chosen_budget=cb) for name in STAGES]
            kids += [m["round_ms"].labels(**lb, chosen_budget=cb), m["host_ms"].labels(**lb, chosen_budget=cb)]
            self._kids[cb] = kids
        return kids


class AcceptanceStats:
    """Device accumulators of one worker (see the module docstring).  ``record`` per round.

    ``chosen_budgets``: the budgets a round may run (the chosen-budget histogram's buckets; default
    the tree's budget)."""

    def __init__(self, *, budget: int, draft_depth: int, device, algo: str, tp_rank: int = 0,
                 prometheus: bool = False, path: Optional[str] = None, every: Optional[int] = None,
                 budgets: Optional[Sequence[int]] = None, chosen_budgets: Optional[Sequence[int]] = None,
                 registry=None):
        self.budget, self.depth, self.device = int(budget), int(draft_depth), torch.device(device)
        self.budgets = list(budgets) if budgets is not None else default_budgets(self.budget)
        if not self.budgets or any(b < 1 or b > self.budget for b in self.budgets):
            raise ValueError(f"budgets must be in [1, {self.budget}], got {self.budgets}")
        from ..env_vars import positive_int

        self.every = int(every) if every is not None else positive_int(os.environ, ENV_EVERY, 64)
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        self.path = path
        self.meta = dict(algo=algo, budget=self.budget, tp_rank=tp_rank, pid=os.getpid())
        self.chosen_budgets = list(chosen_budgets) if chosen_budgets else [self.budget]
        self.prom = _Prometheus(dict(algo=algo, budget=str(self.budget), tp_rank=str(tp_rank)),
                                chosen_budgets=self.chosen_budgets, registry=registry) \
            if prometheus else None
        nb, d = len(self.budgets), self.depth
        self._budgets_dev = torch.tensor(self.budgets, dtype=torch.int64, device=self.device)
        # [request_rounds, accepted, hist (D+1), counterfactual (nb), tree depth hist (D+1),
        #  tree depth sum, predicted x 1000 (nb)] in one int64 vector: one copy
        self._o_cf, self._o_th = 3 + d, 3 + d + nb
        self._o_pr = self._o_th + d + 2
        self._acc = torch.zeros(self._o_pr + nb, dtype=torch.int64, device=self.device)
        self._ones = None
        self._rounds = 0
        self._host = self._new_host()
        self._inflight = []   # (event or None, pinned host copy, rounds in it, t, host counts)

    def _new_host(self) -> dict:
        return dict(cf_rounds=[0] * len(self.budgets), chosen={})

    @classmethod
    def from_env(cls, server_args, **kw) -> Optional["AcceptanceStats"]:
        path = os.environ.get(ENV_FILE) or None
        prom = bool(getattr(server_args, "enable_metrics", False))
        if not (path or prom):
            return None
        return cls(path=path, prometheus=prom, **kw)

    def predicted_widths(self, width: int) -> List[int]:
        """The verify widths whose expected acceptance a round of verify width ``width`` should hand
        to :meth:`record` (``predicted``): each reported budget its tree holds, + 1."""
        return [b + 1 for b in self.budgets if b <= int(width) - 1]

    def record(self, path: torch.Tensor, accept_len: torch.Tensor, *,
               tree_depth: Optional[torch.Tensor] = None, width: Optional[int] = None,
               predicted: Optional[torch.Tensor] = None, cf: Optional[torch.Tensor] = None) -> None:
        """path [bs, W] int (root first, -1 padded): this round's accepted slots; accept_len [bs]:
        their count (the accept's own output, not recomputed here); tree_depth [bs, N] int: the built
        tree's slot depths (None: not counted); width: the round's verify width N, a host int (None:
        the tree's budget + 1); predicted [bs, n] float (optional): the expected acceptance of the
        first n reported budgets (:meth:`predicted_widths`), summed in thousandths; cf [bs, n_valid]
        (optional): the round's counterfactual accept lengths at the reported budgets the tree holds,
        as :class:`RoundCounterfactual` hands them (None: computed here)."""
        bs = path.shape[0]
        if bs == 0:
            return
        rb = self.budget if width is None else int(width) - 1           # the round's tree budget
        n_valid = sum(1 for b in self.budgets if b <= rb)
        accept_len = accept_len.to(torch.int64)
        a, d = self._acc, self.depth
        a[0] += bs
        a[1] += accept_len.sum()
        if self._ones is None or self._ones.numel() < bs:
            self._ones = torch.ones(max(bs, 64), dtype=torch.int64, device=self.device)
        ones = self._ones[:bs]
        a[2:3 + d].index_add_(0, accept_len.clamp(max=d), ones)
        if n_valid:
            cf = _own_counterfactual(cf, path, self._budgets_dev, n_valid)                 # [bs, n_valid]
            a[self._o_cf:self._o_cf + n_valid] += cf.to(torch.int64).sum(0)
        if predicted is not None and n_valid:
            if predicted.shape != (bs, n_valid):
                raise ValueError(f"predicted must be [{bs}, {n_valid}], got {tuple(predicted.shape)}")
            a[self._o_pr:self._o_pr + n_valid] += (predicted.to(torch.float64).sum(0) * 1000).round().to(torch.int64)
        if tree_depth is not None:
            td = tree_depth.amax(1).to(torch.int64).clamp_(0, d)                         # [bs]
            a[self._o_th:self._o_th + d + 1].index_add_(0, td, ones)
            a[self._o_pr - 1] += td.sum()
        h = self._host
        for j in range(n_valid):
            h["cf_rounds"][j] += bs
        h["chosen"][rb] = h["chosen"].get(rb, 0) + 1
        self._rounds += 1
        if self._rounds % self.every == 0:
            self._snapshot()
        self._drain()

    def _snapshot(self) -> None:
        ev, host = _async_host_copy(self._acc)
        self._acc.zero_()
        self._inflight.append((ev, host, self.every, time.time(), self._host))
        self._host = self._new_host()

    def _drain(self) -> None:
        while self._inflight and (self._inflight[0][0] is None or self._inflight[0][0].query()):
            _, host, rounds, t, hc = self._inflight.pop(0)
            self._publish(self._record_from(host.tolist(), rounds, t, hc))

    def flush(self) -> None:
        """Snapshot what is accumulated and publish everything (waits for the copies: shutdown only)."""
        if self._rounds % self.every:
            self._snapshot()
        for ev, *_ in self._inflight:
            if ev is not None:
                ev.synchronize()
        self._drain()

    def _record_from(self, v: List[int], rounds: int, t: float, hc: dict) -> dict:
        d, o_cf, o_th = self.depth, self._o_cf, self._o_th
        return dict(self.meta, t=round(t, 3), rounds=rounds, request_rounds=v[0], accepted=v[1],
                    length_hist=v[2:3 + d], budgets=self.budgets, counterfactual=v[o_cf:o_th],
                    counterfactual_request_rounds=hc["cf_rounds"], tree_depth_hist=v[o_th:o_th + d + 1],
                    tree_depth_sum=v[o_th + d + 1], chosen_budget_rounds=hc["chosen"],
                    predicted=[x / 1000.0 for x in v[self._o_pr:]])

    def _publish(self, rec: dict) -> None:
        if self.prom is not None:
            self.prom.add(rec)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def stage_sink(self):
        """The RoundProfiler sink feeding the stage-time histograms, or None without Prometheus."""
        return None if self.prom is None else self.prom.add_round_times


def make_round_observers(server_args, *, algo: str, budget: int, block_size: int, topk: int,
                         tp_rank: int, device, adaptive_cfg=None, registry=None):
    """(AcceptanceStats or None, RoundProfiler) of one worker.  Acceptance, counterfactual acceptance
    per smaller budget, tree depth and chosen budget: opt-in (``--enable-metrics`` or
    SGLANG_DDTREE_STATS_FILE), TP rank 0 only (every rank holds the same trees).  With
    ``--enable-metrics`` rank 0's profiler also feeds the stage-time histograms (``docs/metrics.md``);
    without it and without SGLANG_DDTREE_PROFILE_FILE the profiler records nothing."""
    stats = None
    if tp_rank == 0:
        chosen = [budget]
        budgets = default_budgets(budget)
        if adaptive_cfg is not None:
            chosen = ([0] if adaptive_cfg.no_spec else []) + list(adaptive_cfg.budgets)
            budgets = sorted(set(budgets) | set(adaptive_cfg.budgets))
        stats = AcceptanceStats.from_env(server_args, budget=budget, draft_depth=block_size - 1,
                                         device=device, algo=algo, tp_rank=tp_rank, budgets=budgets,
                                         chosen_budgets=chosen, registry=registry)
    prof = RoundProfiler(dict(algo=algo, budget=budget, block_size=block_size, topk=topk),
                         sink=None if stats is None else stats.stage_sink())
    return stats, prof


def _own_counterfactual(cf: Optional[torch.Tensor], path: torch.Tensor, budgets_dev: torch.Tensor,
                        n_valid: int) -> torch.Tensor:
    """``cf`` as handed ([bs, n_valid] checked), else the round's counts at ``budgets_dev[:n_valid]``."""
    if cf is None:
        return tree_ops.counterfactual_accept_len(path, budgets_dev[:n_valid])
    if tuple(cf.shape) != (path.shape[0], n_valid):
        raise ValueError(f"cf must be [{path.shape[0]}, {n_valid}], got {tuple(cf.shape)}")
    return cf


class RoundCounterfactual:
    """A round's counterfactual accept lengths (``tree_ops.counterfactual_accept_len``), computed
    once for every consumer: the acceptance stats (``AcceptanceStats.budgets``) and the adaptive
    controller's window (its budgets) count them over different, overlapping budget lists.

    ``budget_lists``: each consumer's ascending budgets (None: that consumer is absent).  Calling it
    with a round's path [bs, W] and verify width gives one [bs, n_valid] tensor per consumer (its
    budgets the width-``width`` tree holds; None where there are none or the consumer is absent),
    all read off one count over the union of the lists."""

    def __init__(self, budget_lists: Sequence[Optional[Sequence[int]]], device):
        lists = [None if bl is None else [int(b) for b in bl] for bl in budget_lists]
        for bl in lists:
            if bl is not None and bl != sorted(set(bl)):
                raise ValueError(f"budgets must be distinct and ascending, got {bl}")
        self.lists = lists
        self.budgets = sorted(set().union(*[bl for bl in lists if bl is not None]))
        device = torch.device(device)
        self._budgets_dev = torch.tensor(self.budgets, dtype=torch.int64, device=device)
        # per consumer: None when its budgets are the union's leading ones (a slice), else the
        # union's columns of its budgets (index_select)
        self._cols = [None if bl is None or bl == self.budgets[:len(bl)] else
                      torch.tensor([self.budgets.index(b) for b in bl], dtype=torch.int64, device=device)
                      for bl in lists]

    def __call__(self, path: torch.Tensor, width: int) -> List[Optional[torch.Tensor]]:
        rb = int(width) - 1                                  # the round's tree budget
        n = sum(1 for b in self.budgets if b <= rb)
        cf = tree_ops.counterfactual_accept_len(path, self._budgets_dev[:n]) if n else None
        out = []
        for bl, cols in zip(self.lists, self._cols):
            nv = 0 if bl is None or cf is None else sum(1 for b in bl if b <= rb)
            out.append(None if nv == 0 else cf[:, :nv] if cols is None else cf.index_select(1, cols[:nv]))
        return out


class CounterfactualWindow:
    """Counterfactual accepted tokens per budget for the adaptive choice (``adaptive.WidthController``),
    summed over windows of ``every`` rounds on the device, no host sync in a round, per request-age
    bucket.

    ``record(path, n_valid, remaining=None, age=None)``: path [bs, W] of a round whose tree holds the
    ``n_valid`` smallest ``budgets`` (the others are wider than the round's tree: unknown, not
    counted).  ``remaining`` [bs] (device, optional): tokens each request may still emit before this
    round (its max_new_tokens minus its output so far); a request-round with none left is not counted
    (under SGLang's overlap scheduler a request that finished in round i still runs round i + 1,
    launched before the host saw the finish), and a count is clipped to ``remaining - 1`` (what the
    request keeps of the round, less the bonus).  Measured on the H200 (Qwen3-8B-shaped chain pair,
    c = 1, ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s20*``): the profiler counted exactly one
    round more per request than SGLang's ``spec_verify_ct`` (412 vs 388 for 24 requests), each at
    the end of a request where acceptance is highest, and the running width's estimate read
    0.5-0.8 tokens above the tokens per round the requests received.  Request-rounds per budget are
    counted on the device with the sums.

    ``age`` [bs] (device, optional): output tokens each request has emitted before this round; every
    count goes to the bucket of ``age_edges`` it falls in (bucket k holds ``edges[k-1] <= age <
    edges[k]``; no edges or no ``age``: one bucket).  Why (``budget_policy.BudgetPolicy``):
    acceptance depends on a request's age, and which ages a width's rounds see depends on the width.

    ``predicted`` [bs, len(budgets)] (device float, optional): each budget's expected acceptance
    read off the round's widest tree before the verify (``accept_estimate.expected_accept``; a
    draft-only probe round hands it with ``n_valid = 0``).  Kept apart, under the same mask, clip
    and age buckets as the counts: its sum and request-rounds over every request-round that carries
    it (what the policy reads as the batch's current acceptance at every budget), and, at each budget
    the round's tree holds, the prediction and the exact count side by side on the same
    request-rounds (the calibration ratio ``exact / predicted``).

    A closed window is copied to pinned memory behind an event and handed out by ``due()`` once
    ``lag`` more rounds were recorded: at the same round on every TP rank (if the copy is somehow
    not complete by then, ``due`` waits for it and counts ``waits``)."""

    def __init__(self, budgets: Sequence[int], *, device, every: int = 8, lag: int = 4,
                 age_edges: Sequence[int] = ()):
        if not budgets or list(budgets) != sorted(set(budgets)) or min(budgets) < 1:
            raise ValueError(f"budgets must be distinct, ascending and >= 1, got {list(budgets)}")
        if every < 1 or lag < 0:
            raise ValueError(f"every must be >= 1 and lag >= 0, got {every}, {lag}")
        edges = check_age_edges(age_edges)
        self.budgets, self.every, self.lag = list(budgets), int(every), int(lag)
        self.age_edges = edges
        self.device = torch.device(device)
        self._budgets_dev = torch.tensor(self.budgets, dtype=torch.int64, device=self.device)
        self._edges_dev = torch.tensor(edges, dtype=torch.int64, device=self.device)
        nb, nk = len(edges) + 1, len(self.budgets)
        # [0]: accepted tokens per (age bucket, budget) over the request-rounds whose tree holds the
        # budget; [1]: at budget k >= 1, what budget k - 1 accepted on those same request-rounds (the
        # pair a gain is measured on); [2]: request-rounds counted
        self._acc = torch.zeros(3, nb, nk, dtype=torch.int64, device=self.device)
        # the tree's own estimate (``predicted``), fp64 per (age bucket, budget): [0] predicted
        # accepted tokens over every request-round that carries a prediction, [1] those request-
        # rounds, [2] at a budget the round's tree holds: the prediction, [3] the exact count and
        # [4] the request-rounds, over the same request-rounds (the calibration pairs)
        self._pred = torch.zeros(5, nb, nk, dtype=torch.float64, device=self.device)
        self._rounds = 0
        self._inflight = []   # (due round, event or None, host copy of _acc)
        self.waits = 0

    @property
    def buckets(self) -> int:
        return len(self.age_edges) + 1

    def record(self, path: torch.Tensor, n_valid: int, remaining: Optional[torch.Tensor] = None,
               age: Optional[torch.Tensor] = None, predicted: Optional[torch.Tensor] = None,
               cf: Optional[torch.Tensor] = None) -> None:
        """One round (the class docstring); ``cf`` [bs, n_valid]: its counterfactual accept lengths
        at the ``n_valid`` smallest budgets as :class:`RoundCounterfactual` hands them (None: computed
        here)."""
        bs = path.shape[0]
        nk = len(self.budgets)
        if predicted is not None and tuple(predicted.shape) != (bs, nk):
            raise ValueError(f"predicted must be [{bs}, {nk}] (every budget), got {tuple(predicted.shape)}")
        if (n_valid > 0 or predicted is not None) and bs:
            if age is None or not self.age_edges:
                bucket = torch.zeros(bs, dtype=torch.int64, device=path.device)
            else:
                bucket = torch.bucketize(age.reshape(bs).to(torch.int64), self._edges_dev, right=True)
            live = left = None
            if remaining is not None:
                left = remaining.reshape(bs, 1).to(torch.int64)
                live = left > 0
            handed, cf = cf, None
            if n_valid > 0:
                cf = _own_counterfactual(handed, path, self._budgets_dev, n_valid).to(torch.int64)
                if live is None:
                    ones = torch.ones_like(cf)
                else:
                    cf = torch.minimum(cf, (left - 1).clamp(min=0)) * live   # [bs, n_valid]
                    ones = live.to(torch.int64).expand(bs, n_valid)
                self._acc[2, :, :n_valid].index_add_(0, bucket, ones)
                self._acc[0, :, :n_valid].index_add_(0, bucket, cf)
                self._acc[1, :, 1:n_valid].index_add_(0, bucket, cf[:, :n_valid - 1])
            if predicted is not None:
                pr = predicted.to(torch.float64)
                if live is None:
                    weight = torch.ones((bs, 1), dtype=torch.float64, device=pr.device)
                else:   # the same clip as the counts: a request keeps at most remaining - 1 accepted
                    pr = torch.minimum(pr, (left - 1).clamp(min=0).to(torch.float64)) * live
                    weight = live.to(torch.float64)
                self._pred[0].index_add_(0, bucket, pr)
                self._pred[1].index_add_(0, bucket, weight.expand(bs, nk))
                if cf is not None:
                    self._pred[2, :, :n_valid].index_add_(0, bucket, pr[:, :n_valid])
                    self._pred[3, :, :n_valid].index_add_(0, bucket, cf.to(torch.float64))
                    self._pred[4, :, :n_valid].index_add_(0, bucket, weight.expand(bs, n_valid))
        self._rounds += 1
        if self._rounds % self.every == 0:
            ev, host = _async_host_copy(self._acc)
            ev_p, host_p = _async_host_copy(self._pred)
            self._acc.zero_()
            self._pred.zero_()
            self._inflight.append((self._rounds + self.lag, (ev, ev_p), host, host_p))

    def due(self) -> List[tuple]:
        """Windows whose hand-out round has come: [(sums, counts, below, pred)], each of the first
        three [age bucket][budget], ``below[b][k]`` (k >= 1) = what budget k - 1 accepted on the
        request-rounds counted at budget k (``below[b][0]`` = 0): the same rounds, so
        ``sums[b][k] / below[b][k]`` is budget k's gain over budget k - 1 free of which rounds happened
        to run the wider tree.  ``pred``: None when no round of the window carried a prediction, else
        a dict of [age bucket][budget] lists: ``all`` / ``n`` (predicted accepted tokens / request-
        rounds over every predicted request-round), ``on`` / ``exact`` / ``on_n`` (the prediction,
        the exact count and the request-rounds where both exist)."""
        out = []
        while self._inflight and self._inflight[0][0] <= self._rounds:
            _, events, host, host_p = self._inflight.pop(0)
            late = [ev for ev in events if ev is not None and not ev.query()]
            for ev in late:
                ev.synchronize()
            self.waits += bool(late)
            sums, below, counts = host.tolist()
            p_all, p_n, p_on, p_exact, p_on_n = host_p.tolist()
            pred = None
            if any(x > 0 for row in p_n for x in row):
                pred = dict(all=p_all, n=p_n, on=p_on, exact=p_exact, on_n=p_on_n)
            out.append((sums, counts, below, pred))
        return out
