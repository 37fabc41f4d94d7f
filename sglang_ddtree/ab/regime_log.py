"""What a server's regime controller did during each A/B level, from the server's own log.

The DDTree worker (``sglang_ddtree/worker.py``, rank 0) logs its regime controller's report
(``policy/regime.py``: ``RegimeController.report()``, ``CycleRegime`` / ``FollowerRegime`` alike) as a
Python-repr dict behind SGLang's log prefix (``configure_logger``: ``[%Y-%m-%d %H:%M:%S`` local time,
``.mmm`` with ``SGLANG_LOG_MS``, then `` DP0 TP1``-style ranks when there are several, ``] ``):

    [2026-12-06 09:23:26 TP0] DDTREE-GPU regime: {'regime': 'plain', 'time_s': {...}, 'switches': 3, ...}
    [2026-12-06 09:23:27 TP0] DDTREE-GPU regime switch 2: now spec; {...the same dict...}

the first kind at a decode launch at least ``LOG_EVERY_S`` after the previous one (never while idle),
the second at switches 1-3, 10, 100 and every 1000th.  The counters are cumulative since the server
started, so a level's share is the difference between the line at or before its start and the first
line at or after its end.  The harness and the server share the host: a stamp is read as local time
(``time.mktime``) and compared with ``time.time()`` windows; at one-second resolution a stamp ``s``
means a moment in ``[s, s + 1)``, so a line counts as at-or-after an end only when ``s >= end`` (never
one logged before the end: that would lose the level's last seconds), and as at-or-before a start
when ``s <= start`` (the line :func:`await_line` got just before the level; the next one cannot come
within ``LOG_EVERY_S`` of it).

After a level the server is idle and logs nothing, so waiting alone never brings the closing line:
:func:`await_line` waits until the worker's next line is due and sends one short request (one
request, 2 new tokens), whose decode launch writes it.  That launch also closes the level's last
window (the controller counts closed windows only: a bs-1 batch is another bs bucket, except after a
c=1 level, whose last window, at most ``T_MAX_S`` = 4 s of busy time, then goes to the next level),
and the controller decides on it like on any batch (a passing bs-1 batch: no trip, ``_may_trip``)."""
from __future__ import annotations

import ast
import math
import re
import time
from typing import Callable, List, NamedTuple, Optional, Tuple

LOG_EVERY_S = 5.0     # = sglang_ddtree.worker.REGIME_LOG_EVERY_S (not imported here: the worker needs torch)
POLL_S = 0.3          # after a flush request: its line reaches the file (and > profiling.IDLE_GAP_S, so
                      # the next level's first profile record does not start with the flush's round)
TIME_KEYS = ("plain", "spec", "switching")

_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d+)?(?: [^\]]*)?\] \S+ regime"
                   r"(?: switch (\d+): now \w+;|:) (\{.*\})\s*$")


class Report(NamedTuple):
    """One report line: ``t`` its stamp (epoch s, local-time prefix), ``switch`` the switch number
    of a switch line (None: a periodic line), ``d`` the controller's report dict."""
    t: float
    switch: Optional[int]
    d: dict


def parse_line(line: str) -> Optional[Report]:
    """A report line -> :class:`Report`; anything else (other lines, a dict that does not parse) -> None."""
    m = _LINE.match(line)
    if m is None:
        return None
    try:
        d = ast.literal_eval(m.group(4))
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + float(m.group(2) or 0.0)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if not isinstance(d, dict):
        return None
    return Report(t, None if m.group(3) is None else int(m.group(3)), d)


class RegimeLog:
    """The report lines of one server log, read incrementally (each call reads only what was appended,
    complete lines only).  ``reports()`` -> every :class:`Report` so far, in file order."""

    def __init__(self, path: str):
        self.path, self._pos, self._reports = path, 0, []

    def reports(self) -> List[Report]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except OSError:
            return self._reports
        end = data.rfind(b"\n") + 1
        self._pos += end
        for line in data[:end].decode("utf-8", errors="replace").splitlines():
            if " regime" in line:
                r = parse_line(line)
                if r is not None:
                    self._reports.append(r)
        return self._reports


def await_line(log: RegimeLog, end: float, send: Callable[[], object], deadline_at: Optional[float] = None,
               every: float = LOG_EVERY_S, now: Optional[Callable[[], float]] = None,
               sleep: Optional[Callable[[float], None]] = None) -> bool:
    """Make sure a report line stamped at or after ``end`` exists: wait until the worker's next line
    is due (``every`` s after its last periodic line, whose stamp is truncated to the second: + 1 s;
    without one, after ``end``; never before the second after ``end``), then ``send()`` one short
    request so its decode launch logs it (again every ``POLL_S`` while none comes).  At most
    ``every`` + 2 s after ``end``, less when ``deadline_at`` (kept 5 s clear) is near.  -> whether
    the line came.  ``now`` / ``sleep``: ``time.time`` / ``time.sleep`` unless given."""
    now, sleep = now or time.time, sleep or time.sleep
    limit = max(now(), end) + every + 2.0
    if deadline_at is not None:
        limit = min(limit, deadline_at - 5.0)
    while True:
        reps = log.reports()
        if any(r.t >= end for r in reps):
            return True
        periodic = [r.t for r in reps if r.switch is None]
        due = max(math.ceil(end), (periodic[-1] + 1.0 if periodic else end) + every) + 0.05
        t = now()
        if t >= limit:
            return False
        if t < due:
            sleep(min(due, limit) - t)
            continue
        try:
            send()
        except Exception:  # noqa: BLE001 - the flush request is best effort
            pass
        sleep(max(0.0, min(POLL_S, limit - now())))


def has_regime_controller(arm: Optional[dict]) -> bool:
    """Whether an A/B arm record's server ran a regime controller: the A/B read its report lines
    (the arm's ``regime_final``, or a level's ``regime`` record)."""
    return bool(arm) and (bool(arm.get("regime_final")) or any(lv.get("regime") for lv in arm.get("levels") or []))


def _num(d: dict, key: str) -> float:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) else 0.0


def level_regime(reports: List[Report], window: Tuple[float, float]) -> Optional[dict]:
    """The regime of one level from the cumulative counters: the difference between the last line at
    or before ``window[0]`` (none: zeros, the server's start) and the first line at or after
    ``window[1]`` (none: the last line there is, ``partial``).  -> None without report lines, else
    {time_s: {plain, spec, switching} s, spec_share: spec / (plain + spec) or None, switches, trips,
    trip_s (their plain windows' busy time), trip_share: trip_s / busy or None, excursions,
    explore_s, explore_share: explore_s / busy (the three times) or None, lines: the
    report lines used (0-2)[, partial: True]}.  A field a controller does not report (``CycleRegime``:
    switches only) counts 0."""
    if not reports:
        return None
    start, end = window
    a = next((r for r in reversed(reports) if r.t <= start), None)
    b = next((r for r in reports if r.t >= end), None)
    partial = b is None
    if b is None:
        b = reports[-1] if a is None or reports[-1].t > a.t else a
    da, db = a.d if a is not None else {}, b.d
    ta, tb = da.get("time_s") or {}, db.get("time_s") or {}
    ts = {k: round(_num(tb, k) - _num(ta, k), 3) for k in TIME_KEYS}
    busy, run = sum(ts.values()), ts["plain"] + ts["spec"]
    explore = round(_num(db, "explore_s") - _num(da, "explore_s"), 3)
    trip = round(_num(db, "trip_s") - _num(da, "trip_s"), 3)
    out = dict(time_s=ts, spec_share=round(ts["spec"] / run, 4) if run > 0 else None,
               switches=int(_num(db, "switches") - _num(da, "switches")),
               trips=int(_num(db, "trips") - _num(da, "trips")), trip_s=trip,
               trip_share=round(trip / busy, 4) if busy > 0 else None,
               excursions=int(_num(db, "excursions") - _num(da, "excursions")), explore_s=explore,
               explore_share=round(explore / busy, 4) if busy > 0 else None,
               lines=(a is not None) + (b is not a))
    if partial:
        out["partial"] = True
    return out


def _pct(v: Optional[float], nd: int = 0) -> str:
    return "-" if v is None else f"{100.0 * v:.{nd}f} %"


def summary(r: dict) -> str:
    """One level's regime in a few words: 'spec 35 %, 2 switches (1 trip, 4.0 % of busy time),
    explore 0.4 %[, partial]' (trips: first measurements of plain decoding in a state, two switches
    each; their share where the controller reports their time)."""
    trips = r.get("trips") or 0
    share = f", {_pct(r['trip_share'], 1)} of busy time" if trips and r.get("trip_share") else ""
    return (f"spec {_pct(r.get('spec_share'))}, {r.get('switches')} switches"
            f"{f' ({trips} trip' + ('s' if trips > 1 else '') + share + ')' if trips else ''}, explore "
            f"{_pct(r.get('explore_share'), 1)}{', partial' if r.get('partial') else ''}")


def total_summary(d: dict) -> str:
    """A whole server's report (the last line): 'plain 12.3 s, spec 4.5 s, switching 0.1 s, 3 switches,
    1 excursions, explore 2.1 s (12.0 %)'; the fields it has."""
    ts = d.get("time_s") or {}
    parts = [f"{k} {_num(ts, k):.1f} s" for k in TIME_KEYS if k in ts]
    parts += [f"{d[k]} {k}" for k in ("switches", "trips", "excursions") if k in d]
    if "trip_s" in d:
        parts.append(f"trips {_num(d, 'trip_s'):.1f} s")
    if "explore_s" in d:
        parts.append(f"explore {_num(d, 'explore_s'):.1f} s ({_pct(d.get('explore_share'), 1)})")
    return ", ".join(parts)
