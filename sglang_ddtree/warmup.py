"""Start-up warm-up of the per-round kernels: every Triton specialisation a round can hit (verify
width x batch-size bucket) compiled or loaded before the first request, so no width first used
mid-serving stalls the batch."""
from __future__ import annotations

from typing import Optional

import torch

from . import ddtree


def warm_batch_sizes(max_bs: int):
    """Batch sizes that reach every Triton specialisation a per-round kernel can take on the batch
    size: each power of two P <= max_bs (``next_power_of_2(bs)`` constexprs), and P // 2 + 1, the
    smallest size of P's bucket (an int argument equal to 1 or divisible by 16 is its own
    specialisation, so a bucket holds a divisible and a non-divisible size from 16 up)."""
    out, p = set(), 1
    while p // 2 + 1 <= max_bs:   # every bucket (P/2, P] that holds a size <= max_bs
        out.update({p, p // 2 + 1})
        m = (p // 2 // 16 + 1) * 16           # the bucket's smallest multiple of 16
        if m <= min(p, max_bs):
            out.add(m)
        p *= 2
    out.add(int(max_bs))
    return sorted(b for b in out if 1 <= b <= max_bs)


def warm_round_kernels(*, widths, block_size: int, topk: int, vocab_size: int, max_bs: int,
                       tree_backend: str, full_mask: bool, device, req_to_token=None,
                       assign_locs=None, kv_commit: str = "remap", tree_max_bs: Optional[int] = None) -> dict:
    """Run every per-round kernel once per (verify width, batch-size bucket), and SGLang's
    ``assign_extend_cache_locs`` once per bucket, on throwaway inputs at start-up.

    A Triton kernel's first launch with a new set of constexpr / specialisation values compiles it
    (or loads it from the disk cache) inside the scheduler process: tens of ms to a second during
    which no request advances.  Ours take N-dependent constexprs (``build_tree`` / ``tree_mask`` /
    ``accept_greedy`` / ``commit_round``: the next power of two of N; N itself specialised when 1 or
    divisible by 16) and ``verify_mask`` a batch-size one; ``commit_round`` also specialises on the
    row length of ``req_to_token`` (its stride) and on ``kv_commit`` / whether it writes the drafter's
    slots (N > 1 under remap), as the round calls it; SGLang's ``assign_extend_cache_locs``
    specialises on ``next_power_of_2(bs)`` and the row length of ``req_to_token`` (hence the zero
    row here).  With the adaptive budget every width first used mid-serving would stall the batch.
    widths: verify widths (1 = no speculation: only the commit runs), width 1 at batch
    sizes up to ``max_bs``, tree widths (and ``assign_locs``) up to ``tree_max_bs`` (default
    ``max_bs``: the tree widths' CUDA graphs stop there, ``spec_algo.SPEC_GRAPH_MAX_BS``, and past
    them the policy runs no tree).  Returns {"widths", "batch_sizes", "tree_batch_sizes", "s"}."""
    import time as _time

    t0 = _time.perf_counter()
    D, dev = block_size - 1, device
    sizes = warm_batch_sizes(int(max_bs))
    tree_sizes = warm_batch_sizes(min(int(max_bs), int(tree_max_bs or max_bs)))
    K = max(1, min(int(topk), int(vocab_size)))
    widths = sorted({int(w) for w in widths if int(w) >= 1})
    row = (torch.zeros(1, req_to_token.shape[1], dtype=req_to_token.dtype, device=dev)
           if req_to_token is not None else
           torch.zeros(1, max([block_size, *widths]), dtype=torch.int32, device=dev))
    remap = kv_commit == "remap"
    for N in widths:
        for b in (sizes if N == 1 else tree_sizes):
            zeros = torch.zeros(b, dtype=torch.int64, device=dev)
            if N > 1:
                lp = torch.randn(b, D, K, device=dev).log_softmax(-1).sort(-1, descending=True).values
                ids = torch.randint(0, int(vocab_size), (b, D, K), device=dev, dtype=torch.int64)
                tree = ddtree.build_tree(lp, ids, N - 1, root_tokens=zeros, backend=tree_backend,
                                         validate=False)
                if full_mask:
                    ddtree.verify_mask(tree, torch.ones(b, dtype=torch.int64, device=dev),
                                       backend=tree_backend, validate=False)
                acc = ddtree.accept_greedy(tree, torch.zeros(b, N, dtype=torch.int64, device=dev),
                                           backend=tree_backend, validate=False)
            else:   # no speculation: no accept kernel (ddtree.root_only_accept)
                tree = ddtree.root_only_tree(zeros, D)
                acc = ddtree.root_only_accept(zeros.view(b, 1), D)
            # every request on the one zero row: the (throwaway) permutation moves zeros
            ddtree.commit_round(tree, acc, zeros, zeros, row, remap=remap,
                                block_size=block_size if remap and N > 1 else None, backend=tree_backend)
    if assign_locs is not None and req_to_token is not None:
        for b in tree_sizes:
            zeros = torch.zeros(b, dtype=torch.int64, device=dev)
            assign_locs(req_pool_indices=zeros, req_to_token=row, start_offset=zeros,
                        end_offset=zeros + 1, batch_size=b, draft_token_num=1, device=dev)
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()
    return {"widths": widths, "batch_sizes": sizes, "tree_batch_sizes": tree_sizes,
            "s": round(_time.perf_counter() - t0, 3)}
