"""Log-probabilities of the tokens a DDTree round commits (``return_logprob``, ``top_logprobs_num``,
``token_ids_logprob``; ``/generate`` and ``/v1/completions`` with ``logprobs``).

The verify forward already computed the target's logits at every tree node. The j-th token a round
commits (accepted path token j, then the bonus) is the target's choice at the j-th node of the
accepted path (root first): ``path[b, j]``. So its log-probability is ``log_softmax`` of that
node's logits row, and its top-n are that row's. :func:`fill_round_logprobs` gathers those rows and
hands them to SGLang 0.5.16's own spec-v2 routine (``compute_spec_v2_logprobs``, the one EAGLE
uses), so the values, the temperature scaling for sampled requests, the top-n and token-id lists
and their layout (request i's j-th token at ``i * W + j``, ``W = D + 1`` per request) are SGLang's.

Status: on by default. ``SGLANG_DDTREE_LOGPROBS=0`` turns it off; a request that asks for
log-probabilities is then refused with SGLang's DFLASH message. Checked on the H200 against a plain
server of the same target (``bench/logprobs_check.py``, ``bench/results/logprobs_h200.md``): greedy
and sampled (T=1) log-probs and top-5 sit at plain decoding's own decode-vs-extend bf16 noise.
"""
from __future__ import annotations

import contextlib
import os

import torch

from . import tree_ops

ENV = "SGLANG_DDTREE_LOGPROBS"
_FIELDS = ("next_token_logprobs", "next_token_top_logprobs_val", "next_token_top_logprobs_idx",
           "next_token_token_ids_logprobs_val", "next_token_token_ids_logprobs_idx")


def enabled(env=None, algo: str = "DDTREE") -> bool:
    """``SGLANG_DDTREE_LOGPROBS`` (``env_vars.flag``: on unless 0 / false / no / off; another value
    is a ValueError)."""
    from .env_vars import flag

    return flag(os.environ if env is None else env, ENV, True, algo)


class _LogitsView:
    """What ``compute_spec_v2_logprobs`` reads and writes of a ``LogitsProcessorOutput``."""

    def __init__(self, next_token_logits):
        self.next_token_logits = next_token_logits
        for f in _FIELDS:
            setattr(self, f, None)


class _GreedySampling:
    is_all_greedy = True
    temperatures = None


class _BatchView:
    """The batch fields ``compute_spec_v2_logprobs`` reads (a missing sampling_info = greedy)."""

    def __init__(self, batch):
        self.seq_lens = batch.seq_lens
        self.sampling_info = batch.sampling_info if batch.sampling_info is not None else _GreedySampling()
        self.top_logprobs_nums = getattr(batch, "top_logprobs_nums", None)
        self.token_ids_logprobs = getattr(batch, "token_ids_logprobs", None)


def fill_round_logprobs(batch, logits_output, path: torch.Tensor, new_tokens: torch.Tensor,
                        num_slots: int) -> None:
    """Set ``logits_output.next_token_logprobs`` ``[bs, W]`` (and the top-n / token-id lists) for
    the tokens this round commits.

    ``path [bs, W]``: the accepted slots, root first, -1 padded (``Accept.path``); ``new_tokens
    [bs, W]``: the committed tokens, -1 padded (``Accept.new_tokens``); ``logits_output.
    next_token_logits [bs * num_slots, V]``: the verify logits, as the accept read them.  Padding
    positions get a value the scheduler never reads (it reads the first ``accept_len + 1``)."""
    from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

    bs, width = path.shape
    rows = tree_ops.accept_index_from_path(path, num_slots).to(torch.int64).clamp_(min=0).reshape(-1)
    view = _LogitsView(logits_output.next_token_logits.index_select(0, rows))
    idx = torch.arange(bs * width, device=path.device, dtype=torch.int64).view(bs, width)
    compute_spec_v2_logprobs(_BatchView(batch), view, new_tokens.reshape(-1).clamp(min=0), idx, width - 1)
    for f in _FIELDS:
        if getattr(view, f) is not None:
            setattr(logits_output, f, getattr(view, f))


class _TargetWithLogprobs:
    """The target worker as DFLASH's prefill sees it while the batch's ``return_logprob`` is
    hidden from DFLASH's up-front refusal: it shows the flag again to the target's forward, which
    computes the prompt / first-token log-probabilities as in plain decoding."""

    def __init__(self, target):
        object.__setattr__(self, "_t", target)

    def forward_batch_generation(self, batch, *args, **kwargs):
        batch.return_logprob = True
        return self._t.forward_batch_generation(batch, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._t, name)


@contextlib.contextmanager
def prefill_with_logprobs(worker, batch):
    """Run DFLASH's prefill (``DFlashWorkerV2.forward_batch_generation`` on an extend batch) for a
    batch that asks for log-probabilities: SGLang 0.5.16 refuses ``return_logprob`` before it
    looks at the batch, although its prefill is the target's plain extend forward."""
    real = worker._target_worker
    worker._target_worker = _TargetWithLogprobs(real)
    batch.return_logprob = False
    try:
        yield
    finally:
        worker._target_worker = real
        batch.return_logprob = True
