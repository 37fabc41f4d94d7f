"""The regime choice (issue 52 item 1, ``docs/plain_regime_design.md`` section 4): :class:`RegimeController`.

Whether the server decodes plainly (SGLang's own decode path, step 2 of the design's plan) or
speculates, decided on windows of host-clock time that contain the admissions a regime causes (no
device reads).  ``RoundPolicy.regime`` owns one (switch ``regime=auto``: the worker feeds it each
decode launch through :class:`LaunchTracker`, ``patches/regime_transition.py`` makes the switch).
A batch whose request pins a tree budget is served by speculation: the controller switches into
it at that launch and does not leave it while a pin runs.

A window opens at a regime entry (after its drain and rebuild) or at the previous window's close
and closes at a decode launch when every request running at its opening has finished and at least
one admission happened (one wave), or after ``t_max_s`` of busy time, never before ``t_min_s``;
intervals between launches longer than ``MAX_GAP_S`` are idle, left out.  Per window: emitted
tokens ``E``, busy seconds ``T``, occupancy ``O = sum bs x dt`` (request-seconds); the figure kept
is the per-slot rate ``q = E / O`` (tokens per request-second), a decayed mean per key.

A window is keyed by the batch it OPENS with: its bs bucket and, for plain decoding only, its
``synced`` verdict (``adaptive.synced_tokens_left``: requests that plain decoding finishes in a few
waves); a decision compares the two regimes' estimates under the state of the batch at hand (the
next window's opening batch).  Why plain decoding's estimate carries the sync state: plain decoding
of a synced batch pays one batched admission a wave, of a spread batch one per finish, and a spec
stretch spreads the finishes until a new level of requests arrives (lock-step does not come back by
itself), so a plain window measured after a spec stretch is the spread rate; compared with the
synced rate the server left it favours speculation (the s34 attempt, design section 6).  Why
speculation's does not: a spec stretch is spread after its first wave whatever state it started
in, so its windows measure one rate.  A window also closes when the batch leaves its bucket; one
shorter than ``t_min_s`` or without an admission inside its busy time (a level's drain) measures
nothing, but the decision is taken (a new level's first batch is such a close).

Two kinds of spec time besides a chosen stretch:
- a plain *trip*: in speculation with no plain estimate for the key, the controller goes plain to
  measure it (plain decoding is the floor, measuring it costs no credit) for one window, then goes
  back unless plain decoding won that window by ``h``.  Only from a state speculation has just held
  for a measured window, or a synced one (``_may_trip``): a ramp's or a drain's passing bucket
  measures nothing.  At most one trip per key (the bs buckets times two sync states), whether its
  measurement lands or not; plain estimates do not age.  (s39, H100: trips held for two windows
  and taken at any close, as first built, kept a server plain for 26-29 % of levels where trees
  won 1.4-1.8x);
- an *excursion*: in plain, nothing measures speculation; when the key has no fresh spec estimate,
  an optimistic bound says speculation could win, and the credit covers the expected cost, one
  window of speculation runs.  Credit: ``credit_rate`` of busy time, capped at two excursions; an
  excursion spends its whole wall time (switches and rebuild included) whatever its outcome, so
  explored time <= ``credit_rate`` x busy time + the starting credit + one excursion.  Starting
  credit: none from a spec start (speculation is measured by running), one excursion from a plain
  start.  No excursion leaves a synced batch but a plain start's first: there one costs more than
  its wall time (the finishes stay spread until the next level of requests, which the credit does
  not price; on the tests' lock-step levels three excursions from synced batches in 300 s cost
  the auto server 1.6-2.5 % against forced plain), so a synced batch is left for speculation only
  on a fresh spec estimate (measured on spread batches, the rate a spec stretch settles at).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Dict, Hashable, Optional, Sequence, Tuple

from .adaptive import synced_tokens_left
from .adaptive_config import requested_width

PLAIN = "plain"
SPEC = "spec"

Key = Tuple[int, bool]    # (bs bucket, synced)


@dataclasses.dataclass(frozen=True)
class SchedView:
    """One decode batch being launched (either regime), host values only.

    ``rids``: its requests' ids (bs = len); ``emitted``: tokens emitted by the decode batch whose
    result was processed since the previous launch; ``admitted``: requests admitted (prefilled)
    since the previous launch; ``reqs``: its SGLang requests, for the sync verdict (None: unsynced);
    ``no_spec``: in the spec regime, the width controller ran this batch at ``NO_SPEC``;
    ``pinned``: a request of the batch pins a tree budget (``custom_params["ddtree_budget"]`` > 0,
    none pins 0: ``adaptive_config.requested_width`` > 1), which only the spec regime serves."""
    rids: Sequence[Hashable]
    emitted: float = 0.0
    admitted: int = 0
    reqs: Optional[Sequence] = None
    no_spec: bool = False
    pinned: bool = False

    @property
    def bs(self) -> int:
        return len(self.rids)


@dataclasses.dataclass(frozen=True)
class RegimeDecision:
    """The regime the batch at hand runs in, and the switch the scheduler hook must make before it
    (None: none; the hook drains, converts, then calls ``switched``).  ``excursion``: the pending
    switch into speculation is exploration."""
    regime: str
    pending: Optional[str] = None
    excursion: bool = False


def bucket(bs: float) -> int:
    """The power of two nearest ``bs`` in log scale (at least 1): a full batch's window that dips
    by a request or two stays in its bucket, a level's drain (the batch emptying, no admissions:
    a high per-slot rate at a low load) falls in a lower one."""
    return 1 << max(0, round(math.log2(max(float(bs), 1.0))))


def synced(view: SchedView) -> bool:
    """``adaptive.synced_tokens_left``'s verdict on the batch (False without requests)."""
    return synced_tokens_left(view.reqs) is not None


class _Window:
    """One window's sums: busy s, occupancy (request-s), tokens, admissions, rounds, NO_SPEC rounds;
    ``synced``: its opening batch's verdict; ``cohort``: the requests of that batch not yet
    finished."""

    def __init__(self, view: SchedView):
        self.bucket = bucket(view.bs)
        self.synced = synced(view)
        self.cohort = set(view.rids)
        self.busy = self.occ = self.emitted = 0.0
        self.admitted = self.rounds = self.no_spec = 0


@dataclasses.dataclass
class _Excursion:
    start: float                    # clock s at the decision
    key: Key                        # the state it measures speculation in
    q_spec: Optional[float] = None  # its window's rate
    q_plain: Optional[float] = None  # plain's estimate for that key then


class RegimeController:
    """Chooses the regime from measured windows (module docstring).  ``clock()`` (seconds) is its
    only time source.  Per decode batch launch :meth:`observe`; after a pending switch is made,
    :meth:`switched` (the time between the two is the switch's).

    ``h``: the other regime must beat the current one by this fraction; ``credit_rate``: the share
    of busy time exploration earns; ``spec_max_bs``: the tree graphs' largest batch (None: no
    limit), above which speculation is not run; ``optimistic(bs)``: an upper bound of speculation's
    rate over plain decoding's at ``bs`` (a ratio; None or a None result: no bound), which an
    excursion must clear by ``h``."""

    T_MIN_S = 0.5        # design section 4: shorter than a few admission prefills is noise
    T_MAX_S = 4.0        # ... a wave longer than this is cut: the choice must follow the load
    MAX_GAP_S = 0.25     # as WidthController.MAX_GAP_MS: a longer gap between launches is idle
    H = 0.03             # design section 4's hysteresis
    MIN_WINDOWS = 2      # no switch within two windows of the last
    TRIP_WINDOWS = 1     # a trip measures plain decoding for one window (s39: held for MIN_WINDOWS,
                         # trips cost speculation 26-29 % of a level where trees won 1.4-1.8x)
    NOSPEC_EXIT = 0.95   # spec -> plain when the width controller ran NO_SPEC this share of a window
    ALPHA = 0.3          # a window's weight in its key's estimate (a change followed in ~3 windows)
    SPEC_STALE_S = 60.0  # a spec estimate older than this is unknown (design section 4)
    CREDIT_RATE = 0.01   # exploration's share of busy time
    CREDIT_CAP = 2.0     # credit kept, in expected excursions
    EXCURSION_S = 5.0    # first guess of an excursion's wall time: one T_MAX_S window plus the
                         # switches (the rebuild is a design assumption, 0.3-0.8 s); then measured
    REBUILD_INTERVALS = 2  # launch intervals after a rebuild's launch that can hold its GPU time
                           # (the second under overlap scheduling: a launch waits for the batch before)

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, start: str = SPEC,
                 h: float = H, credit_rate: float = CREDIT_RATE, t_min_s: float = T_MIN_S,
                 t_max_s: float = T_MAX_S, spec_max_bs: Optional[int] = None,
                 optimistic: Optional[Callable[[int], Optional[float]]] = None):
        if start not in (PLAIN, SPEC):
            raise ValueError(f"start must be {PLAIN!r} or {SPEC!r}, got {start!r}")
        if h < 0 or not 0.0 <= credit_rate < 1.0:
            raise ValueError(f"h must be >= 0 and credit_rate in [0, 1), got {h}, {credit_rate}")
        self._clock = clock
        self.regime = start
        self.pending: Optional[str] = None
        self.h, self.credit_rate = float(h), float(credit_rate)
        self.t_min_s, self.t_max_s = float(t_min_s), float(t_max_s)
        self.spec_max_bs = spec_max_bs
        self._optimistic = optimistic
        self.est: Dict[Tuple[str, int, Optional[bool]], Tuple[float, float]] = {}   # _slot -> (q, clock s)
        self._win: Optional[_Window] = None
        self._t_last: Optional[float] = None
        self._bs_last = 0
        self._since_switch = self.MIN_WINDOWS     # the start is no switch
        self._t_pending: Optional[float] = None
        self._trip = False                        # plain only to measure it (module docstring)
        self._tripped: set = set()                # the states a trip was taken in
        self._excursion: Optional[_Excursion] = None
        self.expected_excursion_s = self.EXCURSION_S
        self.credit = self.expected_excursion_s if start == PLAIN else 0.0
        self._first_free = start == PLAIN         # the starting excursion may leave a synced batch
        self.time_s = {PLAIN: 0.0, SPEC: 0.0, "switching": 0.0}
        self.switches = self.excursions = self.windows = 0
        self.explore_s = self.explore_loss_s = 0.0
        self.trip_s = 0.0                         # busy time of trip windows (plain only to measure it)
        self._owed = 0.0                          # a rebuild's measured time, not yet taken out
        self._rebuild_busy = 0.0                  # busy time counted in the intervals after a rebuild
        self._rebuild_intervals = 0               # such intervals still to come

    # ------------------------------------------------------------------ measurement
    def observe(self, view: SchedView) -> RegimeDecision:
        """A decode batch is being launched now: the interval since the previous launch (the batch
        that ran in it, ``view.emitted`` its tokens) goes into the window; at a window's close,
        decide.  While a switch is pending nothing is counted (the time is the switch's)."""
        now = self._clock()
        if self.pending is not None:
            return self._decision()
        w = self._win
        if w is None:
            w = self._win = _Window(view)
        elif self._t_last is not None:
            dt = now - self._t_last
            counted = 0.0 < dt <= self.MAX_GAP_S
            if counted:                          # else idle: its admissions' prefill is not in the window
                w.busy += dt
                w.occ += self._bs_last * dt
                w.emitted += float(view.emitted)
                w.admitted += int(view.admitted)
            if self._rebuild_intervals > 0:
                self._rebuild_busy += dt if counted else 0.0
                self._rebuild_intervals -= 1
            self._take_owed(w)
            w.cohort.intersection_update(view.rids)
        self._t_last, self._bs_last = now, view.bs
        w.rounds += 1
        w.no_spec += bool(view.no_spec)
        if view.pinned and self.regime == PLAIN:
            # a request pins a tree budget: speculation serves it, now (a decided switch, no
            # exploration); the plain window so far measures nothing
            self._book(w)
            self._win = _Window(view)
            self._switch(SPEC, now, count=True)
            return self._decision()
        if ((w.busy >= self.t_min_s and ((not w.cohort and w.admitted > 0) or w.busy >= self.t_max_s))
                or bucket(view.bs) != w.bucket):
            self._close(view, now)
        return self._decision()

    def rebuilt(self) -> None:
        """The drafter's rebuild was launched with the batch just observed: its GPU time lies in the
        next :data:`REBUILD_INTERVALS` launch intervals, counted busy or (longer than ``MAX_GAP_S``)
        already left out as idle."""
        self._rebuild_intervals = self.REBUILD_INTERVALS
        self._rebuild_busy = 0.0

    def charge(self, seconds: float) -> None:
        """A rebuild's measured time (``DrafterRebuild.take_seconds``, read when its events are done,
        maybe launches later): the switch's cost, not speculation's.  Taken out of the open window,
        up to the busy time counted in the intervals after the rebuild (:meth:`rebuilt`; what an idle
        gap already left out is not taken twice), and counted as switching."""
        if seconds > 0.0:
            self._owed += float(seconds)
            if self._win is not None:
                self._take_owed(self._win)

    def _take_owed(self, w: "_Window") -> None:
        c = min(self._owed, self._rebuild_busy, w.busy)
        if c > 0.0:
            w.occ -= w.occ * c / w.busy
            w.busy -= c
            self._rebuild_busy -= c
            self._owed -= c
            self.time_s["switching"] += c
        if self._rebuild_intervals == 0 and self._rebuild_busy <= 0.0:
            self._owed = 0.0                   # nothing counted is left to take it from: it was idle

    def _decision(self) -> RegimeDecision:
        return RegimeDecision(self.regime, self.pending,
                              self.pending == SPEC and self._excursion is not None)

    def switched(self) -> None:
        """The pending switch was made (drain, conversion, rebuild done): the new regime's first
        window runs from now, with the batch the switch was decided at."""
        now = self._clock()
        self.time_s["switching"] += now - self._t_pending
        self.regime, self.pending, self._t_pending = self.pending, None, None
        self._since_switch = 0
        self._t_last = now
        if self.regime == PLAIN and self._excursion is not None:
            self._end_excursion(now)

    @staticmethod
    def _slot(regime: str, key: Key) -> Tuple[str, int, Optional[bool]]:
        """Where ``regime``'s estimate for state ``key`` is kept: plain decoding's per bucket and
        sync verdict, speculation's per bucket (module docstring)."""
        return (regime, key[0], key[1] if regime == PLAIN else None)

    def estimate(self, regime: str, key: Key) -> Optional[float]:
        """The decayed per-slot rate (tokens per request-second) of ``regime`` in state ``key``;
        None when never measured, or (speculation) older than ``SPEC_STALE_S``."""
        e = self.est.get(self._slot(regime, key))
        if e is None or (regime == SPEC and self._clock() - e[1] > self.SPEC_STALE_S):
            return None
        return e[0]

    # ------------------------------------------------------------------ decision
    def _tripping(self) -> bool:
        """In a plain trip's window (plain decoding only to measure it in this state)."""
        return self._trip and self.regime == PLAIN

    def _book(self, w: "_Window") -> None:
        """A closed window's busy time: its regime's, and the trips' too while tripping."""
        self.time_s[self.regime] += w.busy
        if self._tripping():
            self.trip_s += w.busy

    def _close(self, view: SchedView, now: float) -> None:
        w, self._win = self._win, _Window(view)
        tripping = self._tripping()
        self._book(w)
        self.credit = min(self.credit + self.credit_rate * w.busy, self.CREDIT_CAP * self.expected_excursion_s)
        # closed by a bucket change, a window too short or without an admission inside (a level's
        # drain: a high per-slot rate at a falling load, which no regime sustains) measures nothing;
        # the decision is still taken (a new level's first batch is such a close)
        measured = w.busy >= self.t_min_s and w.occ > 0 and (w.admitted > 0 or w.busy >= self.t_max_s)
        q = None
        if measured:
            self.windows += 1
            self._since_switch += 1
            q = w.emitted / w.occ
            wk = (w.bucket, w.synced)
            old = self.estimate(self.regime, wk)
            self.est[self._slot(self.regime, wk)] = (q if old is None else (1 - self.ALPHA) * old + self.ALPHA * q, now)
        exc = self._excursion
        if exc is not None and view.pinned:
            self._end_excursion(now)           # a pinned request keeps speculation: no going back
            exc = None
        if exc is not None:
            if not measured:
                return
            # its one window is measured: keep speculation or go back
            exc.q_spec, exc.q_plain = q, self.estimate(PLAIN, exc.key)
            s = self.estimate(SPEC, exc.key)
            if exc.q_plain is not None and s is not None and s >= (1 + self.h) * exc.q_plain:
                self._end_excursion(now)       # speculation won: a switch, no longer exploration
                self.switches += 1
            else:
                self._switch(PLAIN, now)       # spent at ``switched``
            return
        over = self.spec_max_bs is not None and view.bs > self.spec_max_bs
        if tripping and not over and (not measured or self._since_switch >= self.TRIP_WINDOWS):
            # a trip's measurement is in (or the state passed): back to speculation unless plain
            # decoding won by h
            self._trip = False
            wk = (w.bucket, w.synced)
            pw, sw = self.estimate(PLAIN, wk), self.estimate(SPEC, wk)
            if not (measured and pw is not None and sw is not None and pw >= (1 + self.h) * sw):
                self._switch(SPEC, now, count=True)
            return
        if self._since_switch < self.MIN_WINDOWS or tripping:
            return
        k = (self._win.bucket, self._win.synced)
        p, s = self.estimate(PLAIN, k), self.estimate(SPEC, k)
        if self.regime == SPEC:
            if view.pinned:
                return                         # a pinned request is served by speculation
            if over or (w.rounds and w.no_spec >= self.NOSPEC_EXIT * w.rounds) or (
                    p is not None and s is not None and p >= (1 + self.h) * s):
                self._switch(PLAIN, now, count=True)
            elif p is None and k not in self._tripped and self._may_trip(k, w, measured):
                self._tripped.add(k)           # once per state, whether the measurement lands or not
                self._trip = True
                self._switch(PLAIN, now, count=True)
        elif over:
            return
        elif s is not None:
            if p is not None and s >= (1 + self.h) * p:
                self._switch(SPEC, now, count=True)
        elif (p is not None and (not k[1] or self._first_free) and self.credit >= self.expected_excursion_s
              and self._may_win(view.bs, p)):
            self._first_free = False
            self._excursion = _Excursion(start=now, key=k)
            self.excursions += 1
            self._switch(SPEC, now)

    @staticmethod
    def _may_trip(key: Key, w: "_Window", measured: bool) -> bool:
        """A trip measures plain decoding in state ``key`` (the next window's) only where it can: one
        speculation has just held for a measured window ``w`` (not a ramp's or a drain's passing
        bucket, where the trip would measure nothing and keep plain decoding into the next load), or
        a synced batch (a new level's first: after one wave of speculation its finishes spread, so
        the state is met only at such a close)."""
        return key[1] or (measured and key[0] == w.bucket)

    def _may_win(self, bs: int, p: float) -> bool:
        """The optimistic bound lets speculation beat plain decoding by ``h`` (no bound: yes)."""
        ratio = None if self._optimistic is None else self._optimistic(int(bs))
        return ratio is None or ratio >= 1 + self.h

    def _switch(self, to: str, now: float, count: bool = False) -> None:
        self.pending, self._t_pending = to, now
        if to == SPEC:
            self._trip = False
        if count:
            self.switches += 1

    def _end_excursion(self, now: float) -> None:
        """The excursion is over (back in plain, or kept): its whole wall time is spent."""
        exc, self._excursion = self._excursion, None
        wall = now - exc.start
        self.credit -= wall
        self.explore_s += wall
        self.expected_excursion_s = (1 - self.ALPHA) * self.expected_excursion_s + self.ALPHA * wall
        if exc.q_spec is not None and exc.q_plain:
            self.explore_loss_s += wall * max(0.0, 1.0 - exc.q_spec / exc.q_plain)

    def report(self) -> dict:
        """Host values: the regime, busy s per regime and switching (closed windows), decided
        switches (excursions not counted unless kept; a trip's two included), trips, ``trip_s`` (the
        busy time of their plain windows, part of plain's), excursions, ``explore_s`` (their wall
        time), ``explore_share`` (of that busy time), ``explore_loss_s = sum wall x max(0, 1 - q_spec /
        q_plain)``, the credit (s)."""
        busy = sum(self.time_s.values())
        return {"regime": self.regime, "time_s": dict(self.time_s), "switches": self.switches,
                "trips": len(self._tripped), "trip_s": self.trip_s, "excursions": self.excursions,
                "windows": self.windows, "explore_s": self.explore_s,
                "explore_share": self.explore_s / busy if busy > 0 else 0.0,
                "explore_loss_s": self.explore_loss_s, "credit_s": self.credit}


class CycleRegime:
    """A test-bed regime controller (switch ``regime=cycle<k>``): asks for the other regime every
    ``k`` decode launches whatever was measured, so the GPU test bed's lossless stages cross every
    transition, both ways, admissions included.  :class:`RegimeController`'s interface."""

    def __init__(self, k: int, start: str = SPEC):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"the cycle must be an integer >= 1, got {k!r}")
        if start not in (PLAIN, SPEC):
            raise ValueError(f"start must be {PLAIN!r} or {SPEC!r}, got {start!r}")
        self.k, self.regime, self.pending = k, start, None
        self.launches = self.switches = 0

    def observe(self, view: SchedView) -> RegimeDecision:
        if self.pending is None:
            self.launches += 1
            if self.launches >= self.k:
                self.pending = PLAIN if self.regime == SPEC else SPEC
        return RegimeDecision(self.regime, self.pending)

    def charge(self, seconds: float) -> None:
        """Nothing to weigh: the cycle does not measure."""

    def rebuilt(self) -> None:
        """Nothing to weigh."""

    def switched(self) -> None:
        if self.pending is None:
            raise RuntimeError("CycleRegime.switched: no switch was pending")
        self.regime, self.pending, self.launches = self.pending, None, 0
        self.switches += 1

    def report(self) -> dict:
        return {"regime": self.regime, "switches": self.switches, "cycle": self.k}


class FollowerRegime:
    """A TP rank other than 0 under a measuring controller: it decides nothing (clocks differ between
    ranks; rank 0's decisions reach it through the worker's broadcast, :meth:`follow`) and keeps the
    regime.  :class:`RegimeController`'s interface."""

    def __init__(self, start: str = SPEC):
        if start not in (PLAIN, SPEC):
            raise ValueError(f"start must be {PLAIN!r} or {SPEC!r}, got {start!r}")
        self.regime, self.pending, self.switches = start, None, 0

    def observe(self, view: SchedView) -> RegimeDecision:
        return RegimeDecision(self.regime, self.pending)

    def follow(self, to: Optional[str]) -> None:
        """Rank 0 decided ``to`` (None: nothing)."""
        if to is not None and self.pending is None and to != self.regime:
            self.pending = to

    def charge(self, seconds: float) -> None:
        """Nothing to weigh: rank 0 decides (its own rebuild is charged there)."""

    def rebuilt(self) -> None:
        """Nothing to weigh: rank 0 decides."""

    def switched(self) -> None:
        if self.pending is None:
            raise RuntimeError("FollowerRegime.switched: no switch was pending")
        self.regime, self.pending = self.pending, None
        self.switches += 1

    def report(self) -> dict:
        return {"regime": self.regime, "switches": self.switches, "follower": True}


class LaunchTracker:
    """A :class:`SchedView` per decode launch from the scheduler's host state alone: ``emitted`` =
    the output tokens the requests of the previous launch and this one gained since the previous
    launch (the results the scheduler processed in between, finished requests' last tokens
    included), ``admitted`` = requests this launch holds that the previous one did not hold (their
    prefill's first token is not counted: it was not emitted by a decode batch)."""

    def __init__(self):
        self._prev: list = []
        self._out: Dict[Hashable, int] = {}          # rid -> len(output_ids) at the previous launch

    def view(self, reqs: Sequence, *, no_spec: bool = False) -> SchedView:
        emitted = admitted = 0
        cur = {r.rid: r for r in reqs}
        for rid, r in {**{q.rid: q for q in self._prev}, **cur}.items():
            n = len(r.output_ids)
            if rid in self._out:
                emitted += n - self._out[rid]
            elif rid in cur:
                admitted += 1
        self._out = {rid: len(r.output_ids) for rid, r in cur.items()}
        self._prev = list(reqs)
        width = requested_width(reqs)
        return SchedView(rids=tuple(cur), emitted=float(emitted), admitted=admitted, reqs=reqs,
                         no_spec=no_spec, pinned=width is not None and width > 1)
