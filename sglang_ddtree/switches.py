"""Switches that are not settings: the A/B's alternatives and the GPU test bed's test switches.

A server reads none of them from its environment (issue 40 item 3: test and A/B switches out of
the serving code paths).  The serving code reads :data:`CURRENT` (all defaults unless something put
other values there); three things do:

* tests: ``monkeypatch.setattr(switches, "CURRENT", switches.Switches(...))``;
* the A/B (``sglang_ddtree/ab/servers.py``, arm suffixes such as ``_nospec``) and the GPU test bed
  (``bench/device/stage.py``, stage suffixes such as ``nospec``, ``nomaskpatch``): they put a JSON
  object in ``DDTREE_SWITCHES`` and load :func:`register_from_environment` into every process of the
  server as an SGLang plugin of its own (:func:`write_plugin`: an entry-point folder on the
  server's ``PYTHONPATH``; the test bed's ``testbed_hooks.register`` calls it).  A package
  installed with pip registers no such entry point, so ``DDTREE_SWITCHES`` does nothing on a
  user's server.

SGLang's plugin loader logs a plugin's exception and goes on, so a bad ``DDTREE_SWITCHES`` is kept
in :data:`ERROR` and refused by the launcher's check (``env_vars.check``); the worker logs the
switches it runs with when they are not the defaults (:func:`describe`), which the A/B checks in
the server's log."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping, Optional, Tuple

ENV = "DDTREE_SWITCHES"          # read only by register_from_environment (the A/B's / test bed's plugin)
PLUGIN_NAME = "ddtree_switches"  # its entry-point name (group sglang.srt.plugins)
LOG_TAG = "DDTree switches (A/B / test bed):"


@dataclasses.dataclass(frozen=True)
class Switches:
    """budget_cycle: forced tree budgets round by round (0 = no speculation; each must be in the
    adaptive set: ``adaptive_config.parse_config`` checks), the GPU lossless check of every width and the
    A/B's forced no-speculation arm; kv_commit: ``remap`` (default) or ``move`` (SGLang's per-layer
    copy; ``DDTreeWorker.__init__``); commit_ops: ``fused`` (the one Triton launch) or ``torch``
    (the ops it replaced, :func:`commit_ops_backend`); round_overhead: False leaves the policy's
    measured per-round overhead out; graph_mask_cap: pretend the target's CUDA-graph mask buffer
    holds this many elements (the eager-verify fallback at test-bed sizes); graph_mask_patch: False
    leaves the tree mask out of captured verify graphs (``patches/decode_graph_spec_info.py``: the
    wrong-output bug the text pair must catch).  Tuning kept out of the user's settings (their
    defaults are what was measured): probe_every: at most every k-th adaptive round is a probe
    (``adaptive.WidthController``); age_buckets: the request-age bucket edges (output tokens) of
    the acceptance estimate, None the default edges, ``[]`` one pooled bucket; verify_attn_splits:
    our verify attention's prefix split count (1-64; None: from the context length); draft_attn:
    the drafter's block forward through our kernel (``sglang`` off, ``auto`` where it covers,
    ``ddtree`` or a start-up error; A/B arm suffix ``_dattn``); draft_fast_plan: the drafter's
    flashinfer TARGET_VERIFY graphs re-plan with SGLang's sync-free ``fast_prefill_plan``
    (``patches/flashinfer_draft_fast_plan.py``; A/B arm suffix ``_dfastplan``); regime: the regime
    the server starts in and keeps (``regime_state.py``): ``spec`` (every batch on the speculative
    path: the default until s40, A/B arm suffix ``_regimespec``) or ``plain`` (every batch on SGLang's plain decode path: the floor of
    issue 52 item 4; A/B arm suffix and stage suffix ``_regimeplain``), or ``cycle<k>``: the regime
    flips every k decode launches (``policy.regime.CycleRegime``; the test bed's transitions, stage
    suffix ``regimecycle``), or ``auto`` (the default): the measured switch (``policy.regime.RegimeController``;
    A/B arm suffix ``_regimeauto``; a batch whose request pins a tree budget is served by
    speculation; a server without the plain decode state, i.e. a fixed budget, only speculates).  ``plain`` serves such a request plainly (forced: the
    floor); its output is the same."""

    budget_cycle: Optional[Tuple[int, ...]] = None
    kv_commit: str = "remap"
    commit_ops: str = "fused"
    round_overhead: bool = True
    graph_mask_cap: Optional[int] = None
    graph_mask_patch: bool = True
    probe_every: int = 16
    age_buckets: Optional[Tuple[int, ...]] = None
    verify_attn_splits: Optional[int] = None
    draft_attn: str = "sglang"
    draft_fast_plan: bool = False
    regime: str = "auto"

    def __post_init__(self):
        if self.budget_cycle is not None:
            cyc = self.budget_cycle
            if not isinstance(cyc, (tuple, list)) or not cyc or not all(_is_int(b) and b >= 0 for b in cyc):
                raise ValueError(f"budget_cycle must be a non-empty list of integers >= 0, got {cyc!r}")
            object.__setattr__(self, "budget_cycle", tuple(cyc))
        for name, allowed in (("kv_commit", ("remap", "move")), ("commit_ops", ("fused", "torch")),
                              ("draft_attn", ("sglang", "auto", "ddtree"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be " + " or ".join(map(repr, allowed))
                                 + f", got {getattr(self, name)!r}")
        if self.regime not in ("spec", "plain", "auto") and regime_cycle(self.regime) is None:
            raise ValueError(f"regime must be 'spec', 'plain', 'auto' or 'cycle<k>' (k >= 1), "
                             f"got {self.regime!r}")
        for name in ("round_overhead", "graph_mask_patch", "draft_fast_plan"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, hi in (("graph_mask_cap", None), ("probe_every", None), ("verify_attn_splits", 64)):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or n < 1 or (hi is not None and n > hi)):
                span = f"in [1, {hi}]" if hi is not None else ">= 1"
                raise ValueError(f"{name} must be an integer {span}, got {n!r}")
        if self.probe_every is None:
            raise ValueError("probe_every must be an integer >= 1, got None")
        edges = self.age_buckets
        if edges is not None:
            if (not isinstance(edges, (tuple, list)) or not all(_is_int(e) and e >= 1 for e in edges)
                    or any(b <= a for a, b in zip(edges, edges[1:]))):
                raise ValueError(f"age_buckets must be ascending integers >= 1 ([] = one bucket), got {edges!r}")
            object.__setattr__(self, "age_buckets", tuple(edges))


def regime_cycle(value) -> Optional[int]:
    """k of a ``cycle<k>`` regime value (k >= 1), else None."""
    if isinstance(value, str) and value.startswith("cycle") and value[5:].isdigit() and int(value[5:]) >= 1:
        return int(value[5:])
    return None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


CURRENT = Switches()
ERROR: Optional[str] = None      # why DDTREE_SWITCHES was refused in this process (env_vars.check raises it)


def parse(text: str) -> Switches:
    """A JSON object of :class:`Switches` fields -> Switches; ValueError (one line) otherwise."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{ENV} is not JSON ({e}): {text!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{ENV} must be a JSON object, got {text!r}")
    names = {f.name for f in dataclasses.fields(Switches)}
    unknown = sorted(set(obj) - names)
    if unknown:
        raise ValueError(f"{ENV}: unknown switch {unknown[0]!r} (known: {', '.join(sorted(names))})")
    try:
        return Switches(**obj)
    except ValueError as e:
        raise ValueError(f"{ENV}: {e}") from None


def to_env(**fields) -> str:
    """The ``DDTREE_SWITCHES`` value that sets these fields (checked here, as the plugin will)."""
    Switches(**fields)
    return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in sorted(fields.items())})


def fields_of(raw: Optional[str]) -> dict:
    """The fields a ``DDTREE_SWITCHES`` value sets ({} for unset / empty)."""
    return dict(json.loads(raw)) if raw else {}


def merged(raw: Optional[str], **fields) -> str:
    """``raw`` (a ``DDTREE_SWITCHES`` value or None) with ``fields`` set too, checked."""
    return to_env(**dict(fields_of(raw), **fields))


def register_from_environment(env: Optional[Mapping[str, str]] = None) -> None:
    """The A/B's / test bed's plugin entry: :data:`CURRENT` from ``env[DDTREE_SWITCHES]`` (unset or
    empty: the defaults).  A bad value leaves the defaults and is kept in :data:`ERROR`."""
    global CURRENT, ERROR
    env = os.environ if env is None else env
    raw = (env.get(ENV) or "").strip()
    if not raw:
        CURRENT, ERROR = Switches(), None
        return
    try:
        CURRENT, ERROR = parse(raw), None
    except ValueError as e:
        CURRENT, ERROR = Switches(), str(e)
        raise


def describe(sw: Optional[Switches] = None) -> Optional[str]:
    """The switches that differ from the defaults, as ``name=value`` pairs; None when none do."""
    sw = CURRENT if sw is None else sw
    diff = [f"{f.name}={getattr(sw, f.name)!r}" for f in dataclasses.fields(Switches)
            if getattr(sw, f.name) != f.default]
    return ", ".join(diff) if diff else None


def write_plugin(folder: str) -> str:
    """Make ``folder`` an entry-point folder that loads :func:`register_from_environment` as the
    SGLang plugin ``ddtree_switches``; put the returned path first on a server's ``PYTHONPATH``."""
    info = os.path.join(folder, "ddtree_switches-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: ddtree-switches\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[sglang.srt.plugins]\n{PLUGIN_NAME} = sglang_ddtree.switches:register_from_environment\n")
    return folder


def commit_ops_backend(sw: Switches, tree_backend: str) -> str:
    """The backend of a round's ``ddtree.commit_round``: switch ``commit_ops`` ``fused`` (default) =
    the one Triton launch (``tree_backend``), ``torch`` = the torch-op composition it replaced
    (``backend="reference"``, on the same device; same outputs): kept so an A/B can measure the
    fused kernel in the same run (arm suffix ``_torchcommit``)."""
    return tree_backend if sw.commit_ops == "fused" else "reference"
