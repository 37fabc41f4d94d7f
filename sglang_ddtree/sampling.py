"""The target distribution a sampled request draws from, at every tree slot of a verify.

``verify_target_probs`` turns the verify logits ``[bs * N, V]`` (after SGLang's in-place logit
adjustments: penalties, logit bias, vocabulary masks) into the probabilities plain decoding samples
from, per request: ``softmax(logits / temperature)``, then top-k, top-p and min-p exactly as SGLang
0.5.16's sampler applies them (``layers/sampler.py``, ``top_k_top_p_min_p_sampling_from_probs_torch``
and flashinfer's ``filter_apply_order="joint"``): on the tokens sorted by probability, rank ``r`` is
kept iff ``r < top_k`` and the probability mass *before* it is ``<= top_p`` (``top_p >= 1`` keeps
every rank: an fp32 cumulative sum can exceed 1); then every kept token
below ``min_p x`` the top probability is dropped; the kept mass is renormalised.  (SGLang's own DFlash
verify, ``dflash_utils.build_dflash_verify_target_probs``, renormalises after top-k and applies top-p
to that, which is not the distribution plain decoding samples from when both are set.)

Memory: one dense fp32 ``[bs * N, V]`` output and nothing else of that size.  Rows are processed in
chunks of at most ``CHUNK_ELEMS`` elements (``SORT_CHUNK_ELEMS`` where a full sort is needed), so
the temporaries stay bounded (<= 256 MB).  SGLang's path holds the scaled logits, the
probabilities and, for its sampling kernel, a dense zero "draft probs" tensor at once.

Paths: when the batch has a top-k below the vocabulary, the exact sparse path (``torch.topk`` of
the batch's largest k, probabilities of the full distribution, joint filter, scatter).  Otherwise
(some request without top-k) the dense softmax; top-p / top-k then go through sgl-kernel's
flashinfer renorm kernels on CUDA, top-p first: every filter keeps a prefix of the same sorted
order, so top-p on the original distribution followed by top-k equals the joint rule; min-p is
relative to the top token, which a renormalisation does not move.  Without sgl-kernel (the CPU)
a per-chunk sort does the same.
"""
from __future__ import annotations

from typing import Optional

import torch

TOP_K_ALL = 1 << 30          # SGLang's "no top-k" (sampling_params.TOP_K_ALL)
CHUNK_ELEMS = 1 << 26        # per-chunk temporaries: <= 64M elements (256 MB fp32)
SORT_CHUNK_ELEMS = 1 << 23   # the sort fallback: values + int64 indices, <= 96 MB


def _renorm_kernels(device):
    """sgl-kernel's (top_k_renorm_prob, top_p_renorm_prob) on CUDA, else None."""
    if device.type != "cuda":
        return None
    try:
        from sgl_kernel import top_k_renorm_prob, top_p_renorm_prob
    except Exception:  # noqa: BLE001 - no sgl-kernel: the torch sort path
        return None
    return top_k_renorm_prob, top_p_renorm_prob


def _per_slot(x: torch.Tensor, num_slots: int) -> torch.Tensor:
    return torch.repeat_interleave(x.reshape(-1), num_slots, dim=0)


def _filter_sorted(p_sorted: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """p_sorted [r, k] descending probabilities of the full distribution -> kept (unnormalised)."""
    ranks = torch.arange(p_sorted.shape[-1], device=p_sorted.device).view(1, -1)
    before = torch.cumsum(p_sorted, dim=-1) - p_sorted
    keep = (ranks < top_k.view(-1, 1)) & ((before <= top_p.view(-1, 1)) | (top_p.view(-1, 1) >= 1.0))
    if min_p is not None:
        keep &= p_sorted >= (p_sorted[:, :1] * min_p.view(-1, 1))
    keep[:, 0] = True                      # the most likely token is always kept (as SGLang's sort)
    return torch.where(keep, p_sorted, torch.zeros_like(p_sorted))


def verify_target_probs(logits: torch.Tensor, *, temperatures: torch.Tensor, top_ks: torch.Tensor,
                        top_ps: torch.Tensor, min_ps: Optional[torch.Tensor], num_slots: int,
                        need_top_k: bool, need_top_p: bool, need_min_p: bool,
                        max_top_k: Optional[int] = None, out: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """logits [bs * N, V] (any float dtype) -> probs [bs * N, V] fp32 (rows sum to 1).

    temperatures [bs] or [bs, 1] (> 0); top_ks [bs] int (``TOP_K_ALL`` = none); top_ps [bs];
    min_ps [bs] or None; num_slots = N (rows per request, request-major); need_*: whether any
    request of the batch sets that filter (SGLang's ``SamplingBatchInfo.need_*_sampling``);
    max_top_k: a host-side upper bound of the batch's top-k (``DFlashDraftInputV2.max_top_k``;
    None = computed, a host sync).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [bs * N, V], got {tuple(logits.shape)}")
    R, V = logits.shape
    bs = temperatures.numel()
    if bs * num_slots != R:
        raise ValueError(f"logits has {R} rows, expected bs * N = {bs} * {num_slots}")
    dev = logits.device
    out = torch.empty((R, V), dtype=torch.float32, device=dev) if out is None else out
    inv_t = (1.0 / _per_slot(temperatures.to(torch.float32), num_slots)).view(-1, 1)
    k_rows = _per_slot(top_ks.to(torch.int64), num_slots).clamp(1, V)
    p_rows = _per_slot(top_ps.to(torch.float32), num_slots)
    m_rows = _per_slot(min_ps.to(torch.float32), num_slots) if (need_min_p and min_ps is not None) else None
    if need_top_k:
        kmax = int(k_rows.max()) if max_top_k is None else int(max_top_k)
        kmax = max(1, min(kmax, V))
    else:
        kmax = V
    sparse = need_top_k and kmax < V
    filt = need_top_p or m_rows is not None or (need_top_k and not sparse)
    renorm = _renorm_kernels(dev) if (filt and not sparse) else None
    use_sort = filt and not sparse and renorm is None
    step = max(1, (SORT_CHUNK_ELEMS if use_sort else CHUNK_ELEMS) // V)
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        x = logits[r0:r1].to(torch.float32) * inv_t[r0:r1]
        ms = None if m_rows is None else m_rows[r0:r1]
        if sparse:
            # the batch's top-k: only these ranks can be kept; probabilities of the FULL distribution
            vals, idx = torch.topk(x, kmax, dim=-1, sorted=True)
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            kept = _filter_sorted(torch.exp(vals - lse), k_rows[r0:r1], p_rows[r0:r1], ms)
            kept = kept / kept.sum(-1, keepdim=True)
            out[r0:r1].zero_()
            out[r0:r1].scatter_(1, idx, kept)
            continue
        probs = torch.softmax(x, dim=-1)
        del x
        if not filt:
            out[r0:r1].copy_(probs)
        elif renorm is not None:
            top_k_renorm, top_p_renorm = renorm
            if need_top_p:
                probs = top_p_renorm(probs, p_rows[r0:r1].contiguous())
            if need_top_k:
                probs = top_k_renorm(probs, k_rows[r0:r1].to(torch.int32).contiguous())
            if ms is not None:
                probs = torch.where(probs >= probs.amax(-1, keepdim=True) * ms.view(-1, 1), probs, 0.0)
                probs = probs / probs.sum(-1, keepdim=True)
            out[r0:r1].copy_(probs)
        else:
            p_sorted, idx = torch.sort(probs, dim=-1, descending=True)
            kept = _filter_sorted(p_sorted, k_rows[r0:r1], p_rows[r0:r1], ms)
            kept = kept / kept.sum(-1, keepdim=True)
            out[r0:r1].scatter_(1, idx, kept)
    return out


def verify_target_probs_reference(logits: torch.Tensor, temperatures, top_ks, top_ps, min_ps,
                                  num_slots: int) -> torch.Tensor:
    """Plain per-row reference (float64, full sort, no chunking): the same semantics."""
    x = logits.detach().to("cpu", torch.float64)
    R, V = x.shape
    t = torch.as_tensor(temperatures, dtype=torch.float64).reshape(-1)
    ks = torch.as_tensor(top_ks).reshape(-1)
    ps = torch.as_tensor(top_ps, dtype=torch.float64).reshape(-1)
    ms = None if min_ps is None else torch.as_tensor(min_ps, dtype=torch.float64).reshape(-1)
    out = torch.zeros((R, V), dtype=torch.float64)
    for r in range(R):
        b = r // num_slots
        p = torch.softmax(x[r] / t[b], dim=-1)
        order = sorted(range(V), key=lambda j: (-float(p[j]), j))
        k = min(int(ks[b]), V)
        mass, kept = 0.0, []
        for rank, j in enumerate(order):
            if rank >= k or (float(ps[b]) < 1.0 and mass > float(ps[b])):
                break
            kept.append(j)
            mass += float(p[j])
        top = float(p[order[0]])
        if ms is not None:
            kept = [j for j in kept if float(p[j]) >= top * float(ms[b])] or [order[0]]
        tot = sum(float(p[j]) for j in kept)
        for j in kept:
            out[r, j] = float(p[j]) / tot
    return out
