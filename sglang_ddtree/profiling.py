"""Per-stage timing of DDTree rounds with CUDA events, no host sync (opt-in).

``SGLANG_DDTREE_PROFILE_FILE=/path/x.jsonl`` makes every scheduler process's worker record one CUDA
event at each stage boundary of a round and, every ``SGLANG_DDTREE_PROFILE_EVERY`` (default 64)
completed rounds, append one JSON line::

  {"pid", "algo", "budget", "block_size", "topk", "rounds", "bs_mean",
   "stage_ms": {stage: {"median", "mean"}}, "round_ms": {...}, "host_ms": {...},
   "host_stage_ms": {stage: {"median", "mean"}},
   "by_width": {width: {"rounds", "bs_mean", "verify_ms", "round_ms"}},   (DDTree rounds only)
   "t_first", "t_last",   (wall clock, time.time(), at the end of the record's first and last round)
   "gc": {"n": [gen0, gen1, gen2], "ms": [...], "max_ms"}}   (this process's garbage collections
   since the previous record: a collection stops the scheduler's host loop, so a long one is a pause
   between rounds that the CUDA events cannot see)

A pause of more than ``IDLE_GAP_S`` between two rounds closes the current record early (written at
the next round), so a record never spans an idle gap: a benchmark level's rounds are not mixed
with the next level's (``sglang_ddtree.ab`` assigns records to levels by their wall times).

Stages (GPU timeline between consecutive events, so GPU idle time spent waiting for the host, as
in DDTREE-CPU's heap, counts in the stage that waited):
  draft        drafter block forward + its folded top-k head
  tree         build_tree (+ tree mask)
  verify_prep  KV slots, verify mask, verify batch / graph inputs
  verify       the target's TARGET_VERIFY forward
  accept       argmax + accept walk (or the sampled accept)
  commit       output tokens, target KV move, drafter context K/V
``host_ms`` is the host wall time of the worker call; ``host_stage_ms`` splits it at the same marks
(host wall time from one mark to the next: where the host's share of a round goes, e.g. a round
whose GPU waits for a slow host launch path).  Events are read only once ``query()``
reports them complete, so timing never blocks the round; read events go back to a pool and are
recorded again (no event created per round once warm).

With ``--enable-metrics`` the worker passes a ``sink`` (``round_stats.AcceptanceStats.stage_sink``):
the profiler is then on without a file, and every ``every`` completed rounds the sink receives them,
``[(stage ms list, round ms, host ms, bs, verify width or None, host stage ms list)]`` (the Prometheus histograms
``sglang:ddtree_stage_ms`` etc., ``docs/metrics.md``).  Stock DFLASH servers write the same
records (``patches/dflash_round_profile.py``: draft = the drafter block, tree = 0, verify_prep,
verify, accept = verify end to the drafter's context append, commit = that append to the end).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, List, Optional

STAGES = ("draft", "tree", "verify_prep", "verify", "accept", "commit")
ENV_FILE = "SGLANG_DDTREE_PROFILE_FILE"
ENV_EVERY = "SGLANG_DDTREE_PROFILE_EVERY"
IDLE_GAP_S = 0.1   # a pause between rounds longer than this closes the current record


def _by_width(done: List[tuple]) -> Optional[dict]:
    """{width: {rounds, bs_mean, verify_ms, round_ms}} of the rounds that name their verify width
    (the adaptive budget mixes widths in one record; a width of 1 is a no-speculation round), or
    None when no round does (stock DFLASH records)."""
    groups: dict = {}
    for d in done:
        if d[4] is not None:
            groups.setdefault(int(d[4]), []).append(d)
    if not groups:
        return None
    vi = STAGES.index("verify")
    return {str(w): {"rounds": len(g), "bs_mean": round(sum(d[3] for d in g) / len(g), 3),
                     "verify_ms": _stats([d[0][vi] for d in g if len(d[0]) > vi]) if any(len(d[0]) > vi for d in g) else None,
                     "round_ms": _stats([d[1] for d in g])}
            for w, g in sorted(groups.items())}


class GcPauses:
    """This process's garbage collections, counted and timed by generation (``gc.callbacks``; one
    instance per process, installed on first use).  ``take()`` -> the counts and ms since the last
    ``take()``: {"n": [g0, g1, g2], "ms": [g0, g1, g2], "max_ms"}."""

    _instance: Optional["GcPauses"] = None

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._t0: Optional[float] = None
        self._reset()

    def _reset(self) -> None:
        self.n = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self.max_ms = 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = self._clock()
        elif phase == "stop" and self._t0 is not None:
            gen = min(max(int(info.get("generation", 2)), 0), 2)
            ms = (self._clock() - self._t0) * 1e3
            self._t0 = None
            self.n[gen] += 1
            self.ms[gen] += ms
            self.max_ms = max(self.max_ms, ms)

    def take(self) -> dict:
        out = {"n": list(self.n), "ms": [round(x, 3) for x in self.ms], "max_ms": round(self.max_ms, 3)}
        self._reset()
        return out

    @classmethod
    def installed(cls) -> "GcPauses":
        if cls._instance is None:
            import gc
            cls._instance = cls()
            gc.callbacks.append(cls._instance.callback)
        return cls._instance


def _stats(xs: List[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "mean": round(sum(xs) / len(xs), 4)}


class RoundProfiler:
    """``begin()``, one ``mark()`` per stage end, ``end(bs, width)`` per round; off (no event, no
    work) unless ``SGLANG_DDTREE_PROFILE_FILE`` is set or a ``sink`` is given."""

    def __init__(self, meta: dict, sink: Optional[Callable[[List[tuple]], None]] = None):
        self.path: Optional[str] = os.environ.get(ENV_FILE) or None
        self.sink = sink
        from .env_vars import positive_int

        self.every = positive_int(os.environ, ENV_EVERY, 64)
        self.meta = dict(meta, pid=os.getpid())
        self._cur = None
        self._pending = []
        self._done = []
        self._pool = []       # read events, recorded again by later rounds
        self._wall = []       # time.time() at the end of each round in _pending + _done, in order
        self._last_end = None
        self.extra: Optional[Callable[[], dict]] = None   # its dict goes into each record as "adaptive"
        self._gc = GcPauses.installed() if self.path else None

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.sink is not None

    def _event(self):
        if self._pool:
            e = self._pool.pop()
        else:
            import torch
            e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def begin(self) -> None:
        if not self.enabled:
            return
        self._cur = ([self._event()], [time.perf_counter()])

    def mark(self) -> None:
        if self._cur is None:
            return
        self._cur[0].append(self._event())
        self._cur[1].append(time.perf_counter())

    def cancel(self) -> None:
        """Drop the current round (a round whose stage marks did not all come)."""
        self._cur = None

    @property
    def marks(self) -> int:
        """Stage marks of the current round so far (0 outside a round)."""
        return 0 if self._cur is None else len(self._cur[0]) - 1

    def end(self, bs: int, width: Optional[int] = None) -> None:
        """Close the round (``bs`` requests, verify width ``width``); read every finished round."""
        if self._cur is None:
            return
        events, ticks = self._cur
        self._cur = None
        t_end = time.perf_counter()
        now = time.time()
        if self._last_end is not None and now - self._last_end > IDLE_GAP_S and (self._pending or self._done):
            # the server was idle (between benchmark levels, between bursts): the rounds before the
            # gap are long finished; write them as their own record so no record spans the gap
            self._collect()
            if self._done:
                self._flush()
        self._last_end = now
        host_stages = [(ticks[i + 1] - ticks[i]) * 1e3 for i in range(len(ticks) - 1)]
        self._pending.append((events, (t_end - ticks[0]) * 1e3, bs, width, host_stages))
        self._wall.append(now)
        self._collect()
        if len(self._done) >= self.every:
            self._flush()

    def _collect(self) -> None:
        while self._pending and self._pending[0][0][-1].query():
            ev, host_ms, b, w, host_stages = self._pending.pop(0)
            self._done.append(([ev[i].elapsed_time(ev[i + 1]) for i in range(len(ev) - 1)],
                               ev[0].elapsed_time(ev[-1]), host_ms, b, w, host_stages))
            self._pool.extend(ev)

    def _flush(self) -> None:
        done, self._done = self._done, []
        wall, self._wall = self._wall[:len(done)], self._wall[len(done):]
        if self.sink is not None:
            self.sink(done)
        if not self.path:
            return
        def per_stage(j):   # {stage: stats} over the rounds' stage lists at tuple index j
            return {s: _stats([d[j][i] for d in done]) for i, s in enumerate(STAGES)
                    if all(len(d) > j and len(d[j]) > i for d in done)}

        rec = dict(self.meta, rounds=len(done), bs_mean=round(sum(d[3] for d in done) / len(done), 3),
                   stage_ms=per_stage(0), round_ms=_stats([d[1] for d in done]),
                   host_ms=_stats([d[2] for d in done]), host_stage_ms=per_stage(5))
        if len(wall) == len(done):
            rec.update(t_first=round(wall[0], 3), t_last=round(wall[-1], 3))
        by_width = _by_width(done)
        if by_width:
            rec["by_width"] = by_width
        if self._gc is not None:
            rec["gc"] = self._gc.take()
        if self.extra is not None:
            rec["adaptive"] = self.extra()
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
