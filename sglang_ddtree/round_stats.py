"""Acceptance statistics of DDTree rounds, accumulated on the device and read without a host sync
(issue 17 items 1 and 4; opt-in).

On when the server runs with ``--enable-metrics`` (SGLang's Prometheus endpoint) or when
``SGLANG_DDTREE_STATS_FILE=/path/x.jsonl`` is set.  Per round the worker hands over the accepted
paths ``[bs, W]`` and their lengths; on the device this adds up, with static shapes and no host sync:

* ``request_rounds`` and ``accepted``: request-rounds and accepted draft tokens (bonus excluded);
* ``length_hist [D + 1]``: request-rounds by accepted length (0 .. draft depth);
* ``counterfactual [nb]``: accepted tokens every smaller budget in ``budgets`` would have given in the
  same rounds (``tree_ops.counterfactual_accept_len``: a best-first tree is prefix-closed, so one
  round of the budget-b tree gives the exact count for every b' <= b, no extra forward).

Every ``every`` rounds (``SGLANG_DDTREE_STATS_EVERY``, default 64) the accumulators are copied to
pinned host memory with ``non_blocking=True`` behind a CUDA event and zeroed; a later round reads the
copy once the event has completed (``query()``, never ``synchronize()``), then
* adds it to the Prometheus counters (multiprocess mode, as SGLang's own scheduler metrics):
  ``sglang:ddtree_request_rounds_total``, ``sglang:ddtree_accepted_tokens_total``,
  ``sglang:ddtree_accept_length_total{length}``, ``sglang:ddtree_counterfactual_accepted_tokens_total{budget}``
  (labels ``algo``, ``budget`` where it is the tree's, ``tp_rank``); the mean accepted tokens per
  round at budget b' is ``counterfactual{budget=b'} / request_rounds``;
* appends one JSON line to the stats file (the same numbers, per window).
"""
from __future__ import annotations

import json
import os
import time
from typing import List, Optional, Sequence

import torch

from . import tree_ops

ENV_FILE = "SGLANG_DDTREE_STATS_FILE"
ENV_EVERY = "SGLANG_DDTREE_STATS_EVERY"
PREFIX = "sglang:ddtree_"


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


class _Prometheus:
    """The plugin's counters in SGLang's Prometheus registry (created once per process)."""

    _made = None

    def __init__(self, labels: dict):
        from prometheus_client import Counter

        if _Prometheus._made is None:
            base = sorted(labels)
            _Prometheus._made = dict(
                rounds=Counter(PREFIX + "request_rounds", "DDTree request-rounds (one request, one verify)", base),
                accepted=Counter(PREFIX + "accepted_tokens", "Draft tokens accepted (bonus excluded)", base),
                length=Counter(PREFIX + "accept_length", "Request-rounds by accepted length", base + ["length"]),
                counterfactual=Counter(PREFIX + "counterfactual_accepted_tokens",
                                       "Draft tokens a tree of this smaller budget would have accepted in the "
                                       "same rounds (exact: best-first trees are prefix-closed)",
                                       base + ["at_budget"]))
        self.m, self.labels = _Prometheus._made, labels

    def add(self, rec: dict) -> None:
        m, lb = self.m, self.labels
        m["rounds"].labels(**lb).inc(rec["request_rounds"])
        m["accepted"].labels(**lb).inc(rec["accepted"])
        for length, n in enumerate(rec["length_hist"]):
            if n:
                m["length"].labels(**lb, length=str(length)).inc(n)
        for b, n in zip(rec["budgets"], rec["counterfactual"]):
            m["counterfactual"].labels(**lb, at_budget=str(b)).inc(n)


class AcceptanceStats:
    """Device accumulators of one worker (see the module docstring).  ``record`` per round."""

    def __init__(self, *, budget: int, draft_depth: int, device, algo: str, tp_rank: int = 0,
                 prometheus: bool = False, path: Optional[str] = None, every: Optional[int] = None,
                 budgets: Optional[Sequence[int]] = None):
        self.budget, self.depth, self.device = int(budget), int(draft_depth), torch.device(device)
        self.budgets = list(budgets) if budgets is not None else default_budgets(self.budget)
        if not self.budgets or any(b < 1 or b > self.budget for b in self.budgets):
            raise ValueError(f"budgets must be in [1, {self.budget}], got {self.budgets}")
        self.every = int(every if every is not None else os.environ.get(ENV_EVERY, "64"))
        if self.every < 1:
            raise ValueError(f"{ENV_EVERY} must be >= 1, got {self.every}")
        self.path = path
        self.meta = dict(algo=algo, budget=self.budget, tp_rank=tp_rank, pid=os.getpid())
        self.prom = _Prometheus(dict(algo=algo, budget=str(self.budget), tp_rank=str(tp_rank))) \
            if prometheus else None
        nb = len(self.budgets)
        self._budgets_dev = torch.tensor(self.budgets, dtype=torch.int64, device=self.device)
        # [request_rounds, accepted, hist (D+1), counterfactual (nb)] in one int64 vector: one copy
        self._acc = torch.zeros(2 + self.depth + 1 + nb, dtype=torch.int64, device=self.device)
        self._ones = None
        self._rounds = 0
        self._inflight = []   # (event or None, pinned host copy, rounds in it, t)

    @classmethod
    def from_env(cls, server_args, **kw) -> Optional["AcceptanceStats"]:
        path = os.environ.get(ENV_FILE) or None
        prom = bool(getattr(server_args, "enable_metrics", False))
        if not (path or prom):
            return None
        return cls(path=path, prometheus=prom, **kw)

    def record(self, path: torch.Tensor, accept_len: torch.Tensor) -> None:
        """path [bs, W] int (root first, -1 padded): this round's accepted slots; accept_len [bs]:
        their count (the accept's own output, not recomputed here)."""
        bs = path.shape[0]
        if bs == 0:
            return
        accept_len = accept_len.to(torch.int64)
        cf = tree_ops.counterfactual_accept_len(path, self._budgets_dev).to(torch.int64)  # [bs, nb]
        a = self._acc
        a[0] += bs
        a[1] += accept_len.sum()
        if self._ones is None or self._ones.numel() < bs:
            self._ones = torch.ones(max(bs, 64), dtype=torch.int64, device=self.device)
        a[2:3 + self.depth].index_add_(0, accept_len.clamp(max=self.depth), self._ones[:bs])
        a[3 + self.depth:] += cf.sum(0)
        self._rounds += 1
        if self._rounds % self.every == 0:
            self._snapshot()
        self._drain()

    def _snapshot(self) -> None:
        ev, host = _async_host_copy(self._acc)
        self._acc.zero_()
        self._inflight.append((ev, host, self.every, time.time()))

    def _drain(self) -> None:
        while self._inflight and (self._inflight[0][0] is None or self._inflight[0][0].query()):
            _, host, rounds, t = self._inflight.pop(0)
            self._publish(self._record_from(host.tolist(), rounds, t))

    def flush(self) -> None:
        """Snapshot what is accumulated and publish everything (waits for the copies: shutdown only)."""
        if self._rounds % self.every:
            self._snapshot()
        for ev, *_ in self._inflight:
            if ev is not None:
                ev.synchronize()
        self._drain()

    def _record_from(self, v: List[int], rounds: int, t: float) -> dict:
        d = self.depth
        return dict(self.meta, t=round(t, 3), rounds=rounds, request_rounds=v[0], accepted=v[1],
                    length_hist=v[2:3 + d], budgets=self.budgets, counterfactual=v[3 + d:])

    def _publish(self, rec: dict) -> None:
        if self.prom is not None:
            self.prom.add(rec)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


class CounterfactualWindow:
    """Counterfactual accepted tokens per budget for the adaptive choice (``adaptive.WidthController``),
    summed over windows of ``every`` rounds on the device, no host sync in a round.

    ``record(path, n_valid)``: path [bs, W] of a round whose tree holds the ``n_valid`` smallest
    ``budgets`` (the others are wider than the round's tree: unknown, not counted); request-rounds per
    budget are counted on the host.  A closed window is copied to pinned memory behind an event and
    handed out by ``due()`` once ``lag`` more rounds were recorded: at the same round on every TP
    rank (if the copy is somehow not complete by then, ``due`` waits for it and counts ``waits``)."""

    def __init__(self, budgets: Sequence[int], *, device, every: int = 8, lag: int = 4):
        if not budgets or list(budgets) != sorted(set(budgets)) or min(budgets) < 1:
            raise ValueError(f"budgets must be distinct, ascending and >= 1, got {list(budgets)}")
        if every < 1 or lag < 0:
            raise ValueError(f"every must be >= 1 and lag >= 0, got {every}, {lag}")
        self.budgets, self.every, self.lag = list(budgets), int(every), int(lag)
        self.device = torch.device(device)
        self._budgets_dev = torch.tensor(self.budgets, dtype=torch.int64, device=self.device)
        self._acc = torch.zeros(len(self.budgets), dtype=torch.int64, device=self.device)
        self._counts = [0] * len(self.budgets)
        self._rounds = 0
        self._inflight = []   # (due round, event or None, host sums, counts)
        self.waits = 0

    def record(self, path: torch.Tensor, n_valid: int) -> None:
        bs = path.shape[0]
        if n_valid > 0 and bs:
            cf = tree_ops.counterfactual_accept_len(path, self._budgets_dev[:n_valid])   # [bs, n_valid]
            self._acc[:n_valid] += cf.to(torch.int64).sum(0)
            for j in range(n_valid):
                self._counts[j] += bs
        self._rounds += 1
        if self._rounds % self.every == 0:
            ev, host = _async_host_copy(self._acc)
            self._acc.zero_()
            self._inflight.append((self._rounds + self.lag, ev, host, self._counts))
            self._counts = [0] * len(self.budgets)

    def due(self) -> List[tuple]:
        """Windows whose hand-out round has come: [(sums per budget, request-rounds per budget)]."""
        out = []
        while self._inflight and self._inflight[0][0] <= self._rounds:
            _, ev, host, counts = self._inflight.pop(0)
            if ev is not None and not ev.query():
                ev.synchronize()
                self.waits += 1
            out.append((host.tolist(), counts))
        return out
