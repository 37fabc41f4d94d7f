"""The target-verify custom mask in the flattened layout SGLang's attention backends read.

``verify_mask_triton(mask_words [bs, N, NW] int32, seq_lens [bs] int, out uint8/bool [total],
mode)`` writes, for each request ``b`` and tree slot ``i`` (``N`` verify tokens per request):

* ``mode="full"`` (SGLang's ``TreeMaskMode.FULL_MASK``, read by the triton backend through
  ``mask_indptr``): request ``b``'s block starts at ``N*N*b + N*sum(seq_lens[:b])`` and holds
  ``N`` rows of ``seq_lens[b] + N`` columns, row-major: the prefix columns are all 1, then
  the tree columns are row ``i`` of the ancestor-only visibility.  ``total = N*sum(seq_lens)
  + N*N*bs``.
* ``mode="qlen"`` (``TreeMaskMode.QLEN_ONLY``): only the tree columns, ``N*N`` per request.

This layout was read off SGLang 0.5.16 (``srt/layers/attention/triton_backend.py``:
``seq_mask_len = N * (seq_lens + N)``; ``kernels/ops/speculative/spec_tree.py``: the EAGLE
tree builder's indexing).  One program per (request, row); the prefix part is a loop over the
row's runtime prefix length, so the launch has a static grid (CUDA-graph safe) and no host sync.

Reference: ``verify_mask_torch`` below.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _verify_mask_kernel(words_ptr, seq_lens_ptr, out_ptr, bs, N, NW,
                        FULL: tl.constexpr, BSP: tl.constexpr, NP: tl.constexpr,
                        BLOCK: tl.constexpr):
    b = tl.program_id(0)
    i = tl.program_id(1)
    b64 = b.to(tl.int64)
    cols = tl.arange(0, NP)
    word = tl.load(words_ptr + (b64 * N + i) * NW + cols // 32, mask=cols < N, other=0)
    bits = ((word >> (cols % 32)) & 1).to(tl.uint8)
    if FULL:
        offs_b = tl.arange(0, BSP)
        lens = tl.load(seq_lens_ptr + offs_b, mask=offs_b < b, other=0).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
        row = N * N * b64 + N * tl.sum(lens, 0) + (seq_len + N) * i
        ones = tl.full([BLOCK], 1, tl.uint8)
        offs = tl.arange(0, BLOCK)
        for start in range(0, seq_len, BLOCK):
            tl.store(out_ptr + row + start + offs, ones, mask=start + offs < seq_len)
        tl.store(out_ptr + row + seq_len + cols, bits, mask=cols < N)
    else:
        tl.store(out_ptr + N * N * b64 + N * i + cols, bits, mask=cols < N)


def verify_mask_size(seq_lens_sum: int, bs: int, N: int, mode: str = "full") -> int:
    """Elements of the flattened mask (what to allocate, or the CUDA-graph buffer's minimum)."""
    return N * N * bs + (N * seq_lens_sum if mode == "full" else 0)


def verify_mask_triton(mask_words: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                       mode: str = "full") -> torch.Tensor:
    """Write the flattened verify mask into ``out`` (uint8 or bool, at least
    ``verify_mask_size`` elements; elements past that are left alone)."""
    if mode not in ("full", "qlen"):
        raise ValueError(f"mode must be 'full' or 'qlen', got {mode!r}")
    bs, N, NW = mask_words.shape
    if bs == 0:
        return out
    flat = out.view(torch.uint8) if out.dtype == torch.bool else out
    _verify_mask_kernel[(bs, N)](
        mask_words.contiguous(), seq_lens, flat, bs, N, NW,
        FULL=mode == "full", BSP=max(2, triton.next_power_of_2(bs)),
        NP=max(16, triton.next_power_of_2(N)), BLOCK=1024, num_warps=4)
    return out


def verify_mask_torch(visibility: torch.Tensor, seq_lens: torch.Tensor, mode: str = "full"):
    """Independent torch reference from the dense visibility [bs, N, N] -> bool [total]."""
    blocks = []
    for b in range(visibility.shape[0]):
        vis = visibility[b].to(torch.bool)
        if mode == "full":
            prefix = torch.ones((vis.shape[0], int(seq_lens[b])), dtype=torch.bool, device=vis.device)
            vis = torch.cat([prefix, vis], dim=1)
        blocks.append(vis.reshape(-1))
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
