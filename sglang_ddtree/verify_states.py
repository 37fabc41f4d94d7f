"""The target's states per verify width and the start-up cost table (issues 17, 39).

A round swaps in the target attention backend (+ its ``DecodeCudaGraphRunner`` when the target
has CUDA graphs) of its verify width for the verify only: :func:`build_verify_state` builds one
with ``server_args.speculative_num_draft_tokens`` overridden to the width inside
:func:`num_draft_tokens_override`; :class:`TargetStates` installs one for a round (width 1, no
speculation, is ``plain_decode.py``'s state).  :func:`state_memory_gb` estimates what the extra
states take (the launcher reserves it).  :func:`cost_table_from_timer` makes the policy's cost
table from a timer (on the GPU :func:`graph_replay_ms`, replays of the captured graphs at
start-up after :func:`randomize_graph_input_ids`; CPU tests pass a fake timer)."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Dict, Mapping, Optional, Sequence

import torch

from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

from .policy.budget_policy import NO_SPEC, CostTable, _interp

logger = logging.getLogger(__name__)


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
class VerifyState(SpecRuntimeState):
    """The target's resources for verify width ``width`` as SGLang 0.5.16's adaptive state
    (``SpecRuntimeState``, the record its adaptive EAGLE keeps per step count): the target's
    attention backend (own metadata and graph mask buffer) and decode graph runner (None: eager).
    Only the target side varies with the width (the drafter always runs one block of ``B``), so the
    draft and draft-extend fields stay None; ``speculative_num_steps`` is 1 (DFlash's single drafter
    pass), 0 for the no-speculation state.  Also the build's seconds and GiB, and the no-speculation
    state's attention backend name (None: the server's).  SGLang's ``AdaptiveController`` is not
    used: it applies a state to the whole worker on an acceptance EMA, while a DDTree round swaps
    the target's state in for its verify only (:meth:`TargetStates.installed`) on the policy's
    per-round choice."""

    def __init__(self, width: int, attn_backend, graph_runner, build_s: float = 0.0, mem_gb: float = 0.0,
                 backend_name: Optional[str] = None):
        super().__init__(speculative_num_steps=0 if int(width) == NO_SPEC else 1,
                         speculative_num_draft_tokens=int(width), draft_attn_backend=None,
                         cuda_graph_runner=None, target_attn_backend=attn_backend,
                         target_graph_runner=graph_runner, draft_extend_attn_backend=None,
                         cuda_graph_runner_for_draft_extend=None)
        self.build_s, self.mem_gb, self.backend_name = float(build_s), float(mem_gb), backend_name

    @property
    def width(self) -> int:
        return self.speculative_num_draft_tokens

    @property
    def attn_backend(self):
        return self.target_attn_backend

    @property
    def graph_runner(self):
        return self.target_graph_runner


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


TIMED_MS = 25.0     # graph_replay_ms: the timed replays of one graph stop at about this much GPU time


def graph_replay_ms(runner, bs: int, replays: int = 5, timed_ms: float = TIMED_MS) -> Optional[float]:
    """Mean GPU ms of one replay of ``runner``'s captured graph for batch size ``bs`` (with the
    inputs in its buffers: :func:`randomize_graph_input_ids` first for a target), or None when the runner keeps no plain CUDA graph for
    it.  Two warm-up replays (the first pays the graph's upload; the second, timed, says how long
    one takes), then ``timed_ms`` / that many timed replays, between 1 and ``replays``: a small
    graph is averaged over several, a 60-node tree at bs 64 (tens of ms) over one (s40, H200: the
    table took 16 s for widths 1 / 8 / 16 / 32 / 61 and the drafter at 2 + 5 replays each; by
    estimate, not yet measured, most of it the largest graphs' replays).  Start-up only: it
    synchronises."""
    graphs = getattr(getattr(runner, "backend", None), "_graphs", None)
    if graphs is None:
        return None
    g = graphs.get(runner._make_graph_key(bs))
    if g is None:
        return None

    def mean_ms(k: int) -> float:      # k replays back to back, timed together
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(k):
            g.replay()
        en.record()
        en.synchronize()
        return st.elapsed_time(en) / k

    torch.cuda.synchronize()
    g.replay()
    n = max(1, min(int(replays), int(timed_ms // max(mean_ms(1), 1e-3))))
    return mean_ms(n)
