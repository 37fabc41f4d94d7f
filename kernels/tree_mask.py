"""Ancestor-only tree attention mask from parent indices, dense and bit-packed.

``tree_mask_triton(parent [bs, N] int32, max_depth)`` -> ``(visibility [bs, N, N] bool,
mask_words [bs, N, ceil(N/32)] int32)``.  Row ``i`` sees ``i`` and its ancestors; bit ``j``
of word ``w`` is column ``32 * w + j``.  Padding slots (parent -1) see only themselves.

Each program takes a block of rows of one request and walks all of them up the parent
chain at once, gathering from the request's parent array held in registers (at most ``max_depth + 1`` hops, since a node's depth is <= the draft depth),
so the whole mask is built in parallel with no sequential dependency between rows.

Reference: ``sglang_ddtree.reference.tree_visibility_ref`` / ``pack_visibility``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_mask_kernel(
    parent_ptr, vis_ptr, words_ptr, N, NW, max_depth,
    NP: tl.constexpr, NWP: tl.constexpr, BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, NP)
    in_rows = rows < N
    # the request's parent array stays in registers: the walk gathers from it, no memory
    # round trip per hop
    parent = tl.load(parent_ptr + b * N + cols, mask=cols < N, other=-1)
    cur = tl.where(in_rows, rows, 0)
    alive = in_rows
    vis = tl.zeros([BLOCK_R, NP], tl.int32)
    for _hop in range(0, max_depth + 1):
        vis = vis | ((cols[None, :] == cur[:, None]) & alive[:, None]).to(tl.int32)
        nxt = tl.gather(parent, cur, 0)
        alive = alive & (nxt >= 0)
        cur = tl.where(alive, nxt, 0)
    vis_mask = in_rows[:, None] & (cols[None, :] < N)
    tl.store(vis_ptr + b * N * N + rows[:, None] * N + cols[None, :], vis.to(tl.int8), mask=vis_mask)
    bits = tl.reshape(vis, [BLOCK_R, NWP, 32]) << tl.arange(0, 32)[None, None, :]
    words = tl.sum(bits, 2)
    wcols = tl.arange(0, NWP)
    tl.store(words_ptr + b * N * NW + rows[:, None] * NW + wcols[None, :], words,
             mask=in_rows[:, None] & (wcols[None, :] < NW))


def tree_mask_triton(parent: torch.Tensor, max_depth: int, out=None):
    """See module docstring.  ``out``: optional preallocated (visibility bool, mask_words int32)."""
    bs, N = parent.shape
    NW = (N + 31) // 32
    parent = parent.contiguous()
    if out is None:
        out = (torch.empty((bs, N, N), dtype=torch.bool, device=parent.device),
               torch.empty((bs, N, NW), dtype=torch.int32, device=parent.device))
    vis, words = out
    if bs == 0:
        return out
    NP = max(32, triton.next_power_of_2(N))
    BLOCK_R = min(NP, max(16, 1024 // NP))
    grid = (bs, triton.cdiv(N, BLOCK_R))
    _tree_mask_kernel[grid](parent, vis.view(torch.int8), words, N, NW, max_depth,
                            NP=NP, NWP=NP // 32, BLOCK_R=BLOCK_R, num_warps=4)
    return out


def tree_mask_torch(parent: torch.Tensor, max_depth: int):
    """Independent torch reference: repeated parent gathers (vectorised over rows)."""
    bs, N = parent.shape
    vis = torch.zeros((bs, N, N), dtype=torch.bool, device=parent.device)
    cur = torch.arange(N, device=parent.device).expand(bs, N).clone()
    alive = torch.ones((bs, N), dtype=torch.bool, device=parent.device)
    rows = torch.arange(N, device=parent.device)
    for _ in range(max_depth + 1):
        b_idx, r_idx = alive.nonzero(as_tuple=True)
        vis[b_idx, rows[r_idx], cur[b_idx, r_idx]] = True
        nxt = torch.gather(parent.long(), 1, cur.clamp(min=0))
        alive = alive & (nxt >= 0)
        cur = torch.where(alive, nxt, torch.zeros_like(nxt))
    return vis
