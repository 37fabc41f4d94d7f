"""The DDTree speculative worker for SGLang 0.5.16 (``DDTREE-GPU``; ``DDTREE-CPU`` = same worker,
CPU-heap tree).

It is SGLang's ``DFlashWorkerV2`` (drafter worker, prefill, idle batches, draft KV materialisation,
overlap relay) with the decode round replaced.  One round, for ``bs`` requests, drafter block ``B``
(depth ``D = B - 1``), tree budget ``b`` (``N = b + 1`` verify slots), top-``K``:

1. draft: the block ``[bonus, mask x D]`` at positions ``prefix + 0..D`` through the drafter (its
   CUDA graph), whose folded head (``draft_head.DDTreeDraftHead``) leaves top-K log-probs
   ``[bs, D, K]``;
2. tree: ``build_tree`` (best-first, ``b`` nodes + root = bonus) -> tokens / depth / parent / mask;
3. verify input: ids = tree tokens, positions = ``prefix + depth``, KV slots ``prefix + 0..N-1``
   (pre-reserved rows of ``req_to_token``), the ancestor-only mask: with our verify attention (the
   default where it covers the target, ``verify_attn_hook.py``) only the bitmask, into the hook's
   buffer; else (``SGLANG_DDTREE_VERIFY_ATTN=sglang`` or not covered) in SGLang's FULL_MASK layout
   written straight into the target backend's CUDA-graph mask buffer;
4. the target's TARGET_VERIFY forward over ``bs * N`` tokens (its CUDA graph, captured with a mask:
   ``patches/decode_graph_spec_info.py``);
5. accept: greedy -> ``accept_greedy`` on the target argmax; sampled batches -> SGLang's target-only
   tree sampling kernel over the tree's first-child / next-sibling links (lossless);
6. commit (``ddtree.commit_round``, one launch): the accepted slots' target KV locations move to
   ``prefix + 0..a`` in ``req_to_token`` (switch ``kv_commit="move"``: the K/V itself, SGLang's
   ``move_accept_tokens_to_target_kvcache``), the drafter's context K/V for those positions is
   materialised from the accepted slots' target hidden states, and the bonus token is relayed.

Each round asks the policy (``policy/``: ``self._policy.plan`` before the draft,
``self._policy.observe`` after the accept) for its verify width N: by default the adaptive choice
(``SGLANG_DDTREE_ADAPTIVE=0``: the server's fixed budget; one target attention backend + verify graph
per width, swapped in for the verify only), and builds the first N - 1 nodes of the same best-first
tree; N = 1 is no speculation: SGLang's own decode step on a plain-decode state (``plain_decode.py``),
the drafter's K/V for its token written later, batched, and on a draft-only probe round the drafter
block and the widest tree for the policy's estimate.

No step reads a device value on the host: KV-buffer sizes come from the scheduler's host-side upper
bounds, exactly like DFLASH.  ``DDTREE-CPU`` copies the top-k to the host, builds the tree with
the reference heap, and walks the accept on the host (the published ports' recipe).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from copy import deepcopy
from typing import Optional

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.distributed import get_tp_group
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch, ForwardMode,
                                                           compute_position)
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

from . import (ddtree, logprobs, plain_decode, regime_state, sampling, switches, tree_ops, verify_attn_hook,
               verify_states)
from . import drafter_rebuild
from .draft_head import DDTreeDraftHead, check_target_lm_head
from .policy import NO_SPEC, BatchView, RoundOutcome, RoundPolicy, adaptive, adaptive_config
from .policy.budget_policy import BudgetPolicy
from .policy.regime import CycleRegime, FollowerRegime, LaunchTracker, RegimeController
from .policy.round_stats import make_round_observers
from .spec_algo import SPEC_GRAPH_MAX_BS, settings_for_worker
from .switches import commit_ops_backend
from .tree_ops import host_to_device
from .verify_backend import (_eager_verify, _find_graph_mask_buffer, _graph_mask_capacity,
                             check_tree_verify_backend, disable_causal_verify_shortcut,
                             enable_draft_block_attention, enable_draft_fast_plan,
                             enable_tree_verify_attention, plan_verify_mask_buffer,
                             verify_attention_backend)
from .warmup import warm_round_kernels

logger = logging.getLogger(__name__)

# regime=auto under TP: the ranks agree on rank 0's regime decision every this many decode launches
REGIME_SYNC_EVERY = 16
# a regime controller's report (time per regime, switches, exploration) is logged this often (s), at a
# decode launch (an idle server writes nothing); the A/B splits the counters by level from these lines
# (sglang_ddtree/ab/regime_log.py, whose LOG_EVERY_S is this value)
REGIME_LOG_EVERY_S = 5.0

# Test/diagnostic switch: count host synchronisations per round (see _sync_checked_round).
_SYNC_CHECK_FILE = os.environ.get("SGLANG_DDTREE_SYNC_CHECK_FILE") or None


class DDTreeWorker(DFlashWorkerV2):
    """Spec-v2 worker (overlap and non-overlap).  Constructed by SGLang's scheduler with exactly
    ``(server_args, gpu_id, ps, nccl_port, target_worker)``."""

    _profiles_its_rounds = True   # its own RoundProfiler (patches/dflash_round_profile.py skips it)
    _policy = None                # policy.RoundPolicy: each round's plan, and what the rounds measured
    _catch_up = None              # plain_decode.DraftCatchUp when no-speculation rounds may run
    _draft_fast_plan = False      # the drafter's flashinfer graphs plan from host lengths (A/B switch)
    _last_width = None            # the last tree round's verify width (the regime controller's no_spec)
    _launches = None              # policy.regime.LaunchTracker: each decode launch as the regime sees it
    _regime_launches = 0          # decode launches the regime controller saw (the TP sync points count them)
    _regime_shared = False        # TP ranks share rank 0's regime decisions (regime=auto under TP)
    _regime_logged = 0.0          # time.monotonic() of the last regime report line
    _rebuild = None               # drafter_rebuild.DrafterRebuild while the regime is served

    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
        algo = SpeculativeAlgorithm.from_string(server_args.speculative_algorithm)
        self.algo_name = algo.name
        self.tree_backend = getattr(algo, "tree_backend", "triton")
        mc = target_worker.model_runner.model_config
        if mambaish_config(mc) is not None:
            raise ValueError(f"{self.algo_name} does not support hybrid (Mamba / linear-attention) "
                             "targets: their verify state commit is chain-only")
        # the launcher's settings (they travel on server_args), checked against this rank's model
        # config and, under TP, against every other rank's (a mismatch raises on every rank)
        self.settings = settings_for_worker(server_args, algo=self.algo_name,
                                            vocab_size=mc.vocab_size,
                                            cpu_group=get_tp_group().cpu_group)
        self.budget = self.settings.budget
        self.num_verify = self.settings.num_verify_tokens
        self.topk = self.settings.topk
        if switches.ERROR:
            raise ValueError(f"{self.algo_name}: {switches.ERROR}")
        # how a round commits the accepted path's target K/V (switch kv_commit): remap (default)
        # permutes the request's req_to_token row over the verify slots (in ddtree.commit_round, one
        # launch whatever the layer count); move copies each layer's K/V rows with SGLang's
        # move_accept_tokens_to_target_kvcache (122 launches on a 61-layer target); both need page size 1
        self._kv_commit = switches.CURRENT.kv_commit
        self._commit_backend = commit_ops_backend(switches.CURRENT, self.tree_backend)
        changed = switches.describe()
        if (changed or os.environ.get(switches.ENV)) and getattr(ps, "tp_rank", 0) == 0:
            # also when the switches given equal the defaults: the A/B checks the line (plugin loaded)
            logger.info("%s %s", switches.LOG_TAG, changed or "the defaults")
        # adaptive budget (issues 17, 39): the default set, SGLANG_DDTREE_BUDGETS', or None (fixed); the
        # extra verify states are built after the target's graph capture (init_cuda_graphs)
        self._adaptive_cfg = adaptive_config.parse_config(os.environ, budget=self.budget, algo=self.algo_name)
        # what a request may pin with custom_params["ddtree_budget"] (checked at admission)
        adaptive_config.register_served(self.algo_name, self.budget, self._adaptive_cfg)
        # the round's plan and what it measured (its width controller starts in _init_adaptive, which
        # SGLang may call before or after the statistics below exist)
        self._policy = RoundPolicy(self.num_verify)
        self._verify_states: Optional[verify_states.TargetStates] = None
        # The drafter runs its own block width: give it (and its attention backend / graphs) a copy
        # of the server arguments with speculative_num_draft_tokens = block size; the target keeps
        # N = budget + 1.  DFlashWorkerV2 reads its block size from the same field.
        draft_args = deepcopy(server_args)
        draft_args.override("sglang_ddtree.drafter_block",
                            speculative_num_draft_tokens=self.settings.block_size)
        self.target_server_args = server_args
        super().__init__(server_args=draft_args, gpu_id=gpu_id, ps=ps, nccl_port=nccl_port,
                         target_worker=target_worker)
        assert self.block_size == self.settings.block_size
        self._eager_head: Optional[DDTreeDraftHead] = None
        self._own_mask_buf: Optional[torch.Tensor] = None
        self._eager_mask_rounds = 0
        self._rounds = 0
        stats, self._prof = make_round_observers(
            server_args, algo=self.algo_name, budget=self.budget, block_size=self.block_size,
            topk=self.topk, tp_rank=self.ps.tp_rank, device=self.device,
            adaptive_cfg=self._adaptive_cfg)
        self._policy.report_to(stats=stats, profiler=self._prof)
        if self.ps.tp_rank == 0:
            logger.info("%s worker: budget=%d (verify width %d), drafter block=%d, top-k=%d, "
                        "tree backend=%s", self.algo_name, self.budget, self.num_verify,
                        self.block_size, self.topk, self.tree_backend)
            if self._adaptive_cfg is not None:
                logger.info("%s adaptive budget: budgets=%s, no-spec=%s, probe every %d rounds%s",
                            self.algo_name, list(self._adaptive_cfg.budgets), self._adaptive_cfg.no_spec,
                            self._adaptive_cfg.probe_every,
                            "" if self._adaptive_cfg.cycle is None
                            else f", forced cycle {list(self._adaptive_cfg.cycle)} (test switch)")

    def init_attention_backends(self):
        """SGLang's scheduler creates the target's attention backend, then the drafter's (this
        call): the first point where the target's backend exists, still at startup."""
        super().init_attention_backends()
        backend = self._target_worker.model_runner.attn_backend
        check_tree_verify_backend(backend, self.algo_name)
        disable_causal_verify_shortcut(backend, self.algo_name)
        draft_runner = getattr(self, "draft_model_runner", None)
        enable_tree_verify_attention(backend, self._target_worker.model_runner, self.algo_name,
                                     getattr(draft_runner, "attn_backend", None))
        if switches.CURRENT.draft_fast_plan:           # A/B switch, off by default
            self._draft_fast_plan = enable_draft_fast_plan(getattr(draft_runner, "attn_backend", None),
                                                           self.algo_name)
        if verify_attn_hook.draft_mode() != "sglang":   # off by default
            enable_draft_block_attention(getattr(draft_runner, "attn_backend", None),
                                         getattr(draft_runner, "model", None), self.block_size,
                                         self._target_worker.model_runner.req_to_token_pool.req_to_token,
                                         self.algo_name, target_backend=backend)
        # at start-up, also when no CUDA graph is captured (the eager head is made at the first round)
        check_target_lm_head(self._target_worker.model_runner.model, self.algo_name)

    def init_cuda_graphs(self):
        """The drafter's graphs (DFLASH's); with the adaptive budget on, then one target verify state
        per extra width (the target's own graphs, for the widest width, exist by now); then every
        per-round kernel warmed for every width (``warm_round_kernels``)."""
        super().init_cuda_graphs()
        if self._adaptive_cfg is not None:
            self._init_adaptive(self._adaptive_cfg)
        self._start_regime()
        if torch.device(self.device).type == "cuda" and self.tree_backend == "triton":
            mr = self._target_worker.model_runner
            widths = self._adaptive_cfg.widths if self._adaptive_cfg is not None else (self.num_verify,)
            try:   # an optimisation only: a failure is logged and serving goes on (first uses compile then)
                info = warm_round_kernels(
                    widths=widths, block_size=self.block_size, topk=self.topk,
                    vocab_size=mr.model_config.vocab_size,
                    max_bs=max(1, min(1024, int(mr.req_to_token_pool.size))),   # the most requests a batch holds
                    tree_backend=self.tree_backend,
                    full_mask=verify_attn_hook.state_of(
                        verify_attention_backend(mr.attn_backend)) is None,
                    device=self.device, req_to_token=mr.req_to_token_pool.req_to_token,
                    assign_locs=assign_extend_cache_locs_func, kv_commit=self._kv_commit,
                    tree_max_bs=max(self.server_args.cuda_graph_config.decode.bs or [1]))
            except Exception as e:  # noqa: BLE001
                logger.warning("%s: warming the per-round kernels failed (%s: %s); their first uses "
                               "will compile them while serving", self.algo_name, type(e).__name__, e)
                info = None
            if info is not None and self.ps.tp_rank == 0:
                logger.info("%s: per-round kernels warmed for verify widths %s, batch sizes %s (tree "
                            "widths %s) in %.2f s", self.algo_name, info["widths"], info["batch_sizes"],
                            info["tree_batch_sizes"], info["s"])

    def _start_regime(self) -> None:
        """The regime new batches are made in (``regime_state``): served when the plain decode state
        exists (the adaptive set's no-speculation width), as the ``regime`` switch says: ``auto``
        (the default: rank 0's ``RegimeController``, ``FollowerRegime`` on the other TP ranks; a
        server without the plain state, a fixed budget, only speculates), ``spec`` (never switches),
        ``plain`` (forced) or ``cycle<k>`` (``CycleRegime``).  ValueError when ``plain`` or
        ``cycle<k>`` is asked of a server without the plain state."""
        value = switches.CURRENT.regime
        cycle = switches.regime_cycle(value)
        start = regime_state.SPEC if cycle is not None or value == "auto" else value
        plain_ok = self._verify_states is not None and NO_SPEC in self._verify_states.states
        if value not in (regime_state.SPEC, "auto") and not plain_ok:
            raise ValueError(f"{self.algo_name}: regime={value} needs the plain decode state (the "
                             "adaptive budget with its no-speculation width and CUDA graphs)")
        self._launches = LaunchTracker()
        if not plain_ok:
            regime_state.disable()
            return
        if cycle is not None:                  # the test bed's transitions (switch regime=cycle<k>)
            self._policy.start_regime(CycleRegime(cycle, start=start))
        elif value == "auto":                  # measured windows (policy/regime.py), rank 0 decides
            self._regime_shared = get_tp_group().world_size > 1
            self._policy.start_regime(
                FollowerRegime(start) if self.ps.tp_rank != 0 else
                RegimeController(start=start, spec_max_bs=SPEC_GRAPH_MAX_BS,
                                 optimistic=self._policy.optimistic_spec_ratio))
        regime_state.enable(start, on_switch=self._on_regime_switch
                            if self._policy.regime_controller is not None else None)
        if self.ps.tp_rank == 0:
            logger.info("%s regime: starts %s (plain batches on SGLang's decode path)%s", self.algo_name,
                        start, "" if cycle is None else f", switching every {cycle} decode launches")

    def _on_regime_switch(self) -> None:
        """The transition hook made a switch (``regime_state.switched``): the controller learns it;
        the first few and then every thousandth are logged with the controller's report."""
        self._policy.regime_switched()
        n = regime_state.STATE.switches
        if self.ps.tp_rank == 0 and (n <= 3 or n in (10, 100) or n % 1000 == 0):
            logger.info("%s regime switch %d: now %s; %s", self.algo_name, n, regime_state.STATE.regime,
                        self._policy.regime_controller.report())

    def _regime_launch(self, batch, no_spec: bool, rebuilt: bool = False) -> None:
        """A decode batch of either regime is being launched: the regime controller sees it (host
        values: ``LaunchTracker``) and a switch it decides is handed to the scheduler's transition
        hook (``regime_state.request``), made before a later batch.  ``rebuilt``: the drafter's
        rebuild was launched with it.  Nothing without a controller."""
        if not regime_state.STATE.enabled:
            return
        ctl = self._policy.regime_controller
        if ctl is None:
            return
        self._regime_launches += 1
        pending = self._policy.regime(self._launches.view(batch.reqs, no_spec=no_spec)).pending
        if rebuilt:                            # its time lies in the intervals ahead
            self._policy.regime_rebuilt()
        if self._rebuild is not None:          # the rebuild's time is the switch's, not speculation's
            spent = self._rebuild.take_seconds()
            if spent:
                self._policy.regime_charge(spent)
        now = time.monotonic()
        if self.ps.tp_rank == 0 and now - self._regime_logged >= REGIME_LOG_EVERY_S:
            if self._regime_logged:            # not at the first launch: nothing measured yet
                logger.info("%s regime: %s", self.algo_name, ctl.report())
            self._regime_logged = now
        if self._regime_shared:
            # TP with a clock-driven controller: every REGIME_SYNC_EVERY launches (the same launch on
            # every rank) all ranks take rank 0's decision, so they switch at the same iteration
            if self._regime_launches % REGIME_SYNC_EVERY:
                return
            pending = self._tp_shared(pending if self.ps.tp_rank == 0 else None)
            if isinstance(ctl, FollowerRegime):
                ctl.follow(pending)
        if pending is not None and regime_state.STATE.pending is None:
            regime_state.request(pending)

    def _init_adaptive(self, cfg: "adaptive_config.AdaptiveConfig") -> None:
        mr = self._target_worker.model_runner
        algo = self.algo_name
        use_graphs = mr.decode_cuda_graph_runner is not None
        if cfg.cycle is None and not use_graphs and cfg.implicit:
            if self.ps.tp_rank == 0:
                logger.warning("%s: the target runs without CUDA graphs, so the adaptive budget has no "
                               "cost table (it times graph replays): the fixed budget %d runs every "
                               "round", algo, self.budget)
            self._adaptive_cfg = None
            adaptive_config.register_served(algo, self.budget, None)
            return
        if cfg.cycle is None and not use_graphs:
            raise ValueError(f"{algo}: {adaptive_config.ENV_BUDGETS} needs the "
                             "target's CUDA graphs (the round cost table is measured from their "
                             "replays); drop --disable-cuda-graph")
        free_gb = self._free_gb_reader()

        def prepare(backend):
            check_tree_verify_backend(backend, algo)
            disable_causal_verify_shortcut(backend, algo)
            enable_tree_verify_attention(backend, mr, algo)

        states = verify_states.TargetStates(mr, cfg.widest)
        biggest_gb = 0.0
        for w in cfg.extra_widths:
            if w != NO_SPEC and cfg.implicit and free_gb is not None:
                # the default set fits the memory left after SGLang sized its KV pool: a width is
                # built only with room for twice the largest state so far (at least MIN_FREE_GB);
                # every TP rank decides on the smallest free memory of all of them
                free = self._tp_min(free_gb())
                need = max(adaptive_config.MIN_FREE_GB, 2.0 * biggest_gb)
                if free < need:
                    left = [x for x in cfg.extra_widths if x >= w]
                    if self.ps.tp_rank == 0:
                        logger.warning("%s adaptive budget: %.2f GB free (< %.2f): verify widths %s not "
                                       "built; the set is %s", algo, free, need, left,
                                       [x for x in cfg.widths if x not in left])
                    cfg = dataclasses.replace(cfg, budgets=tuple(
                        b for b in cfg.budgets if b + 1 not in left))
                    self._adaptive_cfg = cfg
                    adaptive_config.register_served(algo, self.budget, cfg)
                    break
            if w == NO_SPEC:
                # no speculation: SGLang's own decode step (DECODE graphs, the user's backend); the
                # drafter's K/V for its tokens is written later, batched (plain_decode.DraftCatchUp)
                st = plain_decode.build_plain_decode_state(
                    mr, use_graphs=use_graphs, free_gb=free_gb, algo=algo,
                    backend_name=plain_decode.user_decode_backend(mr.server_args))
                max_reqs = max(1, min(1024, int(mr.req_to_token_pool.size)))
                self._catch_up = plain_decode.DraftCatchUp(self._append_target_hidden_to_draft_kv_by_loc,
                                                           capacity=8 * max_reqs)
                what = f"plain decode state ({st.backend_name or 'server decode backend'})"
            else:
                st = verify_states.build_verify_state(mr, w, use_graphs=use_graphs, prepare_backend=prepare,
                                                 free_gb=free_gb)
                what = f"verify state for width {w} (budget {w - 1})"
            states.add(st)
            biggest_gb = max(biggest_gb, st.mem_gb)
            if self.ps.tp_rank == 0:
                logger.info("%s adaptive budget: %s built: %.2f s, %.3f GB (cuda graphs %s)", algo, what,
                            st.build_s, st.mem_gb, "on" if use_graphs else "off")
        policy = None
        if cfg.cycle is None:
            tic = time.perf_counter()
            table = self._tp_shared(self._measure_cost_table(states, cfg))
            policy = BudgetPolicy(table, allow_no_spec=cfg.no_spec, age_edges=cfg.age_edges,
                                  draft_queries=int(getattr(self, "block_size", BudgetPolicy.draft_queries)))
            if self.ps.tp_rank == 0:
                logger.info("%s adaptive budget: cost table (ms, timed in %.1f s) verify=%s base=%s", algo,
                            time.perf_counter() - tic, table.verify_ms, table.base_ms)
        self._verify_states = states
        # SGLang's overlap scheduler launches batch i + 1 before it processes batch i's result: the
        # host interval between two launches measures the batch before (adaptive.WidthController)
        overlap = not getattr(vars(self).get("target_server_args"), "disable_overlap_schedule", False)
        self._policy.start(adaptive.WidthController(cfg, policy=policy, device=self.device,
                                                    share=self._tp_shared, lag=1 if overlap else 0))

    def _free_gb_reader(self):
        """A callable giving this GPU's free memory in GB (None off CUDA)."""
        if torch.device(self.device).type != "cuda":
            return None
        from sglang.srt.utils import get_available_gpu_memory

        return lambda: get_available_gpu_memory(self.device, self.gpu_id)

    @staticmethod
    def _tp_min(x: float) -> float:
        """The smallest ``x`` over the TP ranks (start-up; every rank calls it at the same point)."""
        tp = get_tp_group()
        if tp.world_size <= 1:
            return float(x)
        import torch.distributed as dist

        vals = [None] * tp.world_size
        dist.all_gather_object(vals, float(x), group=tp.cpu_group)
        return min(vals)

    @staticmethod
    def _tp_shared(obj):
        """TP rank 0's ``obj`` on every rank (start-up): each rank times its own replays (all ranks
        replay the same graphs in the same order, so their collectives pair up), but every rank must
        choose the same widths, so they all take rank 0's cost table."""
        tp = get_tp_group()
        if tp.world_size <= 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(tp.cpu_group, 0), group=tp.cpu_group)
        return box[0]

    def _measure_cost_table(self, states: "verify_states.TargetStates", cfg):
        """Cost table option (a): replays of every captured (width, bs) target graph, plus the
        drafter block's graph at bs for widths >= 2 (start-up only, synchronising)."""
        draft_ms = {}
        draft_runner = getattr(self.draft_model_runner, "decode_cuda_graph_runner", None)
        for bs in (getattr(draft_runner, "capture_bs", None) or []):
            ms = verify_states.graph_replay_ms(draft_runner, bs)
            if ms is not None:
                draft_ms[int(bs)] = ms
        runners = {w: st.graph_runner for w, st in states.states.items()}
        vocab = int(getattr(getattr(self._target_worker.model_runner, "model_config", None), "vocab_size", 0) or 0)
        for r in runners.values():   # distinct ids, as real verify tokens are (MoE routing)
            if not verify_states.randomize_graph_input_ids(r, vocab) and self.ps.tp_rank == 0:
                logger.warning("%s adaptive budget: the verify graph runner has no input-id buffer to "
                               "randomize; its cost table uses the ids left by capture", self.algo_name)

        def verify_ms(w, bs):
            ms = verify_states.graph_replay_ms(runners[w], bs)
            if ms is None:
                raise RuntimeError(f"{self.algo_name}: no plain CUDA graph of the width-{w} verify "
                                   f"at bs={bs} to time (a non-default --cuda-graph backend?)")
            return ms

        return verify_states.cost_table_from_timer(
            {w: list(r.capture_bs) for w, r in runners.items()}, verify_ms,
            draft_ms=draft_ms or None, no_spec=cfg.no_spec)

    # ------------------------------------------------------------------ the drafter's head
    def _make_head(self, max_bs: int) -> DDTreeDraftHead:
        lm_head = check_target_lm_head(self._target_worker.model_runner.model, self.algo_name)
        tp_group = get_tp_group()
        if hasattr(lm_head, "shard_indices"):
            shard = lm_head.shard_indices
            if int(shard.num_added_elements) != 0 and tp_group.world_size > 1:
                raise RuntimeError(f"{self.algo_name}: an lm_head with added vocabulary under "
                                   "tensor parallelism is not supported")
            num_org, start = int(shard.num_org_elements), int(shard.org_vocab_start_index)
        else:
            if tp_group.world_size != 1:
                raise RuntimeError(f"{self.algo_name}: lm_head without shard metadata under TP")
            num_org, start = int(lm_head.weight.shape[0]), 0
        return DDTreeDraftHead(weight=lm_head.weight, block_size=self.block_size, topk=self.topk,
                               num_org=num_org, org_vocab_start=start, max_bs=max_bs,
                               tp_group=tp_group if tp_group.world_size > 1 else None,
                               exact_topk=self.tree_backend == "triton")

    def _maybe_build_draft_sampler(self):
        """Called by DFlashWorkerV2.init_cuda_graphs before the draft graph capture: the returned
        callable is folded into the graph (capture_tail_hooks)."""
        return self._make_head(max(self.server_args.cuda_graph_config.decode.bs))

    def _eager_topk(self, draft_hidden: torch.Tensor, bs: int) -> DDTreeDraftHead:
        if self._eager_head is None:
            self._eager_head = self._make_head(max(bs, 8))
        self._eager_head.ensure_capacity(bs)
        self._eager_head(draft_hidden)
        return self._eager_head

    # ------------------------------------------------------------------ the decode round
    def forward_batch_generation(self, batch, on_publish=None) -> GenerationBatchResult:
        algo = getattr(batch, "spec_algorithm", None)
        if algo is not None and algo.is_none():
            return self._forward_plain_batch(batch)
        is_extend = batch.forward_mode.is_extend() or batch.is_extend_in_batch
        is_idle = batch.forward_mode.is_idle()
        if is_extend or is_idle:
            self._policy.interrupt()           # the next round's interval spans this batch
        if self._catch_up is not None and self._catch_up.rows and (is_extend or is_idle):
            self._catch_up.flush()             # before a prefill may write slots freed since the stash
        if is_extend:
            if getattr(batch, "return_logprob", False):
                # DFLASH refuses the flag up front although its prefill is the target's own extend
                # (admitted unless SGLANG_DDTREE_LOGPROBS=0: patches/validate_dflash_request.py)
                with logprobs.prefill_with_logprobs(self, batch):
                    return self._prefill(batch, on_publish)
            return self._prefill(batch, on_publish)
        if is_idle:
            return super().forward_batch_generation(batch, on_publish=on_publish)
        rebuilt = self._maybe_rebuild_drafter(batch)
        self._regime_launch(batch, no_spec=self._last_width == NO_SPEC, rebuilt=rebuilt)
        if _SYNC_CHECK_FILE:
            return self._sync_checked_round(batch, on_publish)
        return self._forward_tree_round(batch, on_publish)

    def _forward_plain_batch(self, batch) -> GenerationBatchResult:
        """A batch made in the plain regime (``regime_state``: its ``spec_algorithm`` is NONE, so the
        scheduler prepared it and will process its result as plain decoding does): the target's own
        forward and sampling, as a server without speculation runs it.  Prefill: the target's
        extend without hidden capture and no drafter write (the drafter's context for these tokens
        is not kept: stale drafter context only lowers a later tree's acceptance, never its
        output).  Decode: one token a request on the plain decode state (SGLang's DECODE graphs on
        the user's decode backend), its input the previous step's sampled token, which the
        scheduler's resolve left in ``batch.input_ids`` (``patches/regime_forward_inputs.py``).
        A prefill asks for the hidden capture SGLang's prefill CUDA graph was captured with
        (:meth:`_plain_prefill_capture`), so that it replays that graph as base's prefill does.
        Returns SGLang's plain result (``next_token_ids`` [bs], no draft input)."""
        self._policy.interrupt()               # a later tree round's interval does not span this batch
        if self._catch_up is not None and self._catch_up.rows:
            self._catch_up.flush()             # rows stashed by a spec-regime plain round, written now
        mode = batch.forward_mode
        if self._drafter_rebuild() is not None and not mode.is_idle():
            self._rebuild.plain_write(batch.out_cache_loc)   # target K/V only: drafter context stale
        if mode.is_decode():
            self._regime_launch(batch, no_spec=True)
            if self._verify_states is None or NO_SPEC not in self._verify_states.states:
                raise RuntimeError(f"{self.algo_name}: a plain-regime decode batch, but this server "
                                   "built no plain decode state (the regime needs the adaptive set's "
                                   "no-speculation width)")
            if batch.input_ids is None:
                raise RuntimeError(f"{self.algo_name}: a plain-regime decode batch without input ids "
                                   "(patches/regime_forward_inputs.py not installed?)")
            with self._verify_states.installed(NO_SPEC):
                out = self.target_worker.forward_batch_generation(batch)
        else:
            capture = self._plain_prefill_capture() if mode.is_extend() else None
            out = self.target_worker.forward_batch_generation(
                batch, **({} if capture is None else {"capture_hidden_mode": capture}))
        if out.logits_output is not None and not getattr(batch, "return_hidden_states", False):
            out.logits_output.hidden_states = None   # the plain state's graphs output them; unused
        return out

    def _plain_prefill_capture(self) -> "Optional[CaptureHiddenMode]":
        """The hidden capture a plain-regime prefill asks for: the one SGLang's prefill CUDA graph was
        captured with when it captured one with hidden output, else None (no capture).  SGLang 0.5.16
        captures a DFLASH-family server's prefill graph with FULL capture (its prefill feeds the
        drafter; ``PrefillCudaGraphRunner.__init__``) and replays it only for a batch asking exactly that
        mode (``can_run_graph``): a plain prefill asking none ran eager, its TTFT 8 % above base's at
        c = 16 (s38, `serving_h100_qwen3-8bchain_random_s38.md`).  The hidden rows it then returns are
        dropped (:meth:`_forward_plain_batch`), as the plain decode state's are."""
        runner = self._target_worker.model_runner.prefill_cuda_graph_runner
        mode = getattr(runner, "capture_hidden_mode", None)     # None: no graph, or SGLang's EagerRunner
        return None if mode is None or mode == CaptureHiddenMode.NULL else mode

    def _prefill(self, batch, on_publish) -> GenerationBatchResult:
        """The prefill (extend) batch: the target's extend with its hidden states captured, then the
        prompt's drafter K/V, as ``DFlashWorkerV2.forward_batch_generation``'s extend branch does in
        SGLang 0.5.16 (checked against that version only), with one difference: its
        ``torch.tensor(batch.extend_lens, device=cuda)`` copies from pageable memory, which
        synchronises the stream, so the host waited for the in-flight decode round and this prefill
        to finish before it could prepare the next batch (an admission stall of every new request;
        plain decoding's prefill launch overlaps the running round).  Here the two length vectors
        go through pinned memory with a non-blocking copy on the same stream: same values, same
        order on the GPU.  DFLASH's sampling-fallback warning is not DDTree's case and is not
        repeated."""
        batch_output = self.target_worker.forward_batch_generation(
            batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        logits_output, next_token_ids = batch_output.logits_output, batch_output.next_token_ids
        batch_output.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(batch_output.new_seq_lens)
        if logits_output.hidden_states is None:
            raise RuntimeError(f"{self.algo_name} requires the target's aux hidden states at prefill, "
                               "got None (the target model has no DFlash layers-to-capture configured)")
        if batch.extend_lens is None or batch.prefix_lens is None:
            raise RuntimeError(f"{self.algo_name}: extend_lens / prefix_lens missing in extend mode")
        if batch.out_cache_loc is None:
            raise RuntimeError(f"{self.algo_name}: prefill without out_cache_loc")
        if self._drafter_rebuild() is not None:
            self._rebuild.spec_prefill(batch.prefix_lens)   # a prefix cached while plain is stale
        device = next_token_ids.device
        ctx_lens = host_to_device(batch.extend_lens, device)
        draft_seq_lens = host_to_device(batch.prefix_lens, device)
        positions, _ = compute_position(self.model_runner.server_args.attention_backend,
                                        draft_seq_lens, ctx_lens, int(sum(batch.extend_lens)))
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=logits_output.hidden_states, cache_loc=batch.out_cache_loc, positions=positions)
        logits_output.hidden_states = None   # no large hidden-state copy to the host under overlap
        batch_output.next_draft_input = self._make_next_draft_input_prefill(
            bonus_tokens=next_token_ids, seq_lens=batch.seq_lens)
        return batch_output

    # ------------------------------------------------------------------ the drafter's context after plain
    def _drafter_rebuild(self) -> "Optional[drafter_rebuild.DrafterRebuild]":
        """The drafter-context map and rebuild (``drafter_rebuild.py``), made at the first use while the
        regime is served and may switch (a regime controller: ``cycle<k>``, ``auto``); a server that
        never switches (the default ``spec``, forced ``plain``) keeps none and pays nothing."""
        if (self._rebuild is None and regime_state.STATE.enabled
                and getattr(self._policy, "regime_controller", None) is not None):
            mr = self._target_worker.model_runner
            sa = self.target_server_args   # one extend, no larger than a prefill (chunk)
            sizes = [int(x) for x in (getattr(sa, "max_prefill_tokens", None),
                                      getattr(sa, "chunked_prefill_size", None)) if x and int(x) > 0]
            max_tokens = min(sizes) if sizes else 16384
            self._rebuild = drafter_rebuild.DrafterRebuild(
                int(mr.token_to_kv_pool_allocator.size) + 1, mr.device, max_tokens=max_tokens,
                algo=self.algo_name)
        return self._rebuild

    def _append_target_hidden_to_draft_kv_by_loc(self, **kw) -> None:
        """DFLASH's drafter context write (every site: prefill, commit, catch-up flush), then the slots
        it wrote marked valid in the drafter-context map (when the regime is served)."""
        super()._append_target_hidden_to_draft_kv_by_loc(**kw)
        if self._drafter_rebuild() is not None:
            self._rebuild.drafted(kw["cache_loc"], cache_loc_2d=kw.get("cache_loc_2d"),
                                  commit_lens=kw.get("commit_lens"))

    def _maybe_rebuild_drafter(self, batch) -> bool:
        """At a speculative decode launch after a switch (or a cached prefix after plain): the stale
        drafter context of the batch's requests rebuilt (``DrafterRebuild.run``: one host read, one
        target extend on scratch KV slots, on the target's default state).  -> whether it ran."""
        rb = self._drafter_rebuild()
        if rb is None or not rb.due(regime_state.STATE.switches):
            return False
        if self._catch_up is not None and self._catch_up.rows:
            self._catch_up.flush()             # pending rows first: their slots may have new owners
        mr = self._target_worker.model_runner
        rb.run(batch.reqs, req_to_token=mr.req_to_token_pool.req_to_token,
               allocator=mr.token_to_kv_pool_allocator,
               build_forward_batch=lambda plan, scratch: drafter_rebuild.extend_forward_batch(
                   plan, scratch, model_runner=mr, spec_algorithm=batch.spec_algorithm, device=mr.device),
               target_forward=lambda fb: self._target_worker.forward_batch_generation(
                   batch=None, forward_batch=fb, is_verify=True),
               append=lambda **kw: DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc(self, **kw))
        return True

    def _sync_checked_round(self, batch, on_publish):
        """SGLANG_DDTREE_SYNC_CHECK_FILE=path: run the round under torch's CUDA sync debug mode
        ("warn") and append {algo, bs, syncs, sites} per round: every device->host synchronisation
        inside the round (the worker's and SGLang's code it calls) is counted with its call site."""
        import json
        import warnings

        bs = len(batch.seq_lens)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                res = self._forward_tree_round(batch, on_publish)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sites = [f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
                 if "synchroniz" in str(w.message)]
        with open(_SYNC_CHECK_FILE, "a") as f:
            f.write(json.dumps({"algo": self.algo_name, "bs": bs, "syncs": len(sites),
                                "sites": sorted(set(sites))[:8]}) + "\n")
        return res

    def _host_prefix_bound(self, batch, draft_input, bs: int):
        """(upper bound of the committed prefix [bs] int32 CPU, its sum), without waiting for the GPU:
        the requests' committed lengths on the host (``req.kv_committed_len``, one round behind under
        overlap scheduling, when this round's predecessor has not been processed yet) + B, the most
        one round commits; no larger than the scheduler's reservation when it has one.  The
        scheduler's host mirror (``batch.seq_lens_cpu``), when given, + B as before.  Fallbacks: the
        reservation alone, then a device read (not reached by the spec-v2 scheduler)."""
        buf = self._draft_seq_lens_cpu_buf[:bs]
        reqs = getattr(batch, "reqs", None)
        reserved = draft_input.reserved_seq_lens_cpu
        if batch.seq_lens_cpu is not None:
            buf.copy_(batch.seq_lens_cpu)
            buf.add_(self.block_size)
        elif reqs is not None and len(reqs) == bs and all(hasattr(r, "kv_committed_len") for r in reqs):
            buf.copy_(torch.tensor([int(r.kv_committed_len) for r in reqs], dtype=torch.int32))
            buf.add_(self.block_size)
            if reserved is not None and reserved.shape[0] == bs:
                torch.minimum(buf, reserved.to(torch.int32), out=buf)
        elif reserved is not None:
            buf.copy_(reserved)
        else:
            buf.copy_(batch.seq_lens.to("cpu", dtype=torch.int32))
        return buf, int(buf.sum())

    def _mask_out_buffer(self, bs: int, need: int):
        """(buffer, eager): where the verify mask is written, and whether this round's verify must
        run eagerly.  When the target's CUDA graph will replay, the mask goes straight into the
        backend's graph mask buffer (the backend's own copy of spec_info.custom_mask into it is then
        a same-address no-op).  When the graph would replay but the mask's host upper bound does not
        fit that buffer (every request near the context length at a large batch), the round's
        verify runs eagerly from a private buffer: a replay would have to copy a mask larger than
        the captured buffer.  Otherwise (no graph for this batch) a private buffer."""
        runner = self._target_worker.model_runner.decode_cuda_graph_runner
        graph_buf = _find_graph_mask_buffer(self._target_worker.model_runner.attn_backend)
        plan = plan_verify_mask_buffer(
            bs=bs, need=need,
            graph_max_bs=None if runner is None else int(getattr(runner, "max_bs", 0)),
            graph_buf_numel=None if graph_buf is None else _graph_mask_capacity(graph_buf))
        if plan == "graph":
            # (need is a host upper bound of the mask size, so the kernel never writes past it)
            return graph_buf[:need], False
        if self._own_mask_buf is None or self._own_mask_buf.numel() < need:
            cap = max(need, 2 * (0 if self._own_mask_buf is None else self._own_mask_buf.numel()))
            self._own_mask_buf = torch.empty((cap,), dtype=torch.bool, device=self.device)
        if plan == "eager":
            self._eager_mask_rounds += 1
            if self._eager_mask_rounds in (1, 100, 1000) and self.ps.tp_rank == 0:
                logger.info("%s: verify mask bound %d exceeds the CUDA-graph mask buffer at bs=%d: "
                            "verify runs eagerly (round %d of this kind)", self.algo_name, need, bs,
                            self._eager_mask_rounds)
        return self._own_mask_buf[:need], plan == "eager"

    def _forward_tree_round(self, batch, on_publish) -> GenerationBatchResult:
        if batch.spec_info is None:
            batch.spec_info = DFlashDraftInputV2.create_idle_input(device=self.device)
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError(f"{self.algo_name} expected DFlashDraftInputV2 on the running batch")
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())

        bs = len(batch.seq_lens)
        D = self.block_size - 1
        # the committed prefix on the host (one round behind at most): its sum prices the context
        self._ensure_draft_block_buffers(bs)
        host_bound, host_bound_sum = self._host_prefix_bound(batch, draft_input, bs)
        # the policy's plan: verify width N (the server's, or the adaptive choice; host values only),
        # a draft-only probe or not, what the tree must estimate
        plan = self._policy.plan(BatchView(bs=bs, reqs=batch.reqs, kv_tokens=host_bound_sum))
        N = self._last_width = plan.width
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        prefix = batch.seq_lens

        prof = self._prof
        prof.begin()
        # 1) draft block [bonus, mask x D] at prefix + 0..D (N = 1: no drafter forward, the slots
        # and positions still address the commit) -------------------------------------------------
        block_ids = self._draft_block_ids_buf[:bs]
        block_pos = self._draft_block_positions_buf[:bs]
        block_loc = self._draft_verify_out_cache_loc_buf[:bs]
        _prepare_dflash_draft_block_unchecked(
            bonus_tokens=draft_input.bonus_tokens.view(-1), prefix_lens=prefix.view(-1),
            req_pool_indices=batch.req_pool_indices.view(-1), req_to_token=req_to_token,
            block_ids_out=block_ids, positions_out=block_pos, cache_loc_out=block_loc,
            mask_token_id=int(self._mask_token_id))
        # a tree round, or a no-speculation round that predicts (a draft-only probe: the drafter
        # block and the widest tree for the policy's estimate, no verify)
        catch_key = None
        if self._catch_up is not None:
            if self._catch_up.rows or N == 1:
                catch_key = plain_decode.batch_key(batch.reqs)
            if self._catch_up.must_flush(catch_key, speculative=plan.drafts, incoming=bs if N == 1 else 0):
                self._catch_up.flush()         # the drafter's K/V owed for no-speculation rounds
        draft_out = None
        if plan.drafts:
            lp, ids, draft_out = self._draft_block(batch, block_ids, block_pos, block_loc, prefix,
                                                   host_bound, host_bound_sum, bs)
        prof.mark()

        # 2) tree: the first N - 1 best-first nodes (prefix-closed: a narrower tree is the wider one's
        # first slots), or the root alone -----------------------------------------------------------
        roots = draft_input.bonus_tokens.view(-1)
        if N > 1:
            tree = ddtree.build_tree(lp, ids, N - 1, root_tokens=roots, backend=self.tree_backend,
                                     validate=False)
        else:
            tree = ddtree.root_only_tree(roots, D)
        estimate = None
        if plan.estimates:
            # the tree's own expected acceptance, for the policy (a prediction reads the widest tree of
            # the same draft; the round's tree is its first N - 1 nodes) and the opt-in statistics
            estimate = plan.estimate(tree, lp, ids, lambda width: ddtree.build_tree(
                lp, ids, width - 1, root_tokens=roots, backend=self.tree_backend, validate=False))
        prof.mark()

        # 3) verify inputs, 4) target verify, on the width's target state (no speculation: SGLang's
        # plain decode step) -------------------------------------------------------------------------
        plain = N == NO_SPEC   # width 1 exists only with the plain state (_init_adaptive)
        with (contextlib.nullcontext() if self._verify_states is None else self._verify_states.installed(N)):
            if plain:
                target_out = self._plain_decode(batch, draft_input, block_loc, prefix, host_bound,
                                                host_bound_sum)
            else:
                target_out = self._verify(batch, tree, prefix, host_bound, host_bound_sum, bs, N)
        logits_output = target_out.logits_output
        prof.mark()
        return self._accept_commit(batch, on_publish, tree, logits_output, target_out, draft_out,
                                   draft_input, block_loc, block_pos, prefix, bs, N,
                                   defer_key=catch_key if plain else None, estimate=estimate)

    def _plain_decode(self, batch, draft_input, block_loc, prefix, host_bound, host_bound_sum):
        """A no-speculation round's target forward: SGLang's DECODE step of the root (the previous
        round's bonus) at position prefix, into the slot the block reserved there, on the installed
        plain-decode state (its decode CUDA graph when the batch fits one)."""
        fb = plain_decode.plain_decode_forward_batch(
            batch, self._target_worker.model_runner, input_ids=draft_input.bonus_tokens.view(-1),
            prefix=prefix, out_cache_loc=block_loc[:, 0].to(torch.int64).contiguous(),
            host_prefix_bound=host_bound, host_prefix_bound_sum=host_bound_sum)
        self._prof.mark()
        return self._target_worker.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True)

    def _draft_block(self, batch, block_ids, block_pos, block_loc, prefix, host_bound,
                     host_bound_sum, bs):
        """The drafter block forward [bs, B] + its top-k head -> (lp [bs, D, K], ids [bs, D, K],
        the drafter's forward output)."""
        D, K = self.block_size - 1, self.topk
        target_model = self._target_worker.model_runner.model
        embeds = target_model.get_input_embeddings()(block_ids)
        if self._draft_fast_plan:
            # its graphs plan from the host lengths (patches/flashinfer_draft_fast_plan.py): each
            # must bound the request's KV length, prefix + B, and host_bound bounds the prefix only
            host_bound = host_bound + self.block_size
            host_bound_sum = host_bound_sum + bs * self.block_size
        draft_fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix,
            out_cache_loc=block_loc.reshape(-1), seq_lens_sum=host_bound_sum,
            seq_lens_cpu=host_bound, positions=block_pos.reshape(-1),
            input_embeds=embeds.view(-1, embeds.shape[-1]), spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info, capture_hidden_mode=CaptureHiddenMode.NULL)
        with torch.inference_mode():
            draft_out = self.draft_model_runner.forward(draft_fb)
        if self._draft_sampler is not None and draft_out.can_run_graph:
            head = self._draft_sampler
        else:
            hidden = draft_out.logits_output.hidden_states
            if hidden is None:
                raise RuntimeError(f"{self.algo_name}: the drafter returned no hidden states")
            head = self._eager_topk(hidden, bs)
        lp = head.lp[: bs * D].view(bs, D, K)
        ids = head.ids[: bs * D].view(bs, D, K)
        return lp, ids, draft_out

    def _verify(self, batch, tree, prefix, host_bound, host_bound_sum, bs, N):
        """Verify inputs (KV slots prefix + 0..N-1, the tree mask) and the target's TARGET_VERIFY
        forward over bs * N tokens on whatever target state is installed."""
        dev = self.device
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        prof = self._prof
        verify_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token,
            start_offset=prefix, end_offset=prefix + N, batch_size=bs, draft_token_num=N,
            device=dev)
        attn_state = verify_attn_hook.state_of(
            verify_attention_backend(self._target_worker.model_runner.attn_backend))
        if attn_state is not None:
            # our verify attention (SGLANG_DDTREE_VERIFY_ATTN auto / ddtree): the hooked verify reads
            # the bitmask; no FULL_MASK
            attn_state.write_mask(tree.mask_words)
            mask, eager_verify = None, False
        else:
            need = N * N * bs + N * host_bound_sum
            mask_buf, eager_verify = self._mask_out_buffer(bs, need)
            mask = ddtree.verify_mask(tree, prefix, out=mask_buf, backend=self.tree_backend,
                                      validate=False)
        verify_input = DFlashVerifyInput(
            draft_token=tree_ops.verify_input_ids(tree.tokens).reshape(-1),
            positions=tree.positions(prefix).reshape(-1), draft_token_num=N, custom_mask=mask,
            capture_hidden_mode=CaptureHiddenMode.FULL)
        batch.out_cache_loc = verify_loc
        seq_lens_cpu_backup, seq_lens_sum_backup = batch.seq_lens_cpu, batch.seq_lens_sum
        batch.seq_lens_cpu, batch.seq_lens_sum = host_bound.clone(), host_bound_sum
        with _eager_verify(self._target_worker.model_runner, eager_verify):
            verify_fb, _ = verify_input.prepare_for_verify(batch, self._target_worker)
            batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu_backup, seq_lens_sum_backup
            prof.mark()

            # 4) target verify ---------------------------------------------------------------------
            target_out = self._target_worker.forward_batch_generation(
                batch=None, forward_batch=verify_fb, is_verify=True, skip_attn_backend_init=True)
        return target_out

    def _accept_commit(self, batch, on_publish, tree, logits_output, target_out, draft_out,
                       draft_input, block_loc, block_pos, prefix, bs, N,
                       defer_key=None, estimate=None) -> GenerationBatchResult:
        """Accept (greedy or sampled) over the N verify slots, then commit accepted K/V, drafter
        context and the bonus.  ``defer_key`` (a no-speculation round, N = 1): the drafter context of
        the round's token is stashed for a later batched write (``plain_decode.DraftCatchUp``).
        ``estimate``: the tree's own expected acceptance the round's plan asked for
        (``policy.RoundEstimate``), handed to the policy with the accepted path."""
        B, prof = self.block_size, self._prof
        sampling_info = batch.sampling_info
        if sampling_info is not None:
            apply_dflash_verify_logits_adjustments(
                next_token_logits=logits_output.next_token_logits, sampling_info=sampling_info,
                draft_token_num=N)

        # 5) accept ----------------------------------------------------------------------------------
        if sampling_info is not None and not sampling_info.is_all_greedy:
            accept_len, path, bonus = self._accept_sampled(tree, logits_output.next_token_logits,
                                                           sampling_info, draft_input, bs)
        else:
            target_top1 = torch.argmax(logits_output.next_token_logits, dim=-1).view(bs, N)
            acc = (ddtree.root_only_accept(target_top1, tree.draft_depth) if N == 1 else
                   ddtree.accept_greedy(tree, target_top1, backend=self.tree_backend, validate=False))
            accept_len, path, bonus = acc.accept_len, acc.path, acc.bonus
        # what the round measured, to the policy (its statistics and the width controller's window)
        self._policy.observe(RoundOutcome(width=N, path=path, accept_len=accept_len, tree_depth=tree.depth,
                                          prefix=prefix, reqs=getattr(batch, "reqs", None),
                                          estimate=estimate))
        prof.mark()

        # 6) commit: one launch (ddtree.commit_round): the emitted tokens (accepted path tokens, then the
        # bonus; the scheduler reads the first accept_len + 1), the lengths, the verify rows of the
        # path's hidden states; under "remap" also the accepted slots' locations moved to positions
        # prefix + 0..a (K/V stays where the verify wrote it) and, for N > 1, the drafter's context
        # K/V slots read from the remapped row (its K/V then goes to the same locations)
        remap = getattr(self, "_kv_commit", "remap") == "remap"
        com = ddtree.commit_round(
            tree, ddtree.Accept(accept_len, path, bonus), prefix, batch.req_pool_indices,
            self.model_runner.req_to_token_pool.req_to_token, remap=remap,
            out=ddtree.RoundCommit(block_loc=block_loc) if remap and N > 1 else None,
            backend=getattr(self, "_commit_backend", self.tree_backend))
        out_tokens, commit_lens, new_seq_lens = com.out_tokens, com.commit_lens, com.new_seq_lens
        if getattr(batch, "return_logprob", False):
            logprobs.fill_round_logprobs(batch, logits_output, path, out_tokens, N)
        if not remap:
            move_accept_tokens_to_target_kvcache(
                batch, tree_ops.accept_index_from_path(path, N), accept_len.to(torch.int64),
                batch.token_to_kv_pool_allocator)
        if on_publish is not None:
            on_publish(new_seq_lens)
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError(f"{self.algo_name}: the target verify returned no hidden states")
        if defer_key is not None:   # N = 1: row b is request b's root, at block slot 0
            self._catch_up.stash(hidden, block_loc[:, 0], block_pos[:, 0], defer_key)
        else:
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=hidden.index_select(0, com.hidden_rows), cache_loc=block_loc.reshape(-1),
                cache_loc_2d=block_loc, positions=block_pos.reshape(-1), commit_lens=commit_lens)
        logits_output.hidden_states = None
        self._rounds += 1
        if self._rounds in (1, 100, 1000) and self.ps.tp_rank == 0:
            logger.info("%s tree round %d: bs=%d draft cuda graph=%s target verify cuda graph=%s",
                        self.algo_name, self._rounds, bs,
                        None if draft_out is None else bool(draft_out.can_run_graph),
                        bool(target_out.can_run_cuda_graph))
        prof.mark()
        prof.end(bs, N)
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=out_tokens.reshape(-1),
            accept_lens=commit_lens, can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=B, new_seq_lens=new_seq_lens)

    def _accept_sampled(self, tree, logits, sampling_info, draft_input, bs):
        """Lossless sampled accept: the target distribution plain decoding samples from at every
        slot (``sampling.verify_target_probs``: temperature, top-k, top-p, min-p as SGLang's
        sampler applies them; one dense fp32 [bs * N, V] tensor), then ``ddtree.accept_sampled``
        draws the target's token at each visited node with one coin per depth: a draw that is a
        child's token accepts that child, any other draw is the bonus.  No sgl-kernel sampling
        kernel and no draft-probability tensor are needed."""
        probs = sampling.verify_target_probs(
            logits, temperatures=sampling_info.temperatures, top_ks=sampling_info.top_ks,
            top_ps=sampling_info.top_ps, min_ps=getattr(sampling_info, "min_ps", None),
            num_slots=tree.tokens.shape[1],
            need_top_k=bool(getattr(sampling_info, "need_top_k_sampling", True)),
            need_top_p=bool(getattr(sampling_info, "need_top_p_sampling", False)),
            need_min_p=bool(getattr(sampling_info, "need_min_p_sampling", False)),
            max_top_k=draft_input.max_top_k)
        uniforms = torch.rand((bs, tree.draft_depth + 1), dtype=torch.float32, device=self.device)
        acc = ddtree.accept_sampled(tree, probs, uniforms, backend="triton", validate=False)
        return acc.accept_len, acc.path, acc.bonus
