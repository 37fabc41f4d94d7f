"""The speculative-algorithm classes SGLang dispatches on: ``DDTREE-GPU`` and ``DDTREE-CPU``.

SGLang 0.5.16 resolves ``--speculative-algorithm NAME`` through ``SpeculativeAlgorithm.from_string``,
which returns the registered ``CustomSpecAlgo`` instance; every caller then asks it ``is_*()`` /
``supports_*()`` questions.  DDTree rides on DFlash's plumbing (drafter worker, aux-hidden capture of
the target, draft KV pool, FutureMap relay of the bonus token, request validation), so these classes
answer like DFLASH, and add what 0.5.16's ``CustomSpecAlgo`` lacks but the scheduler calls
(``carries_draft_hidden_states``, ``create_future_map``, ``need_topk``).

``handle_server_args`` replaces SGLang's ``_handle_dflash`` (which only runs for the DFLASH enum):
it resolves the tree settings (:mod:`sglang_ddtree.config`) and writes them into the server
arguments during argument resolution, in the launcher process, so bad values fail at startup
with a ValueError instead of inside a scheduler process.  The resolved settings travel on
``server_args`` (``config.SETTINGS_ATTR``; SGLang pickles server_args into every scheduler
process); each TP rank's worker calls :func:`settings_for_worker`, which resolves again from the
rank's model config and raises if the two, or the ranks, disagree.
"""
from __future__ import annotations

import json
import logging
from typing import Optional

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from .config import (SETTINGS_ATTR, SUPPORTED_TARGET_BACKENDS, DDTreeSettings, resolve_settings,
                     settings_disagreement, settings_from_record, settings_record)

logger = logging.getLogger(__name__)

GPU_NAME = "DDTREE-GPU"
CPU_NAME = "DDTREE-CPU"


def is_ddtree(algo) -> bool:
    """Whether ``algo`` is a DDTREE algorithm: a ``SpeculativeAlgorithm`` (by its ``name``) or the
    ``--speculative-algorithm`` string (any case); None or anything else: False."""
    name = getattr(algo, "name", algo)
    return isinstance(name, str) and name.upper() in (GPU_NAME, CPU_NAME)


class DDTreeSpecAlgo(CustomSpecAlgo):
    """DFlash-family algorithm with a tree verify.  ``tree_backend`` picks where top-k, tree build,
    verify mask and accept run: "triton" (GPU kernels) or "reference" (the CPU heap, the baseline)."""

    tree_backend = "triton"

    # --- DFlash plumbing ------------------------------------------------------------------
    def is_dflash(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    # --- methods 0.5.16's scheduler calls that CustomSpecAlgo does not define -------------
    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        """SGLang's FutureMap without the host mirror of the published sequence lengths, whatever the
        backends: the worker bounds every round's prefix on the host itself
        (``DDTreeWorker._host_prefix_bound``: the requests' committed lengths + B) and hands that to
        each backend that plans on the host.  With the mirror (SGLang turns it on when any backend
        keeps the default ``needs_cpu_seq_lens``: flashinfer does, triton / fa3 / trtllm do not),
        ``FutureMap.resolve_seq_lens_cpu`` blocks the scheduler until the round in flight has
        published its lengths, near the end of its GPU work, so the next round's host preparation
        ran with the GPU idle: on the H100 under ``sglang.bench_serving`` (s29) a no-speculation
        round took 9.5 ms against base's 7.5 with flashinfer, where the all-triton server (no mirror)
        was within 3 % of base in s28 (checked against SGLang 0.5.16,
        ``managers/overlap_utils.py``)."""
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, False, needs_confidence_relay)

    # --- server arguments -----------------------------------------------------------------
    def handle_server_args(self, server_args) -> None:
        settings, vocab = _resolve(server_args, self.name)
        record_settings(server_args, settings, vocab_size=vocab)
        server_args.speculative_num_draft_tokens = settings.num_verify_tokens
        server_args.speculative_num_steps = 1
        server_args.speculative_eagle_topk = 1
        if server_args.attention_backend is None and server_args.decode_attention_backend is None \
                and server_args.prefill_attention_backend is None:
            # SGLang 0.5.16 resolves its default backend as a *declaration* (fa3 on Hopper) that
            # materialize_declarations writes over the fields at the end of __post_init__; a plain
            # assignment here would be overwritten, so declare ours through the same pipeline
            # (last writer wins), like SGLang's own _hrm_text_attention_force.
            from sglang.srt.arg_groups.overrides import run_post_process_pass

            run_post_process_pass(server_args, _ddtree_target_attention_backend)
            logger.info("%s: attention backend set to %s (the tree-mask verify path)", self.name,
                        SUPPORTED_TARGET_BACKENDS[0])
        elif split_for_prefill_backend(server_args):
            logger.info("%s: --attention-backend %s serves prefill; the target verify runs on %s "
                        "(prefill=%s, decode=%s, --speculative-attention-mode decode)", self.name,
                        server_args.attention_backend, SUPPORTED_TARGET_BACKENDS[0],
                        server_args.attention_backend, SUPPORTED_TARGET_BACKENDS[0])
        check_resolved_target_backend(server_args, self.name)
        from sglang.srt.arg_groups.speculative_hook import _resolve_dflash_draft_attention_backend

        _resolve_dflash_draft_attention_backend(server_args)
        import os

        from . import env_vars

        # every SGLANG_DDTREE_* value through its parser, unknown names refused: a ValueError here
        cfg = env_vars.check(os.environ, algo=self.name, budget=settings.budget)
        if server_args.max_running_requests is None and plain_floor_graphs(server_args, cfg, self.name) is None:
            server_args.max_running_requests = 48   # SGLang's own default for speculative servers
        reserve_adaptive_state_memory(server_args, cfg, vocab, self.name)
        if server_args.enable_mixed_chunk:
            server_args.enable_mixed_chunk = False
            logger.warning("%s: mixed chunked prefill disabled", self.name)
        logger.info("%s: budget=%d (verify width %d), drafter block=%d (depth %d), top-k=%d, "
                    "tree backend=%s", self.name, settings.budget, settings.num_verify_tokens,
                    settings.block_size, settings.draft_depth, settings.topk, self.tree_backend)


class DDTreeGPUSpecAlgo(DDTreeSpecAlgo):
    tree_backend = "triton"


class DDTreeCPUSpecAlgo(DDTreeSpecAlgo):
    tree_backend = "reference"


def _ddtree_target_attention_backend(view) -> dict:
    """Post-process pass (SGLang's declaration pipeline): the target attention backend whose
    TARGET_VERIFY applies the tree mask, declared when the user chose none."""
    if view.attention_backend not in (None, SUPPORTED_TARGET_BACKENDS[0]):
        logger.info("DDTREE: attention backend %r (SGLang's default for this GPU) -> %r: the tree "
                    "verify needs a backend that applies a custom mask", view.attention_backend,
                    SUPPORTED_TARGET_BACKENDS[0])
    return {"attention_backend": SUPPORTED_TARGET_BACKENDS[0]}


# The adaptive default (no-speculation rounds among the choices) runs as many requests as plain
# decoding would: SGLang's speculative servers cap --max-running-requests at 48 when it is not given
# (DFLASH too), which at c = 64 is a quarter of the batch plain decoding runs.  Tree widths keep CUDA
# graphs up to SPEC_GRAPH_MAX_BS requests (a width-61 verify graph at bs 64 is 3,904 tokens; four
# widths and the drafter up to SGLang's H200 default of 256 would multiply start-up time and graph
# memory); the no-speculation state captures SGLang's whole decode list (PLAIN_GRAPH_BS_ATTR), and
# above SPEC_GRAPH_MAX_BS the policy runs plain decoding (budget_policy.BudgetPolicy.candidates).
SPEC_GRAPH_MAX_BS = 64
PLAIN_GRAPH_BS_ATTR = "_ddtree_plain_graph_bs"


def plain_floor_graphs(server_args, cfg, algo: str) -> Optional[list]:
    """At argument resolution, when ``--max-running-requests`` is not given and the adaptive set
    ``cfg`` (:func:`adaptive_config.parse_config` of the environment; None: a fixed budget) has
    no-speculation rounds and the server CUDA graphs (the default): trim SGLang's decode CUDA-graph
    batch sizes to those <= :data:`SPEC_GRAPH_MAX_BS` (the tree widths' and the drafter's graphs),
    keep the whole list on ``server_args`` (``PLAIN_GRAPH_BS_ATTR``, for the no-speculation state's
    graphs) and return it; else None (the caller caps the running requests at 48, as SGLang does for
    speculative servers)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    dec = server_args.cuda_graph_config.decode
    if cfg is None or not cfg.no_spec or cfg.cycle is not None or dec.backend == Backend.DISABLED \
            or not dec.bs:
        return None
    full = sorted(int(b) for b in dec.bs)
    spec = [b for b in full if b <= SPEC_GRAPH_MAX_BS] or full[:1]
    dec.bs, dec.max_bs = spec, max(spec)
    object.__setattr__(server_args, PLAIN_GRAPH_BS_ATTR, full)
    logger.info("%s: --max-running-requests as plain decoding (not given); tree widths keep CUDA graphs "
                "up to bs %d, no-speculation rounds up to bs %d (above %d every round is plain decoding)",
                algo, max(spec), max(full), max(spec))
    return full


def reserve_adaptive_state_memory(server_args, cfg, vocab: Optional[int], algo: str) -> Optional[float]:
    """The adaptive default's extra target states (``cfg.extra_widths``: the no-speculation state and
    the narrower tree widths, each with CUDA graphs) are built after SGLang sized its KV pool; when
    ``--mem-fraction-static`` was not given (``patches/mem_fraction_default.py`` recorded SGLang's
    heuristic filling it), lower that heuristic by their estimate (``verify_states.state_memory_gb``) so
    the pool leaves them room.  Returns the GB taken off, or None (a fixed budget or an explicit
    set, the user's value, no CUDA graphs, unknown GPU memory or vocabulary)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_ddtree.patches.mem_fraction_default import GIVEN_ATTR, GPU_MEM_ATTR

    from . import verify_states
    from .plain_decode import user_decode_backend

    given = getattr(server_args, GIVEN_ATTR, None)
    gpu_mb = getattr(server_args, GPU_MEM_ATTR, None)
    dec = server_args.cuda_graph_config.decode
    if cfg is None or not cfg.implicit or cfg.cycle is not None or given is not False or not gpu_mb \
            or not vocab or dec.backend == Backend.DISABLED or not dec.bs or server_args.mem_fraction_static is None:
        return None
    plain_bs = getattr(server_args, PLAIN_GRAPH_BS_ATTR, None) or dec.bs
    gb = verify_states.state_memory_gb(cfg.extra_widths, vocab=int(vocab), tree_max_bs=int(dec.max_bs),
                                  plain_max_bs=int(max(plain_bs)), plain_backend=user_decode_backend(server_args))
    old = float(server_args.mem_fraction_static)
    new = round(old - gb * 1e9 / (float(gpu_mb) * (1 << 20)), 3)
    if new <= 0.1:
        logger.warning("%s: the adaptive widths' states (~%.2f GB) do not fit SGLang's memory heuristic "
                       "(--mem-fraction-static %.3f on %.0f MB): left as it is", algo, gb, old, gpu_mb)
        return None
    server_args.mem_fraction_static = new
    logger.info("%s: --mem-fraction-static %.3f -> %.3f: SGLang's default less ~%.2f GB for the adaptive "
                "default's extra target states (verify widths %s with CUDA graphs); give "
                "--mem-fraction-static to size the KV pool yourself", algo, old, new, gb, list(cfg.extra_widths))
    return gb


# backends that may serve the target's prefill while its TARGET_VERIFY runs on triton (page size 1,
# GQA and MLA in SGLang 0.5.16; the KV pool is shared, each writes its own tokens' K/V)
PREFILL_BACKENDS = ("flashinfer", "fa3")
# set on server_args when DDTree declared the split (a private attribute, kept by pickling): the
# user's --attention-backend is then what plain decoding would run (plain_decode.user_decode_backend)
SPLIT_ATTR = "_ddtree_prefill_split"


def prefill_split_candidate(server_args) -> bool:
    """``--attention-backend`` is one of PREFILL_BACKENDS and no prefill / decode split was given."""
    return (server_args.attention_backend in PREFILL_BACKENDS and server_args.prefill_attention_backend is None
            and server_args.decode_attention_backend is None)


def split_for_prefill_backend(server_args) -> bool:
    """``--attention-backend flashinfer|fa3`` alone (no prefill / decode split given): keep it for the
    target's prefill and run the verify (the only other forward a speculative target runs) on the
    tree-mask backend, by declaring SGLang's hybrid split: prefill = the user's, decode = triton,
    ``speculative_attention_mode = decode`` (TARGET_VERIFY on the decode side).  True when declared."""
    if not prefill_split_candidate(server_args):
        return False
    user = server_args.attention_backend
    from sglang.srt.arg_groups.overrides import run_post_process_pass

    def _split(view) -> dict:
        return {"prefill_attention_backend": user, "decode_attention_backend": SUPPORTED_TARGET_BACKENDS[0]}

    _split.__qualname__ = "ddtree_prefill_backend_split"
    run_post_process_pass(server_args, _split)  # the backends are declarations (last writer wins)
    server_args.speculative_attention_mode = "decode"  # a plain field: not in SGLang's declaration set
    object.__setattr__(server_args, SPLIT_ATTR, True)  # plain decode keeps the user's backend (plain_decode.py)
    return True


def _verify_backend(cfg) -> Optional[str]:
    """The backend a TARGET_VERIFY forward runs on: the prefill (default) or decode backend of the
    speculative attention mode, falling back to --attention-backend."""
    mode = getattr(cfg, "speculative_attention_mode", "prefill")
    split = cfg.prefill_attention_backend if mode == "prefill" else cfg.decode_attention_backend
    return split or cfg.attention_backend


def _unsupported_backend_message(algo: str, backend: str, where: str) -> str:
    return (f"{algo} verifies a tree with a custom attention mask; the target attention backend "
            f"{backend!r}{where} is not one whose TARGET_VERIFY path applies it under CUDA graphs "
            f"in SGLang 0.5.16. Use --attention-backend {' or '.join(SUPPORTED_TARGET_BACKENDS)} "
            f"(or leave it unset), --attention-backend {' or '.join(PREFILL_BACKENDS)} alone (prefill on it, "
            f"the verify on {SUPPORTED_TARGET_BACKENDS[0]}), or a split whose verify side is "
            f"{SUPPORTED_TARGET_BACKENDS[0]} (--speculative-attention-mode decode with "
            f"--decode-attention-backend {SUPPORTED_TARGET_BACKENDS[0]})")


def check_resolved_target_backend(server_args, algo: str) -> None:
    """Raise ValueError unless the backend SGLang will actually run the verify on (the resolving
    configuration: the fields with every declaration so far overlaid) applies the tree mask, and
    the page size it resolves to is 1."""
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    backend = _verify_backend(view)
    if backend is not None and backend not in SUPPORTED_TARGET_BACKENDS:
        raise ValueError(_unsupported_backend_message(algo, backend, " (as SGLang resolved it)"))
    if view.page_size not in (None, 1):
        raise ValueError(f"{algo} is validated with --page-size 1 only (SGLang resolved "
                         f"page_size={view.page_size})")


def drafter_block_size(server_args) -> Optional[int]:
    """The drafter's block size: --speculative-dflash-block-size, else its config.json."""
    if server_args.speculative_dflash_block_size is not None:
        return int(server_args.speculative_dflash_block_size)
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    try:
        cfg = get_config(server_args.speculative_draft_model_path,
                         trust_remote_code=server_args.trust_remote_code,
                         revision=server_args.speculative_draft_model_revision,
                         model_override_args=json.loads(server_args.json_model_override_args or "{}"))
    except Exception as e:  # noqa: BLE001 - reported as a clear startup error below
        raise ValueError(f"cannot read the drafter config at "
                         f"{server_args.speculative_draft_model_path!r}: {e}") from e
    return parse_dflash_draft_config(draft_hf_config=cfg).resolve_block_size(default=None)


def _target_vocab_size(server_args) -> Optional[int]:
    try:
        from sglang.srt.utils.hf_transformers_utils import get_config

        cfg = get_config(server_args.model_path, trust_remote_code=server_args.trust_remote_code,
                         revision=getattr(server_args, "revision", None))
        cfg = getattr(cfg, "text_config", None) or cfg
        return int(cfg.vocab_size)
    except Exception as e:  # noqa: BLE001 - the vocab only bounds the default top-k
        logger.warning("cannot read the target vocabulary size of %r (%s): the default top-k is "
                       "not bounded by it here; each TP rank checks it against its model",
                       server_args.model_path, e)
        return None


def _resolve(server_args, algo: str):
    if server_args.speculative_draft_model_path is None:
        raise ValueError(f"{algo} needs a DFlash drafter: pass --speculative-draft-model-path")
    vocab = _target_vocab_size(server_args)
    return resolve_settings(algo=algo, num_draft_tokens=server_args.speculative_num_draft_tokens,
                            block_size=drafter_block_size(server_args), vocab_size=vocab), vocab


def resolve_from_server_args(server_args, algo: str) -> DDTreeSettings:
    return _resolve(server_args, algo)[0]


def record_settings(server_args, settings: DDTreeSettings, vocab_size: Optional[int]) -> None:
    """Store the launcher's settings on server_args (a private attribute: not a CLI field, kept by
    pickling and deepcopy, outside SGLang's strict-mutation check)."""
    object.__setattr__(server_args, SETTINGS_ATTR, settings_record(settings, vocab_size))


def settings_for_worker(server_args, *, algo: str, vocab_size: Optional[int], cpu_group=None,
                        env=None) -> DDTreeSettings:
    """The settings a scheduler (TP rank) runs with: the launcher's, checked.

    The rank resolves again from ``server_args`` and its own target vocabulary (the model config's)
    and raises ValueError when that differs from what the launcher resolved and stored
    (:func:`record_settings`).  With ``cpu_group`` (a torch.distributed group of the TP ranks, e.g.
    ``get_tp_group().cpu_group``) the ranks also exchange their outcome, so every rank raises, with
    each failing rank named, when any rank fails or two ranks differ (also across nodes, whose
    launchers resolve separately).  Every rank reaches the exchange, even one whose resolution
    failed, so no rank waits on a dead peer.
    """
    rec = getattr(server_args, SETTINGS_ATTR, None)
    local, error = None, None
    try:
        local = resolve_settings(algo=algo, num_draft_tokens=server_args.speculative_num_draft_tokens,
                                 block_size=drafter_block_size(server_args), vocab_size=vocab_size,
                                 env=env)
    except ValueError as e:
        error = str(e)
    if local is not None and rec is None:
        logger.warning("%s: server_args carries no launcher-resolved settings (it did not go "
                       "through argument handling); using this rank's own resolution", algo)
    elif local is not None:
        error = settings_disagreement(algo, rec, local, vocab_size)
    if cpu_group is not None:
        import torch.distributed as dist

        world = dist.get_world_size(group=cpu_group)
        if world > 1:
            mine = (dist.get_rank(group=cpu_group),
                    None if local is None else settings_record(local, vocab_size), error)
            everyone = [None] * world
            dist.all_gather_object(everyone, mine, group=cpu_group)
            msgs = [f"TP rank {r}: {err}" for r, _, err in everyone if err is not None]
            if not msgs:
                first = everyone[0][1]
                for r, got, _ in everyone[1:]:
                    bad = settings_disagreement(algo, first, settings_from_record(got),
                                                got["vocab_size"], where=f"TP rank {r}")
                    if bad is not None:
                        msgs.append(bad.replace("the launcher resolved", "TP rank 0 resolved"))
            if msgs:
                raise ValueError("\n".join(msgs))
    if error is not None:
        raise ValueError(error)
    return settings_from_record(rec) if rec is not None else local


def validate_server_args(server_args) -> None:
    """Reject what DDTree cannot run (called by SGLang before handle_server_args)."""
    from sglang.srt.arg_groups.overrides import resolved_view

    algo = (server_args.speculative_algorithm or GPU_NAME).upper()
    if server_args.speculative_draft_model_path is None:
        raise ValueError(f"{algo} needs a DFlash drafter: pass --speculative-draft-model-path")
    if not str(server_args.device).startswith("cuda"):
        raise ValueError(f"{algo} runs on CUDA devices only (device={server_args.device!r})")
    if server_args.pp_size != 1:
        raise ValueError(f"{algo} supports pp_size == 1 only (got {server_args.pp_size})")
    if resolved_view(server_args).enable_dp_attention:
        raise ValueError(f"{algo} does not support --enable-dp-attention")
    if server_args.speculative_draft_window_size is not None:
        raise ValueError(f"{algo} does not support --speculative-draft-window-size (the compact "
                         "draft cache)")
    if server_args.page_size not in (None, 1):
        raise ValueError(f"{algo} is validated with --page-size 1 only (got {server_args.page_size})")
    if getattr(server_args, "enable_lora", False):
        raise ValueError(f"{algo} does not support LoRA")
    chosen = _verify_backend(server_args)  # the user's own choice (the fields before resolution)
    if chosen is not None and chosen not in SUPPORTED_TARGET_BACKENDS \
            and not prefill_split_candidate(server_args):
        raise ValueError(_unsupported_backend_message(algo, chosen, ""))
