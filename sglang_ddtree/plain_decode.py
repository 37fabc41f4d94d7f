"""No-speculation rounds on SGLang's own decode path (issue 39 item 2).

A round that runs no speculation must cost what plain decoding's step costs for that batch: SGLang's
DECODE forward, its decode CUDA graph, the user's decode attention backend.  Two pieces:

* :func:`build_plain_decode_state`: a target attention backend of the user's decode backend and a
  ``DecodeCudaGraphRunner`` captured in DECODE mode, both built while the model runner looks like a
  plain (non-speculative) runner (:func:`plain_runner_view`), so they are exactly what a server
  without speculation builds.  One difference: its graphs capture the target's hidden states
  (``CaptureHiddenMode.FULL``; with the drafter's layers-to-capture set, the concatenated aux hidden
  states [bs, H_aux]), which the drafter needs later.
* :class:`DraftCatchUp`: the drafter's K/V for the tokens of no-speculation rounds is not written in
  those rounds.  Their hidden rows, KV slots and positions wait in a flat buffer and are written in
  one batched call (``DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc``) before anything else
  writes drafter K/V (a speculative round, a prefill), when the batch's requests change, or when the
  buffer is full.  The first rule keeps the order of writes: a waiting row's slot may be freed (its
  request finished) and handed to another request, whose own drafter K/V for it is written by a
  prefill or a speculative round, after the flush on the same stream, or stashed after the stale
  row.  The second keeps the pending rows those of the running batch.

Checked against SGLang 0.5.16: ``DecodeCudaGraphRunner.__init__`` chooses TARGET_VERIFY capture iff
``model_runner.spec_algorithm.is_speculative()`` and FULL hidden capture iff
``server_args.enable_return_hidden_states``
(``sglang/srt/model_executor/runner/decode_cuda_graph_runner.py`` l.259-308); backends are built by
``model_runner_components/attention_backend_setup._build_backend_from_str``.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Optional, Sequence

import torch

from .policy.budget_policy import NO_SPEC

logger = logging.getLogger(__name__)


def user_decode_backend(server_args) -> Optional[str]:
    """The attention backend plain decoding would use on this server: ``--decode-attention-backend``
    when the user split it and the split is not DDTree's own (decode = triton for the tree verify,
    ``spec_algo.split_for_prefill_backend``), else ``--attention-backend``.  None: SGLang's default."""
    from .spec_algo import SPLIT_ATTR

    if getattr(server_args, SPLIT_ATTR, False):
        return server_args.attention_backend
    return server_args.decode_attention_backend or server_args.attention_backend


@contextlib.contextmanager
def plain_runner_view(model_runner):
    """Inside: ``model_runner`` looks like a non-speculative runner (``spec_algorithm`` NONE) whose
    decode graphs capture hidden states (``enable_return_hidden_states``) at the batch sizes plain
    decoding captures (``spec_algo.PLAIN_GRAPH_BS_ATTR`` when argument resolution trimmed the
    speculative graphs' list).  Restored on exit."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from .spec_algo import PLAIN_GRAPH_BS_ATTR

    sa = model_runner.server_args
    old_algo, old_rhs = model_runner.spec_algorithm, sa.enable_return_hidden_states
    dec = getattr(getattr(sa, "cuda_graph_config", None), "decode", None)
    plain_bs = getattr(sa, PLAIN_GRAPH_BS_ATTR, None)
    old_bs = (dec.bs, dec.max_bs) if dec is not None else None
    model_runner.spec_algorithm = SpeculativeAlgorithm.NONE
    sa.override("sglang_ddtree.plain_decode_capture", enable_return_hidden_states=True)
    if plain_bs and dec is not None:
        dec.bs, dec.max_bs = list(plain_bs), max(plain_bs)
    try:
        yield
    finally:
        model_runner.spec_algorithm = old_algo
        sa.override("sglang_ddtree.plain_decode_restore", enable_return_hidden_states=old_rhs)
        if old_bs is not None:
            dec.bs, dec.max_bs = old_bs


def _build_backend(model_runner, name: Optional[str]):
    """The backend ``name`` (None: the server's) on the server's flashinfer workspace, as plain
    decoding's own backends (and SGLang's two-batch-overlap backends) share it: the states run one at
    a time on one stream, so a plan never lands between another backend's plan and its kernels.  A
    workspace of its own would cost 384-512 MB per state (512 for Qwen targets), and every tree width's
    hybrid backend would carry an unused flashinfer prefill workspace."""
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        _build_backend_from_str)

    saved = getattr(model_runner, "init_new_workspace", None)
    try:
        if name is None:
            return model_runner._get_attention_backend(init_new_workspace=False)
        return _build_backend_from_str(model_runner=model_runner, backend_str=name,
                                       init_new_workspace=False)
    finally:
        if hasattr(model_runner, "init_new_workspace"):
            model_runner.init_new_workspace = saved


def build_plain_decode_state(model_runner, *, use_graphs: bool, backend_name: Optional[str],
                             runner_cls=None, build_backend: Optional[Callable] = None,
                             free_gb: Optional[Callable[[], float]] = None, algo: str = "DDTREE"):
    """The no-speculation state: ``verify_states.VerifyState(width=1, attn_backend, graph_runner)`` built as
    plain decoding builds its own (see the module docstring).  ``backend_name``: the user's decode
    backend (:func:`user_decode_backend`); when it cannot be built here (e.g. not installed), the
    target's own decode backend type is used and the reason logged.  ``runner_cls``: default SGLang's
    ``DecodeCudaGraphRunner``; ``build_backend(model_runner, name)``: default SGLang's builder."""
    from .verify_states import VerifyState, graph_runner_cls

    build_backend = build_backend or _build_backend
    tic = time.perf_counter()
    before = free_gb() if free_gb else 0.0
    with plain_runner_view(model_runner):
        try:
            backend = build_backend(model_runner, backend_name)
            used = backend_name
        except Exception as e:  # noqa: BLE001 - a missing backend falls back, logged
            logger.warning("%s: plain decode on the %r attention backend failed to build (%s: %s); "
                           "no-speculation rounds use the server's decode backend", algo,
                           backend_name, type(e).__name__, e)
            backend = build_backend(model_runner, None)
            used = None
        runner = None
        if use_graphs:
            runner = (runner_cls or graph_runner_cls())(model_runner, attn_backend=backend)
    after = free_gb() if free_gb else 0.0
    return VerifyState(width=NO_SPEC, attn_backend=backend, graph_runner=runner,
                       build_s=time.perf_counter() - tic, mem_gb=before - after, backend_name=used)


def plain_decode_forward_batch(batch, model_runner, *, input_ids, prefix, out_cache_loc,
                               host_prefix_bound, host_prefix_bound_sum: int):
    """A DECODE ``ForwardBatch`` for one token per request, made by SGLang's own ``init_new`` from the
    scheduler's batch (its sampling, LoRA and logprob fields as plain decoding has them).

    input_ids [bs] (the last committed token, not yet in the KV: the previous round's bonus); prefix
    [bs] (committed KV length, device); out_cache_loc [bs] int64 (the KV slot of position prefix);
    host_prefix_bound [bs] int32 CPU, an upper bound of prefix (the host lags one round under overlap
    scheduling; a backend plans from it).  The batch's fields are restored; the forward batch has
    spec_algorithm NONE, no spec_info and FULL hidden capture."""
    from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch,
                                                              ForwardMode)
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    names = ("input_ids", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "spec_info", "forward_mode",
             "spec_algorithm")
    saved = {n: getattr(batch, n) for n in names}
    try:
        batch.input_ids = input_ids
        batch.seq_lens = prefix + 1
        batch.seq_lens_cpu = host_prefix_bound + 1
        batch.seq_lens_sum = int(host_prefix_bound_sum) + int(prefix.shape[0])
        batch.out_cache_loc = out_cache_loc
        batch.spec_info = None
        batch.forward_mode = ForwardMode.DECODE
        batch.spec_algorithm = SpeculativeAlgorithm.NONE
        fb = ForwardBatch.init_new(batch, model_runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                   return_hidden_states_before_norm=False)
    finally:
        for n, v in saved.items():
            setattr(batch, n, v)
    return fb


class DraftCatchUp:
    """The drafter's K/V owed for no-speculation rounds: rows of target hidden states [T, H], their KV
    slots [T] and positions [T], written by ``append(target_hidden=, cache_loc=, positions=)`` in one
    call at :meth:`flush`.  ``capacity``: rows held before a forced flush, lowered at the first stash
    so the buffer takes at most ``max_bytes`` (it is allocated after SGLang sized its KV pool: at
    Kimi K2 widths a row of five target layers' hidden states is 70 KB) but never below one batch.
    ``key``: what identifies the batch's requests (their ids, in order); rows are only ever pending
    for one key."""

    def __init__(self, append: Callable, capacity: int, max_bytes: int = 64 << 20):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.append = append
        self.capacity = int(capacity)
        self.max_bytes = int(max_bytes)
        self.rows = 0
        self.key: Optional[Sequence] = None
        self._hidden = self._loc = self._pos = None
        self.flushes = 0
        self.flushed_rows = 0

    def must_flush(self, key, *, speculative: bool, incoming: int = 0) -> bool:
        """Pending rows must be written before this batch runs: it drafts (``speculative``), its
        requests differ from the pending rows' (``key``), or ``incoming`` more rows would not fit."""
        return self.rows > 0 and (speculative or key != self.key or self.rows + incoming > self.capacity)

    def stash(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor, key) -> None:
        """Keep one round's rows (hidden [bs, H], cache_loc [bs], positions [bs]; copied on the stream,
        so the caller's buffers may be reused).  The caller flushes first when :meth:`must_flush`."""
        bs = int(hidden.shape[0])
        if self._hidden is None:
            row_bytes = max(1, hidden[0].numel() * hidden.element_size())
            self.capacity = max(bs, min(self.capacity, self.max_bytes // row_bytes))
        if self.rows and key != self.key:
            raise RuntimeError("DraftCatchUp.stash: rows of another batch are pending (flush first)")
        if self.rows + bs > self.capacity:
            raise RuntimeError(f"DraftCatchUp.stash: {self.rows} + {bs} rows exceed the capacity "
                               f"{self.capacity} (flush first)")
        if self._hidden is None or self._hidden.shape[1:] != hidden.shape[1:] \
                or self._hidden.dtype != hidden.dtype or self._hidden.device != hidden.device:
            cap = self.capacity
            self._hidden = torch.empty((cap,) + tuple(hidden.shape[1:]), dtype=hidden.dtype,
                                       device=hidden.device)
            self._loc = torch.empty((cap,), dtype=torch.int64, device=hidden.device)
            self._pos = torch.empty((cap,), dtype=torch.int64, device=hidden.device)
        r = self.rows
        self._hidden[r:r + bs].copy_(hidden)
        self._loc[r:r + bs].copy_(cache_loc.reshape(-1))
        self._pos[r:r + bs].copy_(positions.reshape(-1))
        self.rows = r + bs
        self.key = key

    def flush(self) -> int:
        """Write every pending row's drafter K/V (one call); returns the rows written."""
        n = self.rows
        if n:
            self.append(target_hidden=self._hidden[:n], cache_loc=self._loc[:n], positions=self._pos[:n])
            self.flushes += 1
            self.flushed_rows += n
        self.rows, self.key = 0, None
        return n


def batch_key(reqs) -> tuple:
    """The requests of a batch, in order (their rids: unique for the server's lifetime)."""
    return tuple(r.rid for r in reqs)
