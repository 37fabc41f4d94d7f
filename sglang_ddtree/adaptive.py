"""Adaptive tree budget (issues 17, 39): one target state per width, the per-round choice.

The default (issue 39 item 1): with no DDTree setting, a round chooses among the budgets
:func:`default_budgets` derives from the server's budget (the widest: ``--speculative-num-draft-tokens``
- 1, else ``config.default_budget`` of the drafter's block) and "no speculation".
``SGLANG_DDTREE_ADAPTIVE=0`` is the one switch to a fixed budget (the server's).
``SGLANG_DDTREE_BUDGETS=0,7,15,31`` names the budgets instead (verify width ``N = budget + 1``;
``0`` = no speculation, the one encoding of it in a setting, as in a request's pin); the widest must
be the server's budget, so SGLang reserves KV, sizes buffers and captures its own target graph for
the widest width, as for a fixed budget.  A no-speculation round is SGLang's own decode step on a
state of its own (``plain_decode.py``: DECODE graphs, the user's decode backend) with the
drafter's K/V for its token written later, batched.  Switches (``switches.py``, the A/B's and the
test bed's, not server settings): ``probe_every`` (default 16): at most every k-th round runs a
wider tree than the chosen one (a probe, paid from 5 % of the rounds' cost;
:class:`WidthController`) so the counterfactual acceptance of wider widths stays measured;
``budget_cycle`` (e.g. ``(31, 7, 0)``) forces the budgets round by round (each must be in the set),
for the GPU lossless check and the forced no-speculation arm; ``age_buckets``: the request-age
buckets (output tokens emitted) the acceptance is estimated in
(``budget_policy.BudgetPolicy.update_window``): None the default (:data:`DEFAULT_AGE_EDGES`), ``[]``
one bucket (every request-round pooled) or ascending edges.

A request may pin its rounds' budget: ``"custom_params": {"ddtree_budget": 15}`` in its sampling
parameters (one of the server's budgets; 0 = no speculation where allowed; anything else is refused
at admission with an abort, status 400: :func:`request_budget_error`).  A round runs the narrowest budget its
batch's requests pin, else the policy's choice.  The A/B uses it to measure fixed budgets on the
adaptive server itself (same server, same run, no extra start-up).

Pieces (the worker wires them; each is CPU-tested with fakes):

* :func:`parse_config`: the environment -> :class:`AdaptiveConfig` or None (unset: today's path).
* :func:`build_verify_state`: a target attention backend (+ a ``DecodeCudaGraphRunner`` when the
  target has CUDA graphs) built with ``server_args.speculative_num_draft_tokens`` overridden to the
  width inside :func:`num_draft_tokens_override`; :class:`TargetStates` installs one for a round.
* :func:`cost_table_from_timer`: the cost table from a timer (on the GPU: :func:`graph_replay_ms`,
  replays of the captured graphs at start-up; CPU tests pass a fake timer).
* :class:`WidthController`: per round, the width (forced cycle, probe, or the policy), and the
  counterfactual counts fed back from :class:`round_stats.CounterfactualWindow`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import statistics
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .budget_policy import NO_SPEC, BudgetPolicy, CostTable, _interp, check_age_edges
from .config import MAX_BUDGET, MIN_BUDGET
from . import switches
from .round_stats import CounterfactualWindow

logger = logging.getLogger(__name__)

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
PREDICT_EVERY = 4        # a tree round narrower than the widest predicts every width on every k-th round
DRAFT_PROBE_SHARE = 0.005  # a no-speculation stretch pays draft-only probes from 0.5 % of its rounds' time
CLOSE_DRAFT_PROBE_SHARE = 0.01   # ... 1 % while a tree width could win at PROBE_OPTIMISM x its estimate


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


# ------------------------------------------------------------------ the states' GPU memory
# Each extra target state holds CUDA graphs whose static outputs include the logits of every verify
# row at its largest batch ([max_bs * w, vocab] fp32): most of its memory.  Fitted to the states the
# worker logged (Qwen3-8B shape, vocab 151,936, tree graphs up to bs 64: widths 8 / 16 / 32 took
# 0.47 / 0.86 / 1.66 GB on the H200, ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s23_logs.tgz``;
# the no-speculation state on flashinfer with graphs up to bs 256: 0.816 GB on the H100 since the
# states share the server's flashinfer workspace (session 30; 1.316 GB before, each with a 512 MB
# workspace of its own), ``raw/serving_h100_qwen3-8bchain_random_s32_ddtree_server_log.txt.gz``, which
# also logs widths 8 / 16 / 32 at 0.51 / 0.90 / 1.70 GB; on triton ~0.12 GB with graphs up to bs 64,
# ``raw/scalechain_ab_qwen3-8b_h200_s16_run2_logs.tgz``): logits x 1.2 plus a fixed part, ~0.63 GB for
# the flashinfer no-speculation state.
STATE_LOGITS_FACTOR = 1.2
STATE_FIXED_GB = 0.1
PLAIN_FIXED_GB = {"flashinfer": 0.63}


def state_memory_gb(widths: Sequence[int], *, vocab: int, tree_max_bs: int, plain_max_bs: int,
                    plain_backend: Optional[str]) -> float:
    """Estimated GPU memory (GB) of the extra target states of ``widths`` (verify widths; 1 = the
    no-speculation state with graphs up to ``plain_max_bs`` on ``plain_backend``, tree widths with
    graphs up to ``tree_max_bs``)."""
    total = 0.0
    for w in widths:
        rows = plain_max_bs if w == NO_SPEC else tree_max_bs * w
        fixed = PLAIN_FIXED_GB.get(plain_backend or "", STATE_FIXED_GB) if w == NO_SPEC else STATE_FIXED_GB
        total += STATE_LOGITS_FACTOR * rows * vocab * 4 / 1e9 + fixed
    return total


# ------------------------------------------------------------------ verify states per width
@dataclasses.dataclass
class VerifyState:
    """The target's resources for verify width ``width``: its attention backend (own metadata and
    graph mask buffer), its decode graph runner (None: eager), the build's seconds and GiB."""

    width: int
    attn_backend: object
    graph_runner: object
    build_s: float = 0.0
    mem_gb: float = 0.0
    backend_name: Optional[str] = None   # the no-speculation state's attention backend (None: the server's)


@contextlib.contextmanager
def num_draft_tokens_override(server_args, n: int):
    """``server_args.speculative_num_draft_tokens = n`` inside, the old value after (also on error)."""
    old = server_args.speculative_num_draft_tokens
    server_args.override("sglang_ddtree.adaptive_capture", speculative_num_draft_tokens=int(n))
    try:
        yield
    finally:
        server_args.override("sglang_ddtree.adaptive_restore", speculative_num_draft_tokens=old)


def graph_runner_cls():
    """SGLang's target verify graph runner class (tests replace this function)."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    return DecodeCudaGraphRunner


def build_verify_state(model_runner, width: int, *, use_graphs: bool, runner_cls=None,
                       prepare_backend: Optional[Callable] = None,
                       free_gb: Optional[Callable[[], float]] = None) -> VerifyState:
    """One verify state: ``model_runner``'s server_args say ``width`` while its backend (and graph
    runner, when ``use_graphs``) are built; ``prepare_backend(backend)`` (the worker's tree-verify
    checks) runs on the new backend before capture.  ``runner_cls``: default
    :func:`graph_runner_cls`."""
    tic = time.perf_counter()
    before = free_gb() if free_gb else 0.0
    with num_draft_tokens_override(model_runner.server_args, width):
        saved = getattr(model_runner, "init_new_workspace", None)
        try:
            # the server's flashinfer workspace, shared (see plain_decode._build_backend)
            backend = model_runner._get_attention_backend(init_new_workspace=False)
        finally:
            if hasattr(model_runner, "init_new_workspace"):
                model_runner.init_new_workspace = saved
        if prepare_backend is not None:
            prepare_backend(backend)
        runner = None
        if use_graphs:
            runner_cls = runner_cls or graph_runner_cls()
            runner = runner_cls(model_runner, attn_backend=backend, speculative_num_steps=1,
                                speculative_num_draft_tokens=width)
    after = free_gb() if free_gb else 0.0
    return VerifyState(width=width, attn_backend=backend, graph_runner=runner,
                       build_s=time.perf_counter() - tic, mem_gb=before - after)


class TargetStates:
    """The target's verify states by width.  The widest is the model runner's own (captured by
    SGLang) and stays installed outside rounds; :meth:`installed` swaps a width in for one verify."""

    def __init__(self, model_runner, widest: int):
        self.mr = model_runner
        self.widest = int(widest)
        self.states: Dict[int, VerifyState] = {
            self.widest: VerifyState(self.widest, model_runner.attn_backend,
                                     model_runner.decode_cuda_graph_runner)}

    def add(self, state: VerifyState) -> None:
        if state.width in self.states:
            raise ValueError(f"verify width {state.width} already has a state")
        self.states[state.width] = state

    @contextlib.contextmanager
    def installed(self, width: int):
        """``model_runner.attn_backend`` / ``decode_cuda_graph_runner`` = width's inside; the widest
        state's after (also on error), so prefill and everything outside a verify see SGLang's own."""
        state = self.states[width]
        mr, home = self.mr, self.states[self.widest]
        mr.attn_backend, mr.decode_cuda_graph_runner = state.attn_backend, state.graph_runner
        try:
            yield state
        finally:
            mr.attn_backend, mr.decode_cuda_graph_runner = home.attn_backend, home.graph_runner


# ------------------------------------------------------------------ the cost table
def cost_table_from_timer(batch_sizes: Mapping[int, Sequence[int]],
                          verify_ms: Callable[[int, int], float], *,
                          draft_ms: Optional[Mapping[int, float]] = None,
                          no_spec: bool) -> CostTable:
    """Round cost per (width, bs): ``verify_ms(width, bs)`` (+ the drafter block ``draft_ms``, a
    {bs: ms} row interpolated, for widths >= 2).  ``batch_sizes[width]``: where to time that width;
    width 1 (if ``no_spec``) gives ``base_ms``.  Without no-spec, base_ms copies the narrowest width
    (never chosen: the policy then leaves no-spec out)."""
    rows: Dict[int, Dict[int, float]] = {}
    for w, bss in batch_sizes.items():
        extra = (lambda bs: 0.0) if (w == NO_SPEC or not draft_ms) else (lambda bs: _interp(draft_ms, bs))
        rows[int(w)] = {int(bs): float(verify_ms(int(w), int(bs))) + extra(int(bs)) for bs in bss}
    base = rows.pop(1, None)
    if no_spec and base is None:
        raise ValueError("no-spec needs the width-1 timings")
    if base is None:
        base = dict(rows[min(rows)])
    return CostTable(verify_ms=rows, base_ms=base,
                     draft_ms={int(bs): float(ms) for bs, ms in draft_ms.items()} if draft_ms else None)


def randomize_graph_input_ids(runner, vocab_size: int, seed: int = 0) -> bool:
    """Fill ``runner``'s captured input-id buffer with seeded random ids in ``[0, vocab_size)`` before
    its graphs are timed; False when the runner has no such buffer (nothing changed).

    Why: capture leaves the buffer as SGLang filled it (every token the same id), and a MoE target
    then routes every verify token to the same top-k experts.  Measured on the H200 (Qwen3-30B-A3B
    shape, 24 layers, ``bench/results/raw/scalechain_ab_qwen3-30b-a3b_h200_s18_run3_pins.md``): the
    start-up table said 3.2 ms for a width-32 round at bs 1 (drafter included) where the rounds took
    7.7 ms (verify 7.1), width 16 5.8 ms: the policy chose width 32 at c = 1 and served 0.92x the
    tokens per second of the width-16 arm in the same run.  Real verify tokens are distinct (tree
    siblings, other requests), so random ids route like them.  Every TP rank draws the same ids."""
    buf = getattr(getattr(runner, "buffers", None), "input_ids", None)
    if not isinstance(buf, torch.Tensor) or buf.numel() == 0 or int(vocab_size) < 1:
        return False
    gen = torch.Generator(device=buf.device)
    gen.manual_seed(int(seed))
    buf.copy_(torch.randint(0, int(vocab_size), tuple(buf.shape), generator=gen, device=buf.device,
                            dtype=buf.dtype))
    return True


def graph_replay_ms(runner, bs: int, replays: int = 5) -> Optional[float]:
    """Mean GPU ms of one replay of ``runner``'s captured graph for batch size ``bs`` (with the
    inputs in its buffers: :func:`randomize_graph_input_ids` first for a target), or None when the runner keeps no plain CUDA graph for
    it.  Start-up only: it synchronises."""
    graphs = getattr(getattr(runner, "backend", None), "_graphs", None)
    if graphs is None:
        return None
    g = graphs.get(runner._make_graph_key(bs))
    if g is None:
        return None
    torch.cuda.synchronize()
    for _ in range(2):
        g.replay()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(replays):
        g.replay()
    en.record()
    en.synchronize()
    return st.elapsed_time(en) / replays


# ------------------------------------------------------------------ the per-round choice
class WidthController:
    """Per round: :meth:`next_width` (host values only), then :meth:`record` with the accepted path.

    Order of the choice: the forced cycle (test switch); before the first window of counts, the
    widest width whose cost is at most twice the narrowest tree's at this batch size (the counts of
    every narrower width come with it); else ``policy.choose(bs)``, except on a probe round.

    Probes keep the acceptance of widths wider than the chosen one measured (a narrow round says
    nothing about a wider tree).  A probe runs the widest width that could still win
    (:meth:`_probe_target`; none: no probe) and is paid from a credit of
    ``probe_share`` (default 5 %) of each round's predicted time (``BudgetPolicy.round_ms``: the
    table's cost + the measured overhead + the expected admission): it runs when at least
    ``probe_every`` rounds have passed since the last one and the credit covers its extra GPU cost
    over the chosen width, which the credit then loses (so probes add at most ~5 % to the rounds'
    time).  Until session 20 the credit was 5 % of the table's GPU cost alone: on the MoE chain
    pair at c = 1 (H200, ``bench/results/raw/scalechain_ab_qwen3-30b-a3b_h200_s20_logs.tgz``) a plain
    round's table cost was 2.06 ms and its wall time ~4 ms, so a probe came every ~55 rounds, and
    after a burst of fresh requests the estimate needed several probes to recover.  A
    width-32 probe at bs 64 costs 15 plain decode steps on the Kimi-widths pair (H200 cost table,
    ``bench/results/raw/ab_h200_kimicost_chain_run1_auto_server_log.txt``); probing it every 16th
    round, as this class did, made the mean round at c = 64 about 65 % longer than the median
    (16.9 vs 10.2 ms, ``raw/ab_h200_kimicost_chain_run1_profile_auto.jsonl``).  No probe is needed
    while the widest width is the choice.

    The round overhead (``BudgetPolicy.observe_interval``): the host clock between consecutive batch
    launches (``next_width`` for a round, :meth:`interrupt` for any other batch: the worker calls it
    for every prefill / extend / idle batch), attributed to the batch that interval measures.  Under
    SGLang's overlap scheduler (``lag=1``) the host launches batch i + 1 only after it has processed
    the result of batch i - 1, so the interval from launch i to launch i + 1 is the GPU time of batch
    i - 1, not of batch i (lag 0 without overlap).  An interval that measures a prefill or idle batch
    is not observed.  Measured on the H200 (Qwen3-8B-shaped chain pair,
    ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s15_run2_logs.tgz``): with the interval attributed to
    the batch launched at its start (lag 0 under overlap), every admission prefill's 5-20 ms landed
    in the following round's overhead and every switch from a wide to a narrow width (a probe, say)
    added the wide round's extra cost to the narrow one's; the policy then chose widths 16-32 where
    width 8 served 8-18 % more tokens per second.  Each rank measures its own, so ``share`` (the worker: TP rank 0's object
    broadcast to every rank) is applied when a window of counts arrives, at the same round on every
    rank; until then the policy keeps the last shared values.  Every rank thus sees the same rounds,
    counts and overheads (``CounterfactualWindow`` applies a window at a fixed round), so TP ranks
    choose alike."""

    def __init__(self, cfg: AdaptiveConfig, *, policy: Optional[BudgetPolicy], device,
                 window_every: int = 8, window_lag: int = 4, probe_share: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter,
                 share: Optional[Callable[[dict], dict]] = None, lag: int = 0):
        if not 0.0 <= probe_share < 1.0:
            raise ValueError(f"probe_share must be in [0, 1), got {probe_share}")
        if lag not in (0, 1):
            raise ValueError(f"lag must be 0 (no overlap scheduling) or 1 (overlap), got {lag}")
        self.cfg = cfg
        self.policy = policy
        self.spec_widths = [b + 1 for b in cfg.budgets]
        self.window = CounterfactualWindow(list(cfg.budgets), device=device, every=window_every,
                                           lag=window_lag, age_edges=policy.age_edges if policy else ())
        self.round = 0
        self.chosen: Dict[int, int] = {}
        self.probes = 0
        self.probe_share = float(probe_share)
        self.probe_credit = 0.0
        self._since_probe = 0
        # this round hands the policy the tree's own estimate of every width (``predict``); in a
        # no-speculation round that is a draft-only probe (the drafter block and the widest tree, no
        # verify), paid from ``draft_credit``
        self.predict = False
        self.draft_probes = 0
        self.draft_credit = 0.0
        self._limits = None   # (key, [2, bs] device tensor) of the last batch: token limits, prompt lengths
        self._clock = clock
        self._share = share
        self.lag = int(lag)
        # the last lag + 1 launched batches, oldest first: (bs, width, K or None) of a round, None for
        # any other
        self._launched: List[Optional[Tuple[int, int, Optional[float]]]] = []
        self._t_launch: Optional[float] = None   # host clock of the last launch
        # this rank's overhead samples (its median is shared at windows: every rank the same value)
        self._local_overhead = deque(maxlen=int((policy or BudgetPolicy).overhead_window))
        self._local_overhead_plain = deque(maxlen=int((policy or BudgetPolicy).overhead_window))
        # ... and per choice, with the batch's KV length: [(residual ms, K thousand KV tokens)]
        self._local_width: Dict[int, Deque[Tuple[float, float]]] = {}
        self._kv_k: Optional[float] = None     # this round's batch KV tokens / 1000 (next_width)
        self.intervals = {"observed": 0, "ignored": 0, "other_batch": 0}
        # admissions, from the wall clock: this window's sums (host ms between launches, the table
        # cost of the rounds those intervals measured, ...) and decayed sums over windows
        self._acc = dict.fromkeys(self._ACC_KEYS, 0.0)
        self._adm = dict.fromkeys(("excess", "prefills", "flagged", "rounds", "tokens"), 0.0)

    def _cost(self, bs: int, w: int) -> float:
        return self.policy.costs.cost(bs, w)

    def _launch(self, batch: Optional[Tuple[int, int, Optional[float]]]) -> None:
        """A batch is being launched now (``(bs, width, K)`` of a round, K its thousand KV tokens or
        None, and None for any other batch): the
        interval since the previous launch measures the batch launched ``lag`` launches before that
        one; fold it into this rank's overhead samples if that batch was a round, and into the
        window's wall-clock sums (``_close_window``) either way."""
        now = self._clock()
        measuring = self.policy is not None and self.cfg.overhead
        if measuring and self._t_launch is not None and len(self._launched) > self.lag:
            measured = self._launched[-1 - self.lag]
            ms = (now - self._t_launch) * 1e3
            acc = self._acc
            est = None       # the measured round's overhead at its context (the context axis)
            max_gap = self.MAX_GAP_MS
            if measured is None:
                self.intervals["other_batch"] += 1
            else:
                bs, w, K = measured
                c, cost = w, self._cost(bs, w)
                ring = self._local_overhead_plain if w == NO_SPEC else self._local_overhead
                ok = self.policy.observe_interval(bs, c, ms, into=ring)
                self.intervals["observed" if ok else "ignored"] += 1
                if K is not None:
                    est = self.policy.width_overhead(c, K)
                    self._width_sample(c, ms - cost, K)
                    if est is not None:   # a long context's rounds may take longer than MAX_GAP_MS
                        max_gap = max(max_gap, 4.0 * (cost + est) + 20.0)
            if 0.0 < ms <= max_gap:                  # longer: the server was idle
                acc["host"] += ms
                if measured is None:
                    acc["prefills"] += 1
                elif est is not None:                # table + this round's own overhead estimate
                    acc["table"] += cost + max(0.0, est)
                else:
                    acc["table"] += cost
                    acc["measured_plain" if w == NO_SPEC else "measured_rounds"] += 1
        if measuring:
            if batch is None:
                if self._launched and self._launched[-1] is not None:
                    self._acc["flagged"] += 1         # the first prefill after a round
            else:
                bs, w = batch[:2]
                self._acc["rounds"] += 1
                self._acc["tokens"] += bs * self.policy.tokens_per_request(w)
        self._launched = (self._launched + [batch])[-(self.lag + 1):]
        self._t_launch = now

    MAX_GAP_MS = 250.0   # a longer gap between launches is idle time, not a batch
    WIDTH_WINDOW = 32    # recent rounds per choice in its context fit (BudgetPolicy.width_overhead)

    def _width_sample(self, choice: int, residual: float, K: float) -> None:
        """One round's residual (host interval - table cost, ms) at ``K`` thousand KV tokens into the
        choice's ring.  Not through ``observe_interval``'s filter (4x the table cost + 20 ms), which
        at a long context rejects every round (the table has no context in it); instead a residual
        above 4x the ring's median + 20 ms (an idle gap, once the ring holds 4) is left out."""
        if not math.isfinite(residual):
            return
        ring = self._local_width.setdefault(choice, deque(maxlen=self.WIDTH_WINDOW))
        if len(ring) >= 4 and residual > 4.0 * max(statistics.median(r for r, _ in ring), 0.0) + 20.0:
            return
        ring.append((float(residual), float(K)))
    _ACC_KEYS = ("host", "table", "measured_rounds", "measured_plain", "prefills", "flagged", "rounds", "tokens")

    def _close_window(self) -> Dict[str, Optional[float]]:
        """Fold this window's sums into the decayed ones (decay ``policy.ema``, as the acceptance)
        and return this rank's figures for the policy (None: not measured yet): the round overhead
        (median of the interval samples), the prefill batch's ms (decayed excess wall clock per
        prefill, at least 0) and the finish rate per output token: from the share p of rounds
        followed by a prefill and their mean emitted tokens T (decayed sums), the Poisson rate
        -ln(1 - p) / T (p capped at 0.98; needs 8 rounds' weight).
        The prefills' time is what the wall clock left over: host ms between launches - the table
        cost of the rounds they measured - those rounds x the median round overhead.  A ratio of
        sums over the window, so it does not depend on which interval the overlap scheduler's lag
        puts a prefill in: measured on the H200 (dense, c = 64, ``raw/..._s16_run2_logs.tgz``,
        records of 16 rounds at bs ~60: GPU 17.5 ms, wall 29.3 ms, 12 prefills), the intervals
        attributed to prefills read 7.5 ms (median) where the wall clock says ~15.7."""
        acc, adm, d = self._acc, self._adm, self.policy.ema
        over = self.policy.overhead_of(self._local_overhead)
        over_plain = self.policy.overhead_of(self._local_overhead_plain)
        for k in adm:
            adm[k] *= d
        if acc["prefills"] > 0:
            adm["excess"] += (acc["host"] - acc["table"] - acc["measured_rounds"] * (over or 0.0)
                              - acc["measured_plain"] * (over_plain if over_plain is not None else (over or 0.0)))
            adm["prefills"] += acc["prefills"]
        for k in ("flagged", "rounds", "tokens"):
            adm[k] += acc[k]
        self._acc = dict.fromkeys(self._ACC_KEYS, 0.0)
        out = {"overhead_ms": over, "overhead_plain_ms": over_plain, "prefill_ms": None, "finish_rate": None}
        if self._local_width:    # the context axis (rounds told their batch's KV tokens)
            out["width_fit"] = {c: BudgetPolicy.fit_width_overhead(list(r)) for c, r in self._local_width.items() if r}
        if adm["prefills"] > 0:
            out["prefill_ms"] = max(0.0, adm["excess"] / adm["prefills"])
        if adm["rounds"] >= 8 and adm["tokens"] > 0:
            p = min(adm["flagged"] / adm["rounds"], 0.98)
            out["finish_rate"] = -math.log(1.0 - p) / (adm["tokens"] / adm["rounds"])
        return out

    def interrupt(self) -> None:
        """A batch other than a decode round is being launched (a prefill, a mixed extend, an idle
        batch): the interval that measures it is not a round's overhead sample (it counts in the
        window's wall-clock sums, which give the prefills' cost).
        Measured on the H200 (Qwen3-8B-shaped chain pair, c = 64,
        ``bench/results/raw/scalechain_ab_qwen3-8b_h200_run1_logs.tgz``, profile records): groups of
        rounds at a constant batch of 63-64 took 0-2 ms a round over their GPU time, groups with
        admissions in them 10-20 ms; folded in as a per-round cost, the admissions made every round
        look expensive, which favours the widest trees and never plain decoding (a prefill stalls
        the batch once per admitted request, whatever the width)."""
        self._launch(None)

    def snapshot(self) -> dict:
        """The policy's state for the round profiler's records (host values, no device work): the
        acceptance averages per width (pooled, for the last choice's batch, per age bucket), their
        weights (decayed request-round counts), the shared
        overhead and this rank's sample count, the rounds per width, probes and the interval counts."""
        out = {"chosen": {str(w): n for w, n in sorted(self.chosen.items())}, "probes": self.probes,
               "draft_probes": self.draft_probes, "intervals": dict(self.intervals), "lag": self.lag}
        if self.policy is not None:
            pol = self.policy
            out["accept"] = {str(w): round(a, 4) for w, a in sorted(pol.accept.items())}
            out["accept_weight"] = {str(w): round(c, 2) for w, c in sorted(pol.accept_count.items())}
            if pol.ratio is not None:             # the tree's estimate: calibration and its weight
                out["calibration"] = {str(w): round(r, 4) for w, r in sorted(pol.ratio.items())}
                out["calibration_weight"] = {str(w): round(c, 2) for w, c in sorted(pol.cal_n.items())}
                out["predicted_weight"] = round(sum(pol.pred_n), 2)
            if pol.batch_accept is not None:      # the last choice's batch, weighed by its ages
                out["accept_batch"] = {str(w): round(x, 4) for w, x in sorted(pol.batch_accept.items())}
            if pol.buckets > 1:                   # per age bucket (its lower edge) with any weight
                lows = (0,) + pol.age_edges
                out["accept_by_age"] = {
                    str(lows[b]): {str(w): round(x, 3) for w, x in sorted(pol.bucket_accept[b].items())}
                    for b in range(pol.buckets) if max(pol.bucket_count[b].values()) >= 1.0}
            out["overhead_ms"] = round(float(pol.overhead_ms), 3)
            out["overhead_samples"] = len(self._local_overhead)
            if pol.overhead_plain_ms is not None:
                out["overhead_plain_ms"] = round(float(pol.overhead_plain_ms), 3)
                out["overhead_plain_samples"] = len(self._local_overhead_plain)
            if pol.width_fit:      # the context axis: each choice's a + b K (ms, K = thousand KV tokens)
                out["width_fit"] = {str(c): [round(f[0], 3), round(f[1], 4), f[2]]
                                    for c, f in sorted(pol.width_fit.items())}
            if pol.kv_k is not None:
                out["kv_k"] = round(float(pol.kv_k), 2)
            out["prefill_ms"] = round(float(pol.prefill_ms), 3)
            out["finish_rate"] = round(float(pol.finish_rate), 5)
            out["prefills_weight"] = round(self._adm["prefills"], 2)
        return out

    def _first_width(self, bs: int) -> int:
        if self.policy is None:
            return self.cfg.widest
        ws = [w for w in self.policy.candidates(bs) if w != NO_SPEC]
        if not ws:                     # past every tree width's graphs: plain decoding
            return 1
        cap = 2.0 * self._cost(bs, ws[0])
        return max(w for w in ws if self._cost(bs, w) <= cap)

    def _draft_probe(self, bs: int) -> bool:
        """A no-speculation round chosen by the policy: True when it should also run the drafter block
        and predict every width from the widest tree (a draft-only probe), paid from
        :data:`DRAFT_PROBE_SHARE` of the rounds' predicted time, at most every ``probe_every`` rounds;
        :data:`CLOSE_DRAFT_PROBE_SHARE` while a tree width could still win (:meth:`_probe_target`):
        the estimate of a stretch without trees moves only with these probes, and a low draw then
        kept the simulated server of ``tests/test_policy_simulation.py`` (32k-token requests, where
        width 16 served 1.19x plain decoding) on plain decoding for 500 rounds.  Over four seeds of
        that simulation (32k at bs 1 and 4, 8k at bs 1) the worst case served 0.84x the best fixed
        choice at 0.5 %, 0.97x at 1 %, 0.98x at 2 %; where plain decoding is right the probes cost up
        to their share of its time, hence 1 %.
        It replaces the widest-width verify probe there: at c = 64 on the Qwen3-8B-shaped chain pair
        (H200, ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s26_plain.md``) a width-61 verify probe
        took 99 ms at bs 63, 14 plain steps, where the drafter block is part of one."""
        cost = self.policy.costs.draft_cost(bs) + self.policy.draft_overhead()   # at the batch's context
        share = CLOSE_DRAFT_PROBE_SHARE if self._probe_target(bs, 1) is not None else DRAFT_PROBE_SHARE
        if not self._paid("draft_credit", share, bs, 1, cost):
            return False
        self.draft_probes += 1
        return True

    def _paid(self, credit: str, share: float, bs: int, w: int, cost: float) -> bool:
        """One round at choice ``w``: the credit named ``credit`` earns ``share`` of the round's
        predicted wall time (table + overhead + admission, not its GPU time alone), capped at the
        probe's ``cost`` (no burst of probes after a long stretch).  True, the credit paid and the gap
        restarted, when ``probe_every`` rounds have passed since the last probe and it covers ``cost``."""
        self._since_probe += 1
        earned = min(getattr(self, credit) + share * self.policy.round_ms(bs, w), cost)
        setattr(self, credit, earned)
        if self._since_probe < self.cfg.probe_every or earned < cost - 1e-9:
            return False
        setattr(self, credit, earned - cost)
        self._since_probe = 0
        return True

    def _probe_or(self, bs: int, w: int) -> int:
        """``w`` (the policy's choice) or, on a probe round, the widest width that could still win
        (:meth:`_probe_target`; its counts give every narrower width's too), once the credit covers
        its extra cost over ``w``.  A no-speculation choice with a drafter cost row probes with the
        drafter alone (:meth:`_draft_probe`)."""
        if w == NO_SPEC and self.policy.costs.draft_cost(bs) is not None:
            self.predict = self._draft_probe(bs)
            return w
        target = self._probe_target(bs, w)
        if target is None:              # no wider width could win: nothing worth measuring
            self._since_probe, self.probe_credit = 0, 0.0
            return w
        pol = self.policy     # with their overheads: at a long context the table alone misses most of it
        extra = max(pol.round_cost(bs, target) - pol.round_cost(bs, w), 0.0)
        if not self._paid("probe_credit", self.probe_share, bs, w, extra):
            return w
        self.probes += 1
        self.predict = True          # a probe's pairs calibrate the wide widths
        return target

    PROBE_OPTIMISM = 1.3   # a wider width is worth a probe if it wins with this much more acceptance

    def _probe_target(self, bs: int, w: int) -> Optional[int]:
        """The widest tree width above ``w`` (with graphs at ``bs``) that would beat ``w`` in tokens per
        ms if it accepted :attr:`PROBE_OPTIMISM` x its estimate, else None.  Its counts measure it and
        every narrower width, so one probe covers them all; a width that cannot win even so is not
        worth one.  Why 1.3: the tree's own estimate follows the workload, a probe only refreshes the
        calibration ratio, whose per-prompt spread was 0.76-1.21 (10th-90th percentile) on the text pair
        (``bench/results/accept_calibration_cpu.md``).  Measured on the H200 before this rule (Qwen3-8B-
        shaped chain pair, ``bench/results/raw/scalechain_ab_qwen3-8b_h200_s26_plain.md``): the
        width-61 probes cost 26 ms at bs 16 and 99 ms at bs 63 where width 8 or plain decoding won by
        far."""
        pol = self.policy
        here = pol.score(bs, w)
        out = None
        for x in self.spec_widths:
            if x <= w or x not in pol.candidates(bs):
                continue
            a = pol.tokens_per_request(x) - 1.0
            if pol.score(bs, x, bs * (1.0 + self.PROBE_OPTIMISM * a) / pol.round_ms(bs, x)) > here:
                out = x
        return out

    def next_width(self, bs: int, requested: Optional[int] = None, reqs=None,
                   kv_tokens: Optional[int] = None) -> int:
        """The verify width of this round (1 = no speculation).  ``requested``: the width the batch's
        requests pin (:func:`requested_width`; a width of this controller's set), used instead of
        the policy's choice (the forced test cycle still wins).  ``reqs``: the batch's SGLang
        requests; with age buckets the policy weighs them by their ages (output tokens so far, the
        host's view: one round behind under overlap scheduling).  ``kv_tokens``: the batch's KV
        tokens (the host's committed lengths, summed): each choice is then priced at that context
        (``BudgetPolicy.width_overhead``) and the round's interval sample is kept with it."""
        self._kv_k = None if kv_tokens is None else float(kv_tokens) / 1000.0
        if self.policy is not None:
            self.policy.kv_k = self._kv_k
        for sums, counts, below, pred in self.window.due():
            if self.policy is not None:
                ws = self.spec_widths
                by_width = None if pred is None else {
                    k: [dict(zip(ws, x)) for x in v] for k, v in pred.items()}
                self.policy.update_window([dict(zip(ws, x)) for x in sums], [dict(zip(ws, x)) for x in counts],
                                          [dict(zip(ws, x)) for x in below], pred=by_width)
                local = self._close_window()
                shared = self._share(local) if self._share else local
                for key, val in shared.items():
                    if val is not None:
                        setattr(self.policy, key, dict(val) if isinstance(val, dict) else float(val))
        r = self.round
        self.round += 1
        cfg = self.cfg
        self.predict = False
        if cfg.cycle is not None:
            b = cfg.cycle[r % len(cfg.cycle)]
            w = b + 1
        elif requested is not None:
            # checked at admission; a value that got past it runs the nearest narrower width
            w = max((x for x in self.cfg.widths if x <= requested), default=self.cfg.widths[0])
        elif self.policy is None or self.policy.rounds_seen == 0:
            w = self._first_width(bs)
        else:
            ages = None
            if reqs is not None and self.policy.buckets > 1 and all(hasattr(r, "output_ids") for r in reqs):
                ages = [len(r.output_ids) for r in reqs]
            self.policy.synced = batch_synced(reqs)
            c = self.policy.choose(bs, ages)
            w = self._probe_or(bs, c)
        if w > 1 and r % PREDICT_EVERY == 0:
            self.predict = True
        self.chosen[w] = self.chosen.get(w, 0) + 1
        # a draft-only probe's interval holds the drafter block: not a plain round's context sample
        self._launch((int(bs), w, None if (w == NO_SPEC and self.predict) else self._kv_k))
        return w

    def record(self, path: torch.Tensor, width: int, reqs=None, seq_lens: Optional[torch.Tensor] = None,
               predicted: Optional[torch.Tensor] = None, cf: Optional[torch.Tensor] = None) -> None:
        """path [bs, D + 1] (root first, -1 padded): the round's accepted slots at ``width``; with the
        batch's SGLang requests and its committed lengths ``seq_lens`` [bs] (device), request-rounds
        past a request's max_new_tokens are not counted (:meth:`remaining_and_age`; see
        ``round_stats.CounterfactualWindow``) and each counts in its request's age bucket.
        ``predicted`` [bs, len(spec_widths)] (a round with :attr:`predict`): every width's expected
        acceptance from the widest tree (``accept_estimate.expected_accept``).  ``cf``: the round's
        counterfactual counts at the budgets its tree holds (``round_stats.RoundCounterfactual``;
        None: the window counts them)."""
        n_valid = sum(1 for w in self.spec_widths if w <= width)
        left = age = None
        # a no-speculation round without a prediction counts nothing: no device work for it
        if reqs is not None and seq_lens is not None and (n_valid or predicted is not None):
            left, age = self.remaining_and_age(reqs, seq_lens)
        self.window.record(path, n_valid, left, age, predicted=predicted, cf=cf)

    def remaining_and_age(self, reqs, seq_lens: torch.Tensor):
        """(:func:`remaining_tokens`, :func:`output_tokens`) for a batch of SGLang requests, [bs] each
        on the device; (None, None) when its requests do not carry what they need.  The limits and
        prompt lengths go to the device (pinned, behind the stream, no sync) once per batch
        composition and are reused while it stays."""
        reqs = list(reqs)
        if len(reqs) != seq_lens.shape[0] or not all(hasattr(r, "origin_input_ids") for r in reqs):
            return None, None
        key = (str(seq_lens.device), tuple(token_limits(reqs)), tuple(len(r.origin_input_ids) for r in reqs))
        if self._limits is None or self._limits[0] != key:
            consts = torch.tensor([key[1], key[2]], dtype=torch.int64).reshape(2, len(reqs))
            if seq_lens.device.type == "cuda":
                consts = consts.pin_memory().to(seq_lens.device, non_blocking=True)
            self._limits = (key, consts)
        consts = self._limits[1]
        return remaining_tokens(consts[0], seq_lens), output_tokens(consts[1], seq_lens)


NO_TOKEN_LIMIT = 1 << 40   # a request without max_new_tokens


def batch_synced(reqs) -> bool:
    """Whether plain decoding would finish the batch's requests in a few waves: at least two
    requests, each with a ``max_new_tokens``, whose numbers of tokens left take at most
    ``max(1, bs // 4)`` distinct values (host values: output tokens so far, one round behind under
    overlap scheduling, alike for all).  A benchmark's fixed-length requests sent at once are admitted
    in one to three prefill batches (s28: 1 + 15, 11 + 4), so they finish in as many rounds and their
    successors are admitted as many batches.  False without requests or when any lacks them
    (``BudgetPolicy.score``'s ``sync_margin``)."""
    if reqs is None:
        return False
    reqs = list(reqs)
    bound = max(1, len(reqs) // 4)
    left = set()
    for req in reqs:
        mnt = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
        out = getattr(req, "output_ids", None)
        if mnt is None or out is None:
            return False
        left.add(int(mnt) - len(out))
        if len(left) > bound:
            return False
    return len(reqs) >= 2


def token_limits(reqs) -> List[int]:
    """Per request: prompt length + max_new_tokens, the committed length (``seq_lens``) at which it
    has emitted all its tokens plus one (host values, fixed per request)."""
    out = []
    for req in reqs:
        mnt = getattr(req.sampling_params, "max_new_tokens", None)
        out.append(len(req.origin_input_ids) + (NO_TOKEN_LIMIT if mnt is None else int(mnt)))
    return out


def remaining_tokens(limits: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Tokens each request may still emit in a round that starts at committed length ``seq_lens``:
    a request of prompt length P has emitted ``seq_lens - P + 1`` tokens then (the KV holds the prompt
    and every output token but the last, which is the round's root), so ``limits - seq_lens - 1``
    with ``limits = P + max_new_tokens`` (:func:`token_limits`).  [bs] int64, device, no sync."""
    return limits.to(torch.int64) - seq_lens.to(torch.int64) - 1


def output_tokens(prompt_lens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Output tokens each request has emitted before a round that starts at committed length
    ``seq_lens`` (see :func:`remaining_tokens`): ``seq_lens - P + 1``.  [bs] int64, device, no sync."""
    return seq_lens.to(torch.int64) - prompt_lens.to(torch.int64) + 1


_ROOT_ONLY_CONST: Dict[tuple, tuple] = {}


def root_only_tree(root_tokens: torch.Tensor, draft_depth: int):
    """The tree of a no-speculation round: the root alone (N = 1; what ``build_tree`` gives for
    budget 0).  root_tokens [bs] int64 -> Tree with tokens [bs, 1], no drafter input needed.  The
    constant parts (depth, parent, num_nodes, visibility, mask_words) are cached per (bs, device):
    no-speculation rounds come at high load, where every launch of the round's host work counts;
    nothing downstream writes into them."""
    from .ddtree import Tree

    bs, dev = root_tokens.shape[0], root_tokens.device
    key = (int(bs), str(dev))
    const = _ROOT_ONLY_CONST.get(key)
    if const is None:
        const = (torch.zeros((bs, 1), dtype=torch.int32, device=dev),
                 torch.full((bs, 1), -1, dtype=torch.int32, device=dev),
                 torch.ones((bs,), dtype=torch.int32, device=dev),
                 torch.ones((bs, 1, 1), dtype=torch.bool, device=dev),
                 torch.ones((bs, 1, 1), dtype=torch.int32, device=dev))
        _ROOT_ONLY_CONST[key] = const
    depth, parent, num_nodes, visibility, mask_words = const
    return Tree(tokens=root_tokens.reshape(bs, 1).to(torch.int64), depth=depth, parent=parent,
                num_nodes=num_nodes, visibility=visibility, mask_words=mask_words,
                budget=0, draft_depth=int(draft_depth))


_ROOT_ONLY_ACCEPT: Dict[tuple, tuple] = {}


def root_only_accept(target_top1: torch.Tensor, draft_depth: int):
    """The greedy accept of a no-speculation round (N = 1): nothing accepted, the target's token at
    the root is the bonus.  target_top1 [bs, 1] int64 -> ddtree.Accept (accept_len [bs] int32 zeros,
    path [bs, D + 1] int32 ``[0, -1, ...]``, bonus [bs] int64: a view of target_top1), what
    ``ddtree.accept_greedy`` returns on :func:`root_only_tree` without its launch: accept_len and
    path are constants cached per (bs, D, device), read by the commit and the statistics, never
    written (so a no-speculation round launches no more than plain decoding's argmax here)."""
    from .ddtree import Accept

    bs, dev = target_top1.shape[0], target_top1.device
    key = (int(bs), int(draft_depth), str(dev))
    const = _ROOT_ONLY_ACCEPT.get(key)
    if const is None:
        path = torch.full((bs, int(draft_depth) + 1), -1, dtype=torch.int32, device=dev)
        path[:, 0] = 0
        const = (torch.zeros((bs,), dtype=torch.int32, device=dev), path)
        _ROOT_ONLY_ACCEPT[key] = const
    return Accept(accept_len=const[0], path=const[1], bonus=target_top1.reshape(bs).to(torch.int64))
