"""One round's commit in one launch: emitted tokens, lengths, the K/V slot remap, the drafter's slots.

``commit_round_triton(tokens [bs, N] int64, path [bs, W] int32, accept_len [bs] int32, bonus [bs]
int64, prefix [bs] int32/int64, req_pool_indices [bs] int, req_to_token [R, L] int, remap, block_size,
out)`` -> ``(out_tokens, commit_lens, new_seq_lens, hidden_rows, block_loc)``, per request b with
``a = accept_len[b]``, ``r = req_pool_indices[b]``, ``p = prefix[b]`` (``path``: slots root first,
-1 padded, ``W = D + 1``):

- ``out_tokens [bs, W] int64``: ``tokens[b, path[b, 1..a]]``, the bonus at column a, then 0;
- ``commit_lens [bs] int32 = a + 1``; ``new_seq_lens [bs]`` (prefix's dtype) ``= p + a + 1``;
- ``hidden_rows [bs * W] int64 = b * N + max(path[b, i], 0)``: the verify rows of the path's hidden
  states (padding repeats the root);
- ``remap`` and N > 1: ``req_to_token[r, p : p + N]`` permuted in place, slot ``path[b, k]``'s
  location to position ``p + k``, then the other slots' locations in slot order (the whole segment
  is loaded before any store);
- ``block_size = B`` (else None): ``block_loc [bs, B] = req_to_token[r, p + j]`` after the remap
  (positions ``p + N`` on are untouched by it).

One program per request, static shapes, no host sync, CUDA-graph safe.  ``out``: optional
preallocated tuple of the five (block_loc None when not wanted).

Reference: ``commit_round_reference`` (below: the worker's former torch composition, built from
``Accept.new_tokens``, ``tree_ops.commit_path_slots`` and ``tree_ops.gather_path_rows``).
"""
from __future__ import annotations

import types

import torch
import triton
import triton.language as tl


@triton.jit
def _commit_round_kernel(
    tokens_ptr, path_ptr, accept_ptr, bonus_ptr, prefix_ptr, pool_ptr, r2t_ptr,
    out_tokens_ptr, commit_lens_ptr, new_seq_lens_ptr, hidden_rows_ptr, block_loc_ptr,
    N, W, B, r2t_stride,
    NP: tl.constexpr, WP: tl.constexpr, BP: tl.constexpr, REMAP: tl.constexpr, BLOCK_LOC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    a = tl.load(accept_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    tl.store(commit_lens_ptr + b, a + 1)
    tl.store(new_seq_lens_ptr + b, prefix + (a + 1))

    w = tl.arange(0, WP)
    in_w = w < W
    path = tl.load(path_ptr + b * W + w, mask=in_w, other=-1)
    tl.store(hidden_rows_ptr + b * W + w, b * N + tl.maximum(path, 0).to(tl.int64), mask=in_w)
    # column k < a: the token of path[k + 1]; column a: the bonus; then 0
    nxt = tl.load(path_ptr + b * W + w + 1, mask=in_w & (w < a), other=0)
    tok = tl.load(tokens_ptr + b * N + tl.maximum(nxt, 0).to(tl.int64), mask=in_w & (w < a), other=0)
    bonus = tl.load(bonus_ptr + b)
    out = tl.where(w < a, tok, tl.where(w == a, bonus, 0))
    tl.store(out_tokens_ptr + b * W + w, tl.maximum(out, 0), mask=in_w)

    if REMAP or BLOCK_LOC:
        n = tl.arange(0, NP)
        in_n = n < N
        row = r2t_ptr + tl.load(pool_ptr + b).to(tl.int64) * r2t_stride + prefix.to(tl.int64)
        locs = tl.load(row + n, mask=in_n, other=0)
        pos = n
        if REMAP:
            # new position of slot i: its depth k on the path, else (path length) + (its rank among
            # the off-path slots) = nvalid + i - #(path slots < i)
            valid = (path >= 0) & in_w
            hit = (path[None, :] == n[:, None]) & valid[None, :]                       # [NP, WP]
            on_path = tl.sum(hit.to(tl.int32), 1) > 0
            depth = tl.sum(tl.where(hit, w[None, :], 0), 1)
            below = tl.sum(((path[None, :] < n[:, None]) & valid[None, :]).to(tl.int32), 1)
            nvalid = tl.sum(valid.to(tl.int32), 0)
            pos = tl.where(on_path, depth, nvalid + n - below)
            tl.debug_barrier()   # every thread's segment load is done before any store (in place)
            tl.store(row + pos, locs, mask=in_n & (pos != n))   # N = 1: pos == n, nothing stored
        if BLOCK_LOC:
            j = tl.arange(0, BP)
            sel = (pos[None, :] == j[:, None]) & in_n[None, :]                          # [BP, NP]
            seg = tl.sum(tl.where(sel, locs[None, :], 0), 1)
            rest = tl.load(row + j, mask=(j >= N) & (j < B), other=0)
            tl.store(block_loc_ptr + b * B + j, tl.where(j < N, seg, rest), mask=j < B)


def alloc_commit_outputs(bs: int, width: int, prefix_dtype, device, block_size=None):
    """(out_tokens [bs, W] int64, commit_lens [bs] int32, new_seq_lens [bs] prefix_dtype,
    hidden_rows [bs * W] int64, block_loc [bs, B] int64 or None), uninitialised."""
    return (torch.empty((bs, width), dtype=torch.int64, device=device),
            torch.empty((bs,), dtype=torch.int32, device=device),
            torch.empty((bs,), dtype=prefix_dtype, device=device),
            torch.empty((bs * width,), dtype=torch.int64, device=device),
            None if block_size is None else torch.empty((bs, block_size), dtype=torch.int64, device=device))


def commit_round_triton(tokens, path, accept_len, bonus, prefix, req_pool_indices, req_to_token, *,
                        remap: bool = True, block_size=None, out=None):
    """See module docstring.  ``req_to_token`` rows must be contiguous (stride(1) == 1)."""
    bs, N = tokens.shape
    W = path.shape[1]
    if out is None:
        out = alloc_commit_outputs(bs, W, prefix.dtype, tokens.device, block_size)
    out_tokens, commit_lens, new_seq_lens, hidden_rows, block_loc = out
    if bs == 0:
        return out
    B = 1 if block_loc is None else block_loc.shape[1]
    NP = max(16, triton.next_power_of_2(N))
    _commit_round_kernel[(bs,)](
        tokens, path, accept_len, bonus, prefix, req_pool_indices, req_to_token,
        out_tokens, commit_lens, new_seq_lens, hidden_rows, out_tokens if block_loc is None else block_loc,
        N, W, B, req_to_token.stride(0),
        NP=NP, WP=max(16, triton.next_power_of_2(W)), BP=max(16, triton.next_power_of_2(B)),
        REMAP=bool(remap), BLOCK_LOC=block_loc is not None, num_warps=1 if NP <= 128 else 4,
    )
    return out


def commit_round_reference(tokens, path, accept_len, bonus, prefix, req_pool_indices, req_to_token, *,
                           remap: bool = True, block_size=None, out=None):
    """The same outputs and ``req_to_token`` effect from the ops the worker composed before the
    kernel (any device).  ``out`` as :func:`commit_round_triton` (filled by copy)."""
    from .. import tree_ops
    from ..ddtree import Accept

    bs, N = tokens.shape
    commit_lens = (accept_len + 1).to(torch.int32)
    new_seq_lens = prefix + commit_lens.to(prefix.dtype)
    out_tokens = Accept(accept_len, path, bonus).new_tokens(types.SimpleNamespace(tokens=tokens)).clamp_(min=0)
    rows = torch.arange(bs * N, device=tokens.device, dtype=torch.int64).view(bs * N, 1)
    hidden_rows = tree_ops.gather_path_rows(rows, path).view(-1)
    if remap:
        tree_ops.commit_path_slots(req_to_token, req_pool_indices, prefix, path, N)
    if out is not None and out[4] is not None:
        block_size = out[4].shape[1]
    block_loc = None
    if block_size is not None:
        cols = prefix.to(torch.int64).view(bs, 1) + torch.arange(block_size, device=prefix.device,
                                                                 dtype=torch.int64)
        block_loc = req_to_token[req_pool_indices.to(torch.int64).view(bs, 1), cols].to(torch.int64)
    res = (out_tokens, commit_lens, new_seq_lens, hidden_rows, block_loc)
    if out is None:
        return res
    for o, r in zip(out, res):
        if o is not None:
            o.copy_(r)
    return out
