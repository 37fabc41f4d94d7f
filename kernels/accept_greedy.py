"""Greedy tree acceptance on the GPU: walk from the root along the target's choices.

``accept_greedy_triton(tokens [bs, N] int64, parent [bs, N] int32, target_tokens [bs, N] int64,
max_depth)`` -> ``(accept_len [bs] int32, path [bs, max_depth + 1] int32, bonus [bs] int64)``.

From the root, move to the child whose token equals the target's argmax at the current
node (children of one parent carry distinct tokens; if a caller's tree repeats one, the
smallest slot wins, as in the reference), at most ``max_depth`` times; ``path`` lists the
visited slots root first and is -1 padded; ``bonus`` is the target's choice at the last
node.  One program per request; the tree row stays in registers.

Reference: ``sglang_ddtree.reference.accept_greedy_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_greedy_kernel(
    tokens_ptr, parent_ptr, target_ptr, accept_ptr, path_ptr, bonus_ptr,
    N, max_depth, NP: tl.constexpr, DP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NP)
    in_tree = (offs < N) & (offs > 0)
    tok = tl.load(tokens_ptr + b * N + offs, mask=in_tree, other=-1)
    par = tl.load(parent_ptr + b * N + offs, mask=in_tree, other=-1)
    doffs = tl.arange(0, DP)
    path = tl.where(doffs == 0, 0, -1)
    cur = tl.full([], 0, tl.int32)
    alive = tl.full([], 1, tl.int1)
    n_acc = tl.full([], 0, tl.int32)
    for step in range(0, max_depth):
        want = tl.load(target_ptr + b * N + cur)
        match = in_tree & (par == cur) & (tok == want)
        j = tl.min(tl.where(match, offs, NP), 0)
        found = alive & (j < NP)
        path = tl.where((doffs == step + 1) & found, j, path)
        cur = tl.where(found, j, cur)
        n_acc += found.to(tl.int32)
        alive = found
    tl.store(accept_ptr + b, n_acc)
    tl.store(path_ptr + b * (max_depth + 1) + doffs, path, mask=doffs < max_depth + 1)
    tl.store(bonus_ptr + b, tl.load(target_ptr + b * N + cur))


def alloc_accept_outputs(bs: int, max_depth: int, device):
    """(accept_len [bs] int32, path [bs, max_depth + 1] int32, bonus [bs] int64), uninitialised."""
    return (torch.empty((bs,), dtype=torch.int32, device=device),
            torch.empty((bs, max_depth + 1), dtype=torch.int32, device=device),
            torch.empty((bs,), dtype=torch.int64, device=device))


def accept_greedy_triton(tokens: torch.Tensor, parent: torch.Tensor, target_tokens: torch.Tensor,
                         max_depth: int, out=None):
    """See module docstring.  ``out``: optional preallocated (accept_len, path, bonus)."""
    bs, N = tokens.shape
    dev = tokens.device
    if out is None:
        out = alloc_accept_outputs(bs, max_depth, dev)
    accept_len, path, bonus = out
    if bs == 0:
        return out
    NP = max(16, triton.next_power_of_2(N))
    DP = max(16, triton.next_power_of_2(max_depth + 1))
    _accept_greedy_kernel[(bs,)](
        tokens.contiguous(), parent.contiguous(), target_tokens.contiguous(),
        accept_len, path, bonus, N, max_depth, NP=NP, DP=DP,
        num_warps=1 if NP <= 128 else 4,
    )
    return out
