"""Small static-shape tensor ops the worker applies between the kernels (no host sync, any device).

Shapes: ``bs`` requests, ``N`` tree slots (root = slot 0), ``W = D + 1`` path width.
"""
from __future__ import annotations

import torch


def host_to_device(values, device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A host sequence of ints -> a ``dtype`` tensor on ``device`` without synchronising the stream:
    on CUDA through pinned memory and a non-blocking copy (PyTorch's caching host allocator keeps
    the pinned buffer until the copy is done); elsewhere a plain tensor."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return torch.tensor(list(values), dtype=dtype, device=dev)
    return torch.tensor(list(values), dtype=dtype, pin_memory=True).to(dev, non_blocking=True)


def verify_input_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Tree tokens [bs, N] (-1 = padding slot) -> ids the target can embed: padding -> 0.
    A padding slot's row attends to the prefix and itself only; its logits are never read."""
    return tokens.clamp(min=0)


def accept_index_from_path(path: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Accepted slots per request [bs, W] (-1 padded) -> flat verify-row indices ``b * N + slot``
    (-1 kept): the ``accept_index`` of SGLang's ``move_accept_tokens_to_target_kvcache``. int32."""
    bs = path.shape[0]
    base = torch.arange(bs, device=path.device, dtype=torch.int64).unsqueeze(1) * num_slots
    flat = base + path.to(torch.int64)
    return torch.where(path >= 0, flat, torch.full_like(flat, -1)).to(torch.int32)


def gather_path_rows(rows: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """rows [bs * N, H] (per-slot target hidden states) -> [bs * W, H]: row ``path[b, i]`` of
    request b at position i (padding positions repeat the root row; callers commit only
    ``accept_len + 1`` of them)."""
    bs, W = path.shape
    H = rows.shape[-1]
    N = rows.shape[0] // bs
    idx = path.clamp(min=0).to(torch.int64)
    return torch.gather(rows.view(bs, N, H), 1, idx.unsqueeze(-1).expand(bs, W, H)).reshape(bs * W, H)


def lcrs_links(parent: torch.Tensor):
    """Parent array [bs, N] (-1 = root / padding) -> (first_child [bs, N], next_sibling [bs, N])
    int64, -1 = none, children in slot order: the ``retrive_next_token`` /
    ``retrive_next_sibling`` links of SGLang's tree verify kernels."""
    bs, N = parent.shape
    par = parent.to(torch.int64)
    j = torch.arange(N, device=parent.device, dtype=torch.int64)
    none = torch.full((), N, device=parent.device, dtype=torch.int64)
    # first_child[b, p] = min{j : parent[b, j] == p}
    is_child = par.unsqueeze(1) == j.view(1, N, 1)                       # [bs, p, j]
    first = torch.where(is_child, j.view(1, 1, N), none).amin(-1)
    # next_sibling[b, i] = min{j > i : parent[b, j] == parent[b, i] >= 0}
    same = (par.unsqueeze(2) == par.unsqueeze(1)) & (par.unsqueeze(2) >= 0)  # [bs, i, j]
    later = j.view(1, 1, N) > j.view(1, N, 1)
    nxt = torch.where(same & later, j.view(1, 1, N), none).amin(-1)
    first = torch.where(first == N, torch.full_like(first, -1), first)
    nxt = torch.where(nxt == N, torch.full_like(nxt, -1), nxt)
    return first, nxt


def path_from_accept_index(accept_index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Inverse of :func:`accept_index_from_path`: flat rows [bs, W] (-1 padded) -> slots int32."""
    bs = accept_index.shape[0]
    base = torch.arange(bs, device=accept_index.device, dtype=torch.int64).unsqueeze(1) * num_slots
    slots = accept_index.to(torch.int64) - base
    return torch.where(accept_index >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)


def counterfactual_accept_len(path: torch.Tensor, budgets) -> torch.Tensor:
    """Greedy accept length every smaller budget would have given this round, for free.

    path [bs, W] (root first, -1 padded; the accepted slots of a budget-b tree); budgets: ints or a
    [nb] tensor, each <= b -> [bs, nb] int32.  The first b' pops of a best-first tree of budget b are
    exactly the budget-b' tree (same slots, same order; a rank-r node needs r earlier siblings, so
    top-K = b' loses nothing), and slot numbers increase along a path, so the budget-b' tree accepts
    exactly the leading accepted nodes with slot <= b': their count.  Static shapes, no host sync.
    """
    b = torch.as_tensor(budgets, device=path.device).to(torch.int64).view(1, 1, -1)
    nodes = path[:, 1:].to(torch.int64).unsqueeze(-1)
    return ((nodes >= 1) & (nodes <= b)).sum(1).to(torch.int32)


def commit_path_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix: torch.Tensor,
                      path: torch.Tensor, num_slots: int) -> None:
    """Commit the accepted path by reordering KV slot *locations*, not KV data (page size 1).

    The verify wrote the K/V of tree slot i at ``req_to_token[r, prefix_r + i]`` for i < N; the
    accepted slots ``path[r, 0..a]`` (root first, -1 padded; slot ``path[r, k]`` has depth k) must end
    up at positions ``prefix_r + k``.  Instead of copying every layer's K/V rows there (SGLang's
    ``move_accept_tokens_to_target_kvcache``: two indexing ops per layer), permute the row segment
    ``req_to_token[r, prefix_r : prefix_r + N]`` in place: the path's locations first, in path order,
    then the other slots' locations in slot order.  The request owns the same locations as before
    (a permutation), so freeing and radix caching stay exact; the rejected slots' locations sit
    after the committed length, where the next round writes.  req_to_token [R, L] int32,
    req_pool_indices / prefix [bs], path [bs, W] int, N = num_slots.  In place, no host sync."""
    bs, W = path.shape
    N = int(num_slots)
    if N <= 1 or bs == 0:
        return
    dev = path.device
    valid = path >= 0
    slot_col = torch.where(valid, path.to(torch.int64), torch.full_like(path, N, dtype=torch.int64))
    depth = torch.arange(W, device=dev, dtype=torch.int64).expand(bs, W)
    # key of slot i: its depth on the path, else N + i; column N is a dump for the padding entries
    key = (N + torch.arange(N + 1, device=dev, dtype=torch.int64)).repeat(bs, 1)
    key.scatter_(1, slot_col, torch.where(valid, depth, torch.full_like(depth, 2 * N + 1)))
    order = torch.argsort(key[:, :N], dim=1)                                   # [bs, N] slots
    rows = req_pool_indices.to(torch.int64).view(bs, 1)
    cols = prefix.to(torch.int64).view(bs, 1) + torch.arange(N, device=dev, dtype=torch.int64)
    locs = req_to_token[rows, cols]
    req_to_token[rows, cols] = torch.gather(locs, 1, order)
