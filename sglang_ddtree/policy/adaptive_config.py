"""The adaptive budget's settings (issues 17, 39): which budgets a round may choose among, and a
request's own budget.

The default (issue 39 item 1): with no DDTree setting, a round chooses among the budgets
:func:`default_budgets` derives from the server's budget (the widest: ``--speculative-num-draft-tokens``
- 1, else ``config.default_budget`` of the drafter's block) and "no speculation".
``SGLANG_DDTREE_ADAPTIVE=0`` is the one switch to a fixed budget (the server's).
``SGLANG_DDTREE_BUDGETS=0,7,15,31`` names the budgets instead (verify width ``N = budget + 1``;
``0`` = no speculation = width 1, ``budget_policy.NO_SPEC``); the widest must be the server's budget,
so SGLang reserves KV, sizes buffers and captures its own target graph for the widest width, as for
a fixed budget.  Switches (``switches.py``, the A/B's and the test bed's, not server settings):
``probe_every``, ``budget_cycle`` (e.g. ``(31, 7, 0)``: the budgets forced round by round, each in
the set: the GPU lossless check and the forced no-speculation arm), ``age_buckets`` (the
request-age buckets the acceptance is estimated in: None the default, :data:`DEFAULT_AGE_EDGES`,
``[]`` one bucket, or ascending edges), ``round_overhead``.

A request may pin its rounds' budget: ``"custom_params": {"ddtree_budget": 15}`` in its sampling
parameters (one of the server's budgets; 0 = no speculation where allowed; anything else is refused
at admission with an abort, status 400: :func:`request_budget_error`).  A round runs the narrowest
budget its batch's requests pin, else the policy's choice (:func:`requested_width`).  The A/B uses
it to measure fixed budgets on the adaptive server itself."""
from __future__ import annotations

import dataclasses
from typing import List, Mapping, Optional, Tuple

from .. import switches
from .budget_policy import check_age_edges
from ..config import MAX_BUDGET, MIN_BUDGET

ENV_BUDGETS = "SGLANG_DDTREE_BUDGETS"
CYCLE_SWITCH = "switch budget_cycle"           # switches.Switches.budget_cycle, named in messages
ENV_ADAPTIVE = "SGLANG_DDTREE_ADAPTIVE"         # 1 (default) | 0: the server's budget, fixed
DEFAULT_LADDER = (7, 15, 31)                    # budgets below the widest in the default set
MIN_FREE_GB = 2.0   # the default set builds a width only with this much (or twice the largest state) free

# request-age bucket edges (output tokens): x1.5 from 4.  Fine at young ages, where acceptance moves
# most (toy chain pair: nothing for ~10 tokens, then rising over the next ~50: bench/results/
# acceptance_by_age_chain_cpu.md); the pooled estimate fills buckets with few request-rounds
DEFAULT_AGE_EDGES = (4, 6, 9, 14, 20, 30, 45, 68, 100, 150, 230, 340, 510, 770, 1150, 1730, 2600, 3900,
                     5800, 8800, 13000, 20000, 30000, 45000, 68000, 100000)
DEFAULT_PROBE_EVERY = switches.Switches.probe_every


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
    """budgets: ascending, the last is the server's; cycle: forced budgets per round (0 = no spec)."""

    budgets: Tuple[int, ...]
    no_spec: bool
    probe_every: int
    cycle: Optional[Tuple[int, ...]] = None
    overhead: bool = True   # measure the per-round overhead outside the cost table (switch round_overhead)
    age_edges: Tuple[int, ...] = DEFAULT_AGE_EDGES   # request-age buckets (switch age_buckets)
    implicit: bool = False  # the default set (no budget setting given): a server without CUDA graphs
                            # then runs the fixed budget instead of refusing to start

    @property
    def widths(self) -> Tuple[int, ...]:
        """Every verify width a round may run, ascending (1 = no speculation)."""
        return ((1,) if self.no_spec else ()) + tuple(b + 1 for b in self.budgets)

    @property
    def widest(self) -> int:
        return self.budgets[-1] + 1

    @property
    def extra_widths(self) -> Tuple[int, ...]:
        """Widths that need a state of their own (the widest is the target's captured one)."""
        return tuple(w for w in self.widths if w != self.widest)


# ------------------------------------------------------------------ a request's own budget
REQUEST_BUDGET_KEY = "ddtree_budget"   # sampling_params.custom_params[...]: run this request's rounds at that budget

# what this process's DDTREE worker serves (set by the worker; read by the request check in
# patches/validate_dflash_request.py, which runs in the same scheduler process): (algo, fixed budget, cfg)
_SERVED: Optional[Tuple[str, int, Optional["AdaptiveConfig"]]] = None


def register_served(algo: str, budget: int, cfg: Optional["AdaptiveConfig"]) -> None:
    """The worker's budgets, for :func:`request_budget_error` in the same process."""
    global _SERVED
    _SERVED = (algo, int(budget), cfg)


def allowed_request_budgets(budget: int, cfg: Optional["AdaptiveConfig"]) -> List[int]:
    """The values ``custom_params["ddtree_budget"]`` may take on a server: its fixed budget, or the
    adaptive set (0 = no speculation, when the set has it)."""
    if cfg is None:
        return [int(budget)]
    return ([0] if cfg.no_spec else []) + list(cfg.budgets)


def request_budget_error(custom_params, served=None) -> Optional[str]:
    """None when the request names no budget or one this server runs, else the one-line reason
    (the scheduler aborts the request with it, status 400).  ``served``: ``(algo, budget, cfg)``,
    default what :func:`register_served` recorded (nothing recorded: no check, not a DDTREE worker)."""
    if not isinstance(custom_params, dict) or REQUEST_BUDGET_KEY not in custom_params:
        return None
    served = served or _SERVED
    if served is None:
        return None
    algo, budget, cfg = served
    val = custom_params[REQUEST_BUDGET_KEY]
    allowed = allowed_request_budgets(budget, cfg)
    if isinstance(val, bool) or not isinstance(val, int):
        return (f"{algo}: custom_params.{REQUEST_BUDGET_KEY} must be an integer tree budget, "
                f"got {val!r}")
    if val not in allowed:
        how = ("the server's fixed budget; launch with SGLANG_DDTREE_BUDGETS for a set"
               if cfg is None else "the adaptive budgets; 0 = no speculation when the set has it")
        return (f"{algo}: custom_params.{REQUEST_BUDGET_KEY}={val} is not a budget this server runs: "
                f"allowed {allowed} ({how})")
    return None


def requested_width(reqs) -> Optional[int]:
    """The verify width the batch's requests ask for (``custom_params["ddtree_budget"]``, checked at
    admission): the narrowest one asked for (budget 0 = width 1, no speculation), None when no request
    asks.  Host values only."""
    width = None
    for req in reqs:
        cp = req.sampling_params.custom_params
        if cp:
            b = cp.get(REQUEST_BUDGET_KEY)
            if b is not None:
                w = int(b) + 1
                if width is None or w < width:
                    width = w
    return width


def _int_list(algo: str, name: str, raw: str) -> List[int]:
    try:
        return [int(p.strip()) for p in raw.split(",")]
    except ValueError:
        raise ValueError(f"{algo}: {name} must be a comma-separated list of integers, "
                         f"got {raw!r}") from None


def default_budgets(budget: int) -> List[int]:
    """The default set below the server's (widest) budget: :data:`DEFAULT_LADDER`'s budgets at most
    2/3 of it (a width barely narrower than the widest costs a graph set and saves little), then it;
    e.g. 60 -> [7, 15, 31, 60] (a block-16 drafter), 28 -> [7, 15, 28] (block 8), 32 -> [7, 15, 32]."""
    return sorted({b for b in DEFAULT_LADDER if 1.5 * b <= budget} | {int(budget)})


def parse_config(env: Mapping[str, str], *, budget: int, algo: str,
                 sw: Optional["switches.Switches"] = None) -> Optional[AdaptiveConfig]:
    """The adaptive settings: ``SGLANG_DDTREE_BUDGETS`` lists the budgets a round may choose among
    (``0`` = no speculation; unset: the default set, :func:`default_budgets` + no speculation), or
    None for a fixed budget (``SGLANG_DDTREE_ADAPTIVE=0``, or a list of one tree budget).
    ``budget``: the server's resolved tree budget, the widest; ``sw``: the A/B / test-bed switches
    (default ``switches.CURRENT``: the forced budget cycle, the overhead term, the probe spacing,
    the age buckets).  Raises ValueError, one line."""
    sw = switches.CURRENT if sw is None else sw
    raw = (env.get(ENV_BUDGETS) or "").strip()
    cycle = sw.budget_cycle
    raw_on = (env.get(ENV_ADAPTIVE) or "1").strip()
    if raw_on not in ("0", "1"):
        raise ValueError(f"{algo}: {ENV_ADAPTIVE} must be 0 or 1, got {raw_on!r}")
    if raw_on == "0":
        given = [n for n, v in ((ENV_BUDGETS, raw), (CYCLE_SWITCH, cycle)) if v]
        if given:
            raise ValueError(f"{algo}: {ENV_ADAPTIVE}=0 (a fixed budget) contradicts {given[0]}; "
                             "drop one of them")
        return None
    implicit = not (raw or cycle)
    if raw:
        listed = _int_list(algo, ENV_BUDGETS, raw)
        bad = [b for b in listed if b != 0 and not MIN_BUDGET <= b <= MAX_BUDGET]
        if bad:
            raise ValueError(f"{algo}: {ENV_BUDGETS}={raw}: every budget must be 0 (no speculation) or "
                             f"in [{MIN_BUDGET}, {MAX_BUDGET}], got {bad[0]}")
        if len(set(listed)) != len(listed):
            raise ValueError(f"{algo}: {ENV_BUDGETS}={raw} lists a budget twice")
        no_spec = 0 in listed
        budgets = sorted(b for b in listed if b)
        if not budgets:
            raise ValueError(f"{algo}: {ENV_BUDGETS}={raw} names no tree budget (0 is no speculation): "
                             "list the tree budgets too, or serve without a speculative algorithm")
    else:
        no_spec, budgets = True, default_budgets(budget)
    if budgets[-1] != budget:
        raise ValueError(f"{algo}: {ENV_BUDGETS}={raw}: the widest budget {budgets[-1]} must be the "
                         f"server's tree budget {budget}; launch with --speculative-num-draft-tokens "
                         f"{budgets[-1] + 1} (= widest budget + 1)")
    if sw.age_buckets is None:
        age_edges = DEFAULT_AGE_EDGES
    elif not sw.age_buckets:
        age_edges = ()                # one bucket: every request-round pooled
    else:
        try:
            age_edges = check_age_edges(list(sw.age_buckets))
        except ValueError as e:
            raise ValueError(f"{algo}: switch age_buckets={list(sw.age_buckets)}: {e}") from None
    if cycle is not None:
        allowed = set(budgets) | ({0} if no_spec else set())
        off = [c for c in cycle if c not in allowed]
        if off:
            raise ValueError(f"{algo}: {CYCLE_SWITCH}={list(cycle)}: {off[0]} is not one of the "
                             f"budgets {sorted(allowed)} (0 needs 0 in {ENV_BUDGETS})")
    if not no_spec and len(budgets) == 1 and cycle is None:
        return None   # one budget, no alternative: the fixed path
    return AdaptiveConfig(budgets=tuple(budgets), no_spec=no_spec, probe_every=sw.probe_every, cycle=cycle,
                          overhead=sw.round_overhead, age_edges=age_edges, implicit=implicit)
