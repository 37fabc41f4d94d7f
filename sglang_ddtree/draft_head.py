"""The drafter's head for DDTree: top-K log-probs per drafted position, folded into the draft CUDA graph.

DFLASH's drafter has no head of its own: it borrows the target's ``lm_head``.  Stock DFLASH keeps
only the argmax; DDTree needs, for every drafted position 1..B-1, the K best tokens and their
log-probabilities (top logit minus the logsumexp over the whole vocabulary).

* tp = 1: ``logits = h @ W.T`` then the fused top-k + logsumexp kernel (``kernels/topk_logprobs``).
* tp > 1 (vocabulary-parallel ``lm_head``): each rank reduces its shard to ``(max, sum, top-K keys
  with global ids)``, the ranks all-gather those ``2 + KP`` numbers per row (never the logits), and
  every rank merges them into the same exact result.
* ``exact_topk=False`` (DDTREE-CPU, the ports' recipe): ``torch.topk`` + ``torch.logsumexp`` in
  fp32; equal logits may come out in another order than the kernel's (value desc, id asc).

Both paths rank a non-finite logit (NaN, +-inf) as -inf, so a drafter gone bad (NaN/+inf in its
hidden states or logits) still yields in-vocabulary ids, at log-prob -inf (never NaN): the tree
then holds -inf nodes and the round degrades to the bonus token instead of crashing the target's
embedding.

Outputs live in static buffers (``lp [max_rows, K]`` fp32, ``ids [max_rows, K]`` int64) so the
graph replays write the same addresses; the worker reads rows ``[: bs * (B - 1)]``.
"""
from __future__ import annotations

import torch


class DDTreeDraftHead:
    def __init__(self, *, weight: torch.Tensor, block_size: int, topk: int, num_org: int,
                 org_vocab_start: int, max_bs: int, tp_group=None, exact_topk: bool = True):
        self.weight = weight
        self.block_size = int(block_size)
        self.topk = int(topk)
        self.num_org = int(num_org)
        self.org_vocab_start = int(org_vocab_start)
        self.tp_group = tp_group
        self.tp_size = int(tp_group.world_size) if tp_group is not None else 1
        self.exact_topk = bool(exact_topk)
        self.max_rows = 0
        self._alloc(max_bs)

    def _alloc(self, max_bs: int) -> None:
        rows = int(max_bs) * (self.block_size - 1)
        if rows <= self.max_rows:
            return
        dev, K = self.weight.device, self.topk
        self.lp = torch.empty((rows, K), dtype=torch.float32, device=dev)
        self.ids = torch.empty((rows, K), dtype=torch.int64, device=dev)
        if self.tp_size > 1:
            KP = max(2, 1 << (K - 1).bit_length())
            P = self.tp_size
            self.gm = torch.empty((P * rows,), dtype=torch.float32, device=dev)
            self.gs = torch.empty((P * rows,), dtype=torch.float32, device=dev)
            self.gk = torch.empty((P * rows * KP,), dtype=torch.int64, device=dev)
            self.kp = KP
        self.max_rows = rows

    def ensure_capacity(self, bs: int) -> None:
        """Grow the output buffers for an eager call on a batch larger than any captured one."""
        self._alloc(bs)

    def __call__(self, hidden_states: torch.Tensor, input_ids=None) -> None:
        """hidden_states [bs * B, H] (the drafter's normed outputs) -> self.lp / self.ids rows."""
        B = self.block_size
        bs = hidden_states.shape[0] // B
        H = hidden_states.shape[-1]
        hs = hidden_states.view(bs, B, H)[:, 1:, :].reshape(-1, H)
        if hs.dtype != self.weight.dtype:
            hs = hs.to(self.weight.dtype)
        n = hs.shape[0]
        logits = torch.matmul(hs, self.weight[: self.num_org].T)
        lp, ids = self.lp[:n], self.ids[:n]
        if not self.exact_topk and self.tp_size == 1:  # (under TP: the exact sharded merge below)
            full = torch.nan_to_num(logits.float(), nan=-torch.inf, posinf=-torch.inf,
                                   neginf=-torch.inf)  # the default neginf is finite
            vals, top = torch.topk(full, self.topk, dim=-1)
            logz = torch.logsumexp(full, dim=-1, keepdim=True)
            lp.copy_(torch.where(vals == -torch.inf, vals, vals - logz))
            ids.copy_(top + self.org_vocab_start)
            return
        from sglang_ddtree.kernels.topk_logprobs import (topk_logprobs_triton, topk_merge_triton,
                                                         topk_partial_triton)
        if self.tp_size == 1:
            topk_logprobs_triton(logits, self.topk, out=(lp, ids))
            if self.org_vocab_start:
                ids.add_(self.org_vocab_start)
            return
        m, s, keys = topk_partial_triton(logits, self.topk, self.org_vocab_start)
        P, KP = self.tp_size, keys.shape[1]
        gm, gs, gk = self.gm[: P * n], self.gs[: P * n], self.gk[: P * n * KP]
        self.tp_group.all_gather_into_tensor(gm, m)
        self.tp_group.all_gather_into_tensor(gs, s)
        self.tp_group.all_gather_into_tensor(gk, keys.reshape(-1))
        topk_merge_triton(gm.view(P, n), gs.view(P, n), gk.view(P, n, KP), self.topk, out=(lp, ids))


def check_target_lm_head(model, algo: str):
    """The target's lm_head module, or ValueError: the drafter's top-k head multiplies the
    drafter's hidden states with ``lm_head.weight`` (the target's head, as DFLASH shares it), so
    it must be a plain floating-point weight.  A quantized head (an INT4 / FP8 ``lm_head`` stores
    ``weight_packed`` / scales, or an integer ``weight``) is refused at start-up with this message;
    Kimi K2 / K2.6 keep ``lm_head`` in bf16 (their quantization configs list it in ``ignore``)."""
    lm_head = getattr(model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if lm_head is None or not isinstance(weight, torch.Tensor):
        raise ValueError(f"{algo} needs the target's lm_head weight (a floating-point "
                         f"[vocab, hidden] tensor); the target model has "
                         f"{'no lm_head' if lm_head is None else type(lm_head).__name__ + ' without one'}: "
                         "a quantized lm_head is not supported (keep lm_head unquantized)")
    if not torch.is_floating_point(weight):
        raise ValueError(f"{algo}: the target's lm_head weight is {weight.dtype}: a quantized "
                         "lm_head is not supported (keep lm_head unquantized)")
    return lm_head
