"""The regime a DDTREE server's new batches are made in (issue 52 item 1, ``docs/plain_regime_design.md``).

SGLang 0.5.16 takes the speculative or the plain decode path per batch, from
``ScheduleBatch.spec_algorithm``.  A batch made while the regime is plain gets ``NONE`` there
(``patches/regime_batch_algo.py``), so the scheduler prepares, runs and processes it as plain
decoding does (one KV slot a step, no draft input, base's result path); the DDTree worker hands it
to the target as base would (``DDTreeWorker._forward_plain_batch``).

One :data:`STATE` per process (one scheduler and one worker per TP rank).  The worker enables it at
start-up (:func:`enable`) when its adaptive set has the plain decode state; the ``regime`` switch
(``switches.py``: ``spec`` today's default, ``plain`` forced plain regime for the floor A/B) picks
the start, or ``cycle<k>`` a test-bed controller that asks for a switch every k decode launches.
``pending`` is a switch the scheduler's transition hook is to make (drain, convert, then
:func:`switched`); the worker sets it (:func:`request`) from its regime controller's decision."""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

from .policy.regime import PLAIN, SPEC  # noqa: F401 - the two regimes, named once


@dataclasses.dataclass
class RegimeState:
    """enabled: this process's DDTREE worker serves the plain regime; regime: what new batches are
    made in; pending: the regime a transition hook is to switch to (None: none); switches: made so
    far."""

    enabled: bool = False
    regime: str = SPEC
    pending: Optional[str] = None
    switches: int = 0
    on_switch: List[Callable[[], None]] = dataclasses.field(default_factory=list)

    def plain(self) -> bool:
        return self.enabled and self.regime == PLAIN


STATE = RegimeState()


def enable(start: str, on_switch: Optional[Callable[[], None]] = None) -> RegimeState:
    """The worker's start-up call: the plain regime is served, starting in ``start``;
    ``on_switch()`` is called after every switch made (the worker's regime controller)."""
    if start not in (PLAIN, SPEC):
        raise ValueError(f"regime must be {PLAIN!r} or {SPEC!r}, got {start!r}")
    STATE.enabled, STATE.regime, STATE.pending, STATE.switches = True, start, None, 0
    STATE.on_switch = [on_switch] if on_switch is not None else []
    return STATE


def disable() -> None:
    """Back to the state of a process without a regime (tests; a server that cannot serve plain)."""
    STATE.enabled, STATE.regime, STATE.pending, STATE.switches = False, SPEC, None, 0
    STATE.on_switch = []


def request(to: str) -> None:
    """Ask the transition hook to switch to ``to`` at its next safe point (no-op if already there)."""
    if to not in (PLAIN, SPEC):
        raise ValueError(f"regime must be {PLAIN!r} or {SPEC!r}, got {to!r}")
    if not STATE.enabled:
        raise RuntimeError("regime_state.request: the plain regime is not served in this process")
    STATE.pending = None if to == STATE.regime else to


def switched() -> None:
    """The transition hook made the pending switch: new batches are made in it from now on."""
    if STATE.pending is None:
        raise RuntimeError("regime_state.switched: no switch was pending")
    STATE.regime, STATE.pending = STATE.pending, None
    STATE.switches += 1
    for fn in STATE.on_switch:
        fn()


def batch_algorithm(spec_algorithm):
    """The ``spec_algorithm`` a new ``ScheduleBatch`` gets: SGLang's ``NONE`` while the regime is
    plain and the server's algorithm is a DDTREE one, else ``spec_algorithm`` unchanged."""
    if not STATE.plain() or spec_algorithm is None:
        return spec_algorithm
    from .spec_algo import is_ddtree

    if not is_ddtree(spec_algorithm):
        return spec_algorithm
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.NONE
