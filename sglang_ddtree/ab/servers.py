"""Arms, the exact launch_server command line of each, the server process (its own process group) and
its health wait."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from typing import List, Optional

from .. import switches
from .client import http_json

DEFAULT_ARMS = "base,dflash,ddtree_b16,ddtreecpu_b16,ddtree_b32,ddtree_b8,ddtree_b64"
ALGO = {"base": None, "dflash": "DFLASH", "ddtree": "DDTREE-GPU", "ddtreecpu": "DDTREE-CPU"}


# ------------------------------------------------------------------------------------------ arms
AUTO_BUDGETS = (7, 15, 31)
# DDTree arm suffix -> (server environment variable or "switch:<field>" of sglang_ddtree/switches.py,
# value, adaptive arms only); at most one per variable / switch.  Switches travel as DDTREE_SWITCHES,
# applied in the server's processes by the switches plugin PopenServer puts on its PYTHONPATH.
ARM_SUFFIXES = (("_vattn", "SGLANG_DDTREE_VERIFY_ATTN", "ddtree", False),
                ("_sglattn", "SGLANG_DDTREE_VERIFY_ATTN", "sglang", False),
                ("_dattn", "switch:draft_attn", "ddtree", False),
                ("_dfastplan", "switch:draft_fast_plan", True, False),
                ("_torchcommit", "switch:commit_ops", "torch", False),
                ("_nospec", "switch:budget_cycle", [0], True),
                ("_nooverhead", "switch:round_overhead", False, True),
                ("_regimeplain", "switch:regime", "plain", True),
                ("_regimespec", "switch:regime", "spec", True),
                ("_regimeauto", "switch:regime", "auto", True))


# DDTree arm suffix -> server flags added to that arm's launch line (any DDTree arm, once): the
# drafter's attention on triton, where the tree verify runs, instead of the user's backend that
# SGLang gives it (--attention-backend flashinfer: flashinfer, whose TARGET_VERIFY graph replay
# re-plans through a blocking plan(); docs/developer_guide.md, issue 39)
ARM_FLAG_SUFFIXES = (("_drafttriton", ("--speculative-draft-attention-backend", "triton")),)


def arm_switches(arm: dict) -> dict:
    """The switches an arm's server runs with ({} = the defaults), from its ``DDTREE_SWITCHES``."""
    return switches.fields_of((arm.get("env") or {}).get(switches.ENV))


# any arm (base too) + this: SGLang's /freeze_gc after the arm's warm-up (sglang_ddtree.ab.runner)
FREEZE_GC_SUFFIX = "_freezegc"
# an adaptive arm + this + a budget: that arm's server, every request pinned to the budget (last suffix)
PIN_SUFFIX = "_pin"


def parse_arm(name: str) -> dict:
    """'base' | 'dflash' | 'ddtree' | 'ddtree_b<B>' | 'ddtreecpu_b<B>' | 'ddtree_auto[_b<B1>-<B2>-...]' ->
    {name, kind, algo, budget, num_draft_tokens[, auto, env]}.  ``ddtree``: DDTREE-GPU as a user launches
    it, with no DDTree setting (the adaptive default); ``ddtree_b<B>``: budget B fixed
    (``SGLANG_DDTREE_ADAPTIVE=0``).  ``ddtree_auto``: the adaptive budget
    (sglang_ddtree/policy/adaptive.py) over the budgets given (default 7, 15, 31) plus "no speculation",
    served at the widest budget; its ``env`` goes to the server's environment.  A DDTree arm may end
    in ``_vattn`` (e.g. ``ddtree_b16_vattn``): its target verify must run our tree-verify attention
    (``SGLANG_DDTREE_VERIFY_ATTN=ddtree``; the server refuses to start where it does not cover), or
    in ``_sglattn``: SGLang's masked extend kernel (``=sglang``); without either the server's
    default (``auto``: ours where it covers the verify).  ``_dattn``: the drafter's block forward
    also through our kernel (switch ``draft_attn=ddtree``, all-set bitmask; off by default).
    ``_dfastplan``: the drafter's flashinfer graphs re-plan without the blocking host copy
    (switch ``draft_fast_plan``, ``patches/flashinfer_draft_fast_plan.py``; off by default).
    ``_drafttriton``: the drafter's attention on triton (``--speculative-draft-attention-backend
    triton``) whatever ``--attention-backend`` the run gives every arm.  ``_torchcommit`` (e.g.
    ``ddtree_b7_torchcommit``): the round's commit as the torch-op composition it replaced
    (switch ``commit_ops=torch``), to measure the fused commit kernel in the same run.
    ``_nospec`` (adaptive arms only: ``ddtree_nospec``): every round the adaptive budget's
    "no speculation" choice (switch ``budget_cycle=[0]``), to measure that round against
    the base arm's decode step in the same run (the floor the policy falls back to under load).
    ``_regimeplain`` (adaptive arms only: ``ddtree_regimeplain``): every batch in the plain regime
    (switch ``regime=plain``: SGLang's plain decode path, no speculative upkeep), the floor of
    issue 52 item 4 against the base arm in the same run.  ``_regimeauto`` (adaptive arms only):
    the measured switch between the plain regime and speculation (switch ``regime=auto``, the
    default since s40: the same server as ``ddtree``); ``_regimespec``: every batch speculative
    (switch ``regime=spec``, the default before).
    ``_nooverhead`` (adaptive arms only): the policy without its measured per-round overhead term
    (switch ``round_overhead=false``: GPU cost table and acceptance alone), to see what that
    term does to the choice in the same run.  Switches are not server settings
    (``sglang_ddtree/switches.py``): the arm's ``env`` carries them as ``DDTREE_SWITCHES``.  Any arm may end in ``_freezegc`` (last): the A/B calls
    SGLang's ``/freeze_gc`` after that arm's warm-up (``gc.freeze()`` in the scheduler, tokenizer and
    detokenizer: the objects alive then, CUDA graphs and model included, leave the collector's
    reach), to measure the scheduler's garbage-collection pauses in the same run.  An adaptive arm
    may end in ``_pin<B>`` (last, e.g. ``ddtree_auto_b7-15-31_pin15``): the same server as the arm
    without it (``server``; started once, the pinned arms measured after it), every request sending
    ``custom_params.ddtree_budget = B`` (one of the arm's budgets, 0 = no speculation), so the server
    runs that fixed budget: the best fixed budget and the adaptive choice in the same run, on one
    server."""
    name = name.strip()
    head, sep, pin = name.rpartition(PIN_SUFFIX)
    if sep and pin.isdigit() and not name.endswith(FREEZE_GC_SUFFIX):
        arm = parse_arm(head)
        if not arm.get("auto") or arm.get("pin") is not None:
            raise ValueError(f"arm {name!r}: only adaptive arms take {PIN_SUFFIX}<B>, once "
                             f"(ddtree_auto_b7-15-31{PIN_SUFFIX}15)")
        if "SGLANG_DDTREE_BUDGETS" not in arm["env"]:
            raise ValueError(f"arm {name!r}: {PIN_SUFFIX}<B> needs an arm that names its budgets "
                             f"(ddtree_auto_b7-15-31{PIN_SUFFIX}15)")
        allowed = [int(b) for b in arm["env"]["SGLANG_DDTREE_BUDGETS"].split(",")]
        if int(pin) not in allowed:
            raise ValueError(f"arm {name!r}: {PIN_SUFFIX}{pin} is not one of the arm's budgets {allowed}")
        return dict(arm, name=name, pin=int(pin), server=head)
    if name.endswith(FREEZE_GC_SUFFIX):
        arm = parse_arm(name[:-len(FREEZE_GC_SUFFIX)])
        if arm.get("freeze_gc"):
            raise ValueError(f"arm {name!r}: {FREEZE_GC_SUFFIX} once")
        return dict(arm, name=name, freeze_gc=True)
    for suffix, flags in ARM_FLAG_SUFFIXES:
        if not name.endswith(suffix):
            continue
        arm = parse_arm(name[:-len(suffix)])
        if arm["kind"] != "ddtree" or set(flags) & set(arm.get("server_flags") or ()):
            raise ValueError(f"arm {name!r}: only DDTREE-GPU arms take {suffix}, once")
        return dict(arm, name=name, server_flags=tuple(arm.get("server_flags") or ()) + tuple(flags))
    for suffix, var, value, auto_only in ARM_SUFFIXES:
        if not name.endswith(suffix):
            continue
        arm = parse_arm(name[:-len(suffix)])
        env = arm.get("env") or {}
        field = var[len("switch:"):] if var.startswith("switch:") else None
        if arm["kind"] != "ddtree" or (var in env if field is None else field in arm_switches(arm)):
            raise ValueError(f"arm {name!r}: only DDTREE-GPU arms take {suffix}, once "
                             f"(ddtree_b<B>{suffix}, ddtree_auto{suffix})")
        if auto_only and not arm.get("auto"):
            raise ValueError(f"arm {name!r}: only adaptive arms take {suffix} (ddtree_auto{suffix})")
        arm["name"] = name
        arm["env"] = dict(env, **({var: value} if field is None else
                                  {switches.ENV: switches.merged(env.get(switches.ENV), **{field: value})}))
        return arm
    if name == "ddtree":   # the product default: no DDTree setting at all (adaptive over the default set)
        return dict(name=name, kind="ddtree", algo=ALGO["ddtree"], budget=None, num_draft_tokens=None,
                    auto=True, env={})
    kind, _, rest = name.partition("_")
    if kind not in ALGO:
        raise ValueError(f"unknown arm {name!r} (base, dflash, ddtree_b<B>, ddtreecpu_b<B>, ddtree_auto, "
                         "ddtree_b<B>_vattn, ddtree_b<B>_sglattn, ddtree_b<B>_torchcommit)")
    if kind == "ddtree" and (rest == "auto" or rest.startswith("auto_")):
        spec = rest[len("auto_"):] if rest.startswith("auto_") else ""
        if spec and not (spec.startswith("b") and all(x.isdigit() for x in spec[1:].split("-"))):
            raise ValueError(f"arm {name!r}: write the budgets as ddtree_auto_b<B1>-<B2>-..., e.g. ddtree_auto_b7-15-31")
        budgets = sorted({int(x) for x in spec[1:].split("-")}) if spec else list(AUTO_BUDGETS)
        return dict(name=name, kind=kind, algo=ALGO[kind], budget=budgets[-1], num_draft_tokens=budgets[-1] + 1,
                    auto=True, env={"SGLANG_DDTREE_BUDGETS": ",".join(map(str, [0] + budgets))})
    budget = None
    if kind.startswith("ddtree"):
        if not (rest.startswith("b") and rest[1:].isdigit()):
            raise ValueError(f"arm {name!r}: write the budget as {kind}_b<B>, e.g. {kind}_b16")
        budget = int(rest[1:])
    elif rest:
        raise ValueError(f"arm {name!r}: {kind} takes no suffix")
    arm = dict(name=name, kind=kind, algo=ALGO[kind], budget=budget,
               num_draft_tokens=None if budget is None else budget + 1)
    if kind.startswith("ddtree"):   # a fixed budget is an explicit choice since the adaptive default (issue 39)
        arm["env"] = {"SGLANG_DDTREE_ADAPTIVE": "0"}
    return arm


def parse_arms(spec: str, parse=None) -> List[dict]:
    """Comma list -> arms (``parse``: one arm's parser, default :func:`parse_arm`), distinct, the
    reference arm first."""
    arms = [(parse or parse_arm)(a) for a in spec.split(",") if a.strip()]
    names = [a["name"] for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate arms in {spec!r}")
    # the reference arm runs first: identity needs it, and a deadline cuts the tail
    arms.sort(key=lambda a: a["kind"] != "base")
    return arms


def cuda_graph_default_bs(maxc: int) -> List[int]:
    return sorted({b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b <= maxc} | {maxc})


def load_yaml_config(path: str) -> dict:
    import yaml  # SGLang's own dependency (its --config loader)
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return raw


CONFIG_DROP = ("speculative-algorithm", "speculative-num-draft-tokens", "speculative-draft-model-path",
               "speculative-num-steps", "speculative-eagle-topk", "port", "host")


def build_server_cmd(arm: dict, opts: dict, port: int, config_path: Optional[str] = None,
                     config_keys: Optional[set] = None) -> List[str]:
    """The exact launch_server command line of one arm.  ``opts``: python, model_path,
    draft_model_path, maxc, token_ids, mem_fraction, cuda_graph_bs (list or None), server_args,
    prefill_cuda_graph (None / False: ``--disable-prefill-cuda-graph``; True or 0: SGLang's default prefill
    CUDA graph; N > 0: that graph with its token sizes capped at N)."""
    keys = config_keys or set()
    cmd = [opts.get("python") or sys.executable, "-m", "sglang.launch_server"]
    if config_path:
        cmd += ["--config", config_path]

    def add(flag, *vals, key=None):
        k = key or flag.lstrip("-")
        if k in keys:
            return
        cmd.append(flag)
        cmd.extend(str(v) for v in vals)

    if opts.get("model_path"):
        cmd += ["--model-path", opts["model_path"]]
    add("--attention-backend", "triton")
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    add("--mem-fraction-static", opts.get("mem_fraction", 0.6))
    maxc = int(opts["maxc"])
    if "cuda-graph-config" not in keys:
        add("--cuda-graph-max-bs-decode", maxc, key="cuda-graph-max-bs-decode")
        if opts.get("cuda_graph_bs"):
            add("--cuda-graph-bs-decode", *opts["cuda_graph_bs"], key="cuda-graph-bs-decode")
        pg = opts.get("prefill_cuda_graph")
        if pg is None or pg is False:
            add("--disable-prefill-cuda-graph", key="disable-prefill-cuda-graph")
        elif pg is not True and int(pg) > 0:
            add("--cuda-graph-max-bs-prefill", int(pg), key="cuda-graph-max-bs-prefill")
    if "max-running-requests" in keys:
        pass  # the config's value (a warning is recorded by the caller if it is < maxc)
    else:
        cmd += ["--max-running-requests", str(maxc)]
    add("--skip-server-warmup")
    add("--random-seed", 0)
    if opts.get("token_ids"):
        add("--skip-tokenizer-init")
    if arm["algo"]:
        if not opts.get("draft_model_path"):
            raise ValueError(f"arm {arm['name']} needs --draft-model-path")
        cmd += ["--speculative-algorithm", arm["algo"],
                "--speculative-draft-model-path", opts["draft_model_path"]]
        if arm["num_draft_tokens"] is not None:
            cmd += ["--speculative-num-draft-tokens", str(arm["num_draft_tokens"])]
    cmd += shlex.split(opts.get("server_args") or "")
    cmd += list(arm.get("server_flags") or ())     # the arm's own (ARM_FLAG_SUFFIXES): last, so they win
    return cmd


# ------------------------------------------------------------------------------------------ servers
class PopenServer:
    """A launch_server process in its own process group (killed as a group)."""

    def __init__(self, cmd, env, log_path):
        self.log_path = log_path
        # an arm with switches (DDTREE_SWITCHES): the switches plugin goes first on the server's
        # PYTHONPATH, and wait_healthy checks that the worker logged them
        self.switches_expected = (env or {}).get(switches.ENV) or None
        if self.switches_expected:
            folder = switches.write_plugin(os.path.join(os.path.dirname(os.path.abspath(log_path)),
                                                        "ddtree_switches_plugin"))
            env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p))
        self.log = open(log_path, "ab")
        # cwd = the log's folder: `python -m sglang.launch_server` puts its cwd first on sys.path, and
        # from a checkout's root that shadows the installed sglang_ddtree with the bare source folder
        # (no patches/ or kernels/ inside: the plugin then fails to register DDTREE-GPU)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=os.path.dirname(os.path.abspath(log_path)))
        self.pid = self.proc.pid

    def poll(self):
        return self.proc.poll()

    def stop(self, grace: float = 15.0):
        try:
            pgid = os.getpgid(self.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        if pgid is not None:  # children (scheduler, detokenizer) may outlive the launcher
            t = time.time() + 5
            while time.time() < t:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.3)
            else:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


def popen_launcher(cmd, env, log_path):
    return PopenServer(cmd, env, log_path)


def log_tail(path, n=40):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 16000))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


HEALTH_POLL_S = 1.0


def _switches_missing(server) -> Optional[str]:
    """None unless the server was given switches and its log lacks the worker's line naming them
    (the switches plugin did not load: the arm would measure the defaults under its name)."""
    want, path = getattr(server, "switches_expected", None), getattr(server, "log_path", None)
    if not want or not path:
        return None
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        text = ""
    if switches.LOG_TAG in text:
        return None
    return f"the server's log has no '{switches.LOG_TAG}' line for {switches.ENV}={want}: its switches plugin did not load"


def wait_healthy(base_url: str, server, limit_s: float) -> Optional[str]:
    """None when /health_generate answers 200, else the reason."""
    t0 = time.time()
    while time.time() - t0 < limit_s:
        rc = server.poll()
        if rc is not None:
            return f"server exited with code {rc}"
        try:
            st, _ = http_json(base_url, "GET", "/health_generate", timeout=5)
            if st == 200:
                return _switches_missing(server)
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(HEALTH_POLL_S)
    return f"not healthy after {limit_s:.0f} s"

