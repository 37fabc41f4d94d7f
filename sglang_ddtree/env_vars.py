"""Every ``SGLANG_DDTREE_*`` variable the plugin reads, checked together at argument resolution.

:func:`check` (``spec_algo.DDTreeSpecAlgo.handle_server_args``, in the launcher, before any
scheduler process exists) runs each variable's own parser -- the function the code calls where it
reads the variable -- so a bad value fails at start-up with one line naming the variable, and it
refuses a ``SGLANG_DDTREE_*`` name the plugin does not read (a typo would otherwise be ignored and
the server would run without the setting), naming the closest known one.  The small parsers here
(:func:`choice`, :func:`positive_int`, :func:`flag`) are the ones those modules use.

:data:`VARIABLES` names each variable's kind (``docs/configuration.md`` documents every one):
``user``, ``tuning``, ``diagnostic``, ``tool`` (read by the A/B tool or the scripts, never by a
server).  The A/B's and the test bed's switches are not variables a server reads
(``switches.py``); :data:`REMOVED` names the variables they replaced, so an old launch line is
refused with where its setting went.
"""
from __future__ import annotations

import difflib
import os
from typing import Mapping, Optional, Sequence

PREFIX = "SGLANG_DDTREE_"

VARIABLES = {
    "SGLANG_DDTREE_ADAPTIVE": "user",
    "SGLANG_DDTREE_LOGPROBS": "user",
    "SGLANG_DDTREE_ALLOW_UNCHECKED_SGLANG": "user",
    "SGLANG_DDTREE_BUDGETS": "tuning",
    "SGLANG_DDTREE_TOPK": "tuning",
    "SGLANG_DDTREE_VERIFY_ATTN": "tuning",
    "SGLANG_DDTREE_STATS_FILE": "diagnostic",
    "SGLANG_DDTREE_STATS_EVERY": "diagnostic",
    "SGLANG_DDTREE_PROFILE_FILE": "diagnostic",
    "SGLANG_DDTREE_PROFILE_EVERY": "diagnostic",
    "SGLANG_DDTREE_SYNC_CHECK_FILE": "diagnostic",
    "SGLANG_DDTREE_CHECKOUT": "tool",
    "SGLANG_DDTREE_VENV": "tool",
}
_SWITCH = "now an A/B / test-bed switch, not a server setting (sglang_ddtree/switches.py: {})"
REMOVED = {
    "SGLANG_DDTREE_KV_COMMIT": _SWITCH.format("kv_commit"),
    "SGLANG_DDTREE_COMMIT_OPS": _SWITCH.format("commit_ops; A/B arm suffix _torchcommit"),
    "SGLANG_DDTREE_ROUND_OVERHEAD": _SWITCH.format("round_overhead; A/B arm suffix _nooverhead"),
    "SGLANG_DDTREE_TEST_BUDGET_CYCLE": _SWITCH.format("budget_cycle; A/B arm suffix _nospec"),
    "SGLANG_DDTREE_TEST_GRAPH_MASK_CAP": _SWITCH.format("graph_mask_cap"),
    "SGLANG_DDTREE_TEST_UNPATCHED_GRAPH": _SWITCH.format("graph_mask_patch"),
    "SGLANG_DDTREE_PROBE_EVERY": _SWITCH.format("probe_every"),
    "SGLANG_DDTREE_AGE_BUCKETS": _SWITCH.format("age_buckets"),
    "SGLANG_DDTREE_VERIFY_ATTN_SPLITS": _SWITCH.format("verify_attn_splits"),
    "SGLANG_DDTREE_DRAFT_ATTN": _SWITCH.format("draft_attn; A/B arm suffix _dattn"),
    "SGLANG_DDTREE_BUDGET": ("no longer read: the tree budget is --speculative-num-draft-tokens N "
                             "(budget N - 1; the widest with the adaptive default)"),
    "SGLANG_DDTREE_NO_SPEC": ("no longer read: no speculation is budget 0 in SGLANG_DDTREE_BUDGETS "
                              "(e.g. 0,7,15,31; left out, no round skips speculation)"),
}
FILES = ("SGLANG_DDTREE_STATS_FILE", "SGLANG_DDTREE_PROFILE_FILE", "SGLANG_DDTREE_SYNC_CHECK_FILE")


def choice(env: Mapping[str, str], var: str, choices: Sequence[str], algo: str = "DDTREE") -> str:
    """``env[var]`` (trimmed, lower case) if it is one of ``choices``, ``choices[0]`` when unset or
    empty; anything else a ValueError naming the variable."""
    mode = (env.get(var) or choices[0]).strip().lower()
    if mode not in choices:
        raise ValueError(f"{algo}: {var} must be " + " or ".join(f"'{c}'" for c in choices)
                         + f", got {env.get(var)!r}")
    return mode


def positive_int(env: Mapping[str, str], var: str, default: Optional[int], algo: str = "DDTREE",
                 hi: Optional[int] = None) -> Optional[int]:
    """``env[var]`` as an integer >= 1 (and <= ``hi``), ``default`` when unset or empty; anything
    else a ValueError naming the variable."""
    raw = (env.get(var) or "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1 or (hi is not None and n > hi):
        span = f"in [1, {hi}]" if hi is not None else ">= 1"
        raise ValueError(f"{algo}: {var} must be an integer {span}, got {raw!r}")
    return n


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag(env: Mapping[str, str], var: str, default: bool, algo: str = "DDTREE") -> bool:
    """``env[var]`` as a switch: 1 / true / yes / on or 0 / false / no / off (any case), ``default``
    when unset or empty; anything else a ValueError naming the variable."""
    raw = (env.get(var) or "").strip().lower()
    if not raw:
        return default
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ValueError(f"{algo}: {var} must be one of {', '.join(_ON + _OFF)}, got {env.get(var)!r}")


def _writable_file(env: Mapping[str, str], var: str, algo: str) -> None:
    path = (env.get(var) or "").strip()
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{algo}: {var}={path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{algo}: {var}={path} is a folder; it names the file to append to")


def unknown(env: Mapping[str, str]) -> Optional[str]:
    """The one-line refusal of the first ``SGLANG_DDTREE_*`` name the plugin does not read, or None."""
    for name in sorted(env):
        if name in REMOVED:
            return f"{name} is {REMOVED[name]}"
        if name.startswith(PREFIX) and name not in VARIABLES:
            tails = {v[len(PREFIX):]: v for v in VARIABLES}     # the shared prefix would match anything
            near = difflib.get_close_matches(name[len(PREFIX):], list(tails), n=1)
            hint = f" (did you mean {tails[near[0]]}?)" if near else ""
            return (f"unknown variable {name}{hint}: sglang-ddtree reads only "
                    f"{', '.join(sorted(VARIABLES))} (docs/configuration.md)")
    return None


def check(env: Mapping[str, str], *, algo: str, budget: int):
    """Every ``SGLANG_DDTREE_*`` value of ``env`` through its parser (see the module docstring);
    returns the adaptive configuration (``adaptive_config.parse_config``: None for a fixed budget).
    ``SGLANG_DDTREE_TOPK`` is resolved before (``config.resolve_settings``).  Raises
    ValueError, one line."""
    from . import logprobs, switches, verify_attn_hook
    from .policy import adaptive_config
    from .profiling import ENV_EVERY as PROFILE_EVERY
    from .policy.round_stats import ENV_EVERY as STATS_EVERY

    why = unknown(env)
    if why:
        raise ValueError(f"{algo}: {why}")
    if switches.ERROR:     # the A/B's / test bed's switches plugin refused its DDTREE_SWITCHES
        raise ValueError(f"{algo}: {switches.ERROR}")
    cfg = adaptive_config.parse_config(env, budget=budget, algo=algo)
    verify_attn_hook.mode(env, algo)
    logprobs.enabled(env, algo)
    positive_int(env, STATS_EVERY, 64, algo)
    positive_int(env, PROFILE_EVERY, 64, algo)
    flag(env, "SGLANG_DDTREE_ALLOW_UNCHECKED_SGLANG", False, algo)
    for var in FILES:
        _writable_file(env, var, algo)
    return cfg
