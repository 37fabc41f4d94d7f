"""DDTree tree API: top-k log-probs, best-first tree build, greedy accept.

Shapes: ``bs`` requests, ``D`` draft depth (block size - 1), ``K`` top-k width,
``N = budget + 1`` tree slots (slot 0 is the root).

``backend="triton"`` runs the Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``);
outputs stay on the input's device and the path has no host synchronisation when
``validate=False``.  ``backend="reference"`` is the exact CPU implementation (numpy +
heapq, one request at a time), the oracle of the tests and the CPU-heap baseline of the
benchmarks; it copies to the host and back.

``validate=True`` (the default, meant for use off the hot path) also checks values
(NaN, +inf, unsorted rows), which needs a host sync; shape, dtype and argument checks
are always done and cost nothing on the device.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np
import torch

from . import reference as _ref

__all__ = ["Tree", "Accept", "topk_logprobs", "build_tree", "tree_mask", "verify_mask",
           "accept_greedy", "accept_sampled", "RoundCommit", "commit_round", "tree_verify_attention",
           "tree_verify_attention_mla"]

_BACKENDS = ("triton", "reference")
_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass
class Tree:
    """A batch of draft trees with ``N = budget + 1`` static slots.

    tokens [bs, N] int64 (slot 0 = root token or -1, padding -1); depth [bs, N] int32 (root 0);
    parent [bs, N] int32 (root and padding -1); num_nodes [bs] int32 (root included);
    visibility [bs, N, N] bool (row i: ancestors of i and i itself);
    mask_words [bs, N, ceil(N/32)] int32 (visibility bit-packed, bit j of word w = column 32w+j).
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    num_nodes: torch.Tensor
    visibility: torch.Tensor
    mask_words: torch.Tensor
    budget: int
    draft_depth: int

    def positions(self, start: torch.Tensor) -> torch.Tensor:
        """Position ids of every slot: ``start [bs] + depth`` -> [bs, N] int64."""
        return start.reshape(-1, 1).to(torch.int64) + self.depth.to(torch.int64)


@dataclasses.dataclass
class Accept:
    """accept_len [bs] int32 (accepted non-root nodes); path [bs, D+1] int32 (slots, root first,
    -1 padded); bonus [bs] int64 (the target's token after the last accepted node)."""

    accept_len: torch.Tensor
    path: torch.Tensor
    bonus: torch.Tensor

    def new_tokens(self, tree: Tree) -> torch.Tensor:
        """Tokens this round commits, [bs, D+1] int64: accepted path tokens then the bonus, -1 padded."""
        bs, width = self.path.shape
        idx = self.path[:, 1:].clamp(min=0).to(torch.int64)
        toks = torch.gather(tree.tokens, 1, idx)
        cols = torch.arange(width - 1, device=toks.device).unsqueeze(0)
        alen = self.accept_len.to(torch.int64).unsqueeze(1)
        out = torch.full((bs, width), -1, dtype=torch.int64, device=toks.device)
        out[:, :-1] = torch.where(cols < alen, toks, torch.full_like(toks, -1))
        out.scatter_(1, alen, self.bonus.unsqueeze(1))
        return out


def _check_backend(backend: str, *tensors: torch.Tensor) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "triton":
        for t in tensors:
            if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
                raise ValueError(
                    f"backend='triton' needs CUDA tensors (got {t.device}); on a machine without "
                    "a GPU set TRITON_INTERPRET=1 before importing sglang_ddtree.kernels, or use "
                    "backend='reference'")


def _check_tensor(name: str, t, ndim: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def topk_logprobs(logits: torch.Tensor, k: int, *, backend: str = "triton", validate: bool = True,
                  out=None):
    """Per-row top-k of the log-softmax, in one pass over the vocabulary.

    logits [bs, D, V] bf16/fp16/fp32 -> (log_probs [bs, D, k] fp32, token_ids [bs, D, k] int64);
    values = top-k logits minus the fp32 logsumexp over all V; rows sorted descending; equal
    logits ordered by smaller token id.
    """
    _check_tensor("logits", logits, 3, _LOGIT_DTYPES)
    k = _check_int("k", k, 1)
    bs, D, V = logits.shape
    if k > V:
        raise ValueError(f"k must be <= vocabulary size {V}, got {k}")
    _check_backend(backend, logits)
    if validate and logits.numel():
        if torch.isnan(logits).any():
            raise ValueError("logits contain NaN")
        if (logits == float("inf")).any():
            raise ValueError("logits contain +inf")
        if V and (logits == float("-inf")).all(dim=-1).any():
            raise ValueError("a row of logits is entirely -inf (no distribution)")
    if backend == "reference":
        lp, ids = _ref.topk_logprobs_ref(logits.detach().float().cpu().numpy(), k)
        return (torch.from_numpy(lp).to(logits.device), torch.from_numpy(ids).to(logits.device))
    from .kernels.topk_logprobs import topk_logprobs_triton
    flat_out = None
    if out is not None:
        flat_out = (out[0].view(bs * D, k), out[1].view(bs * D, k))
    lp, ids = topk_logprobs_triton(logits.reshape(bs * D, V), k, out=flat_out)
    return lp.view(bs, D, k), ids.view(bs, D, k)


def _validate_tree_inputs(log_probs, token_ids, budget, root_tokens, validate):
    _check_tensor("log_probs", log_probs, 3, (torch.float32,))
    _check_tensor("token_ids", token_ids, 3, (torch.int64,))
    if token_ids.shape != log_probs.shape:
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} != log_probs shape "
                         f"{tuple(log_probs.shape)}")
    if token_ids.device != log_probs.device:
        raise ValueError("log_probs and token_ids must be on the same device")
    budget = _check_int("budget", budget, 0)
    bs, D, K = log_probs.shape
    if K < 1:
        raise ValueError("log_probs must have k >= 1 columns")
    if D == 0 and budget > 0:
        raise ValueError("draft depth D (log_probs.shape[1]) is 0 but budget > 0")
    if root_tokens is not None:
        _check_tensor("root_tokens", root_tokens, 1, (torch.int64,))
        if root_tokens.shape[0] != bs:
            raise ValueError(f"root_tokens must have shape [{bs}], got {tuple(root_tokens.shape)}")
        if root_tokens.device != log_probs.device:
            raise ValueError("root_tokens must be on the same device as log_probs")
    if validate and log_probs.numel():
        if torch.isnan(log_probs).any():
            raise ValueError("log_probs contain NaN")
        if (log_probs == float("inf")).any():
            raise ValueError("log_probs contain +inf")
        if K > 1 and (log_probs[..., 1:] > log_probs[..., :-1]).any():
            raise ValueError("log_probs rows must be sorted in descending order")
        if (token_ids < 0).any():
            raise ValueError("token_ids must be >= 0")
    return budget


def build_tree(log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int, *,
               root_tokens: Optional[torch.Tensor] = None, backend: str = "triton",
               validate: bool = True, out: Optional[Tree] = None) -> Tree:
    """Best-first DDTree of ``budget`` nodes (+ root) from per-depth top-k log-probs.

    log_probs [bs, D, K] fp32 sorted descending per row, token_ids [bs, D, K] int64,
    root_tokens [bs] int64 or None.  Equals the reference heap node for node (fp64 score
    updates, ties broken by the lexicographically smaller rank path).
    ``out``: a preallocated Tree of the same shapes to write into (CUDA graphs).
    """
    budget = _validate_tree_inputs(log_probs, token_ids, budget, root_tokens, validate)
    _check_backend(backend, log_probs)
    bs, D, K = log_probs.shape
    if backend == "reference":
        r = _ref.build_tree_ref(log_probs.cpu().numpy(), token_ids.cpu().numpy(), budget,
                                None if root_tokens is None else root_tokens.cpu().numpy())
        dev = log_probs.device
        return Tree(**{k: torch.from_numpy(np.ascontiguousarray(r[k])).to(dev)
                       for k in ("tokens", "depth", "parent", "num_nodes", "visibility",
                                 "mask_words")}, budget=budget, draft_depth=D)
    from .kernels.tree_build import build_tree_triton
    from .kernels.tree_mask import tree_mask_triton
    if out is not None:
        _check_out_tree(out, bs, budget)
    tokens, depth, parent, num_nodes = build_tree_triton(
        log_probs, token_ids, budget, root_tokens,
        out=None if out is None else (out.tokens, out.depth, out.parent, out.num_nodes))
    vis, words = tree_mask_triton(parent, D, out=None if out is None else (out.visibility, out.mask_words))
    return Tree(tokens, depth, parent, num_nodes, vis, words, budget=budget, draft_depth=D)


def _check_out_tree(out: Tree, bs: int, budget: int) -> None:
    N = budget + 1
    if out.tokens.shape != (bs, N) or out.visibility.shape != (bs, N, N):
        raise ValueError(f"out tree has shape {tuple(out.tokens.shape)}, expected {(bs, N)}")


def tree_mask(parent: torch.Tensor, max_depth: int, *, backend: str = "triton"):
    """Ancestor-only mask of a parent array [bs, N] int32 -> (visibility bool, mask_words int32)."""
    _check_tensor("parent", parent, 2, (torch.int32,))
    max_depth = _check_int("max_depth", max_depth, 0)
    _check_backend(backend, parent)
    if backend == "reference":
        vis = _ref.tree_visibility_ref(parent.cpu().numpy())
        return (torch.from_numpy(vis).to(parent.device),
                torch.from_numpy(_ref.pack_visibility(vis)).to(parent.device))
    from .kernels.tree_mask import tree_mask_triton
    return tree_mask_triton(parent, max_depth)


def verify_mask(tree: Tree, seq_lens: torch.Tensor, *, mode: str = "full",
                out: Optional[torch.Tensor] = None, backend: str = "triton",
                validate: bool = True) -> torch.Tensor:
    """The tree's verify mask, flattened the way SGLang's attention backends read it.

    seq_lens [bs] int32/int64: committed prefix length of each request (the tokens before the
    root's block).  ``mode="full"``: per request ``N`` rows of ``seq_len + N`` (prefix all
    visible, then the ancestor-only tree part), requests back to back (SGLang's FULL_MASK /
    triton-backend ``custom_mask`` with ``mask_indptr``); ``mode="qlen"``: the tree part only.
    Returns ``out`` (bool; allocated when None, which needs the total size: a host sync).
    """
    if not isinstance(tree, Tree):
        raise ValueError(f"tree must be a Tree, got {type(tree).__name__}")
    if mode not in ("full", "qlen"):
        raise ValueError(f"mode must be 'full' or 'qlen', got {mode!r}")
    _check_tensor("seq_lens", seq_lens, 1, (torch.int32, torch.int64))
    bs, N = tree.tokens.shape
    if seq_lens.shape[0] != bs:
        raise ValueError(f"seq_lens must have shape [{bs}], got {tuple(seq_lens.shape)}")
    if seq_lens.device != tree.tokens.device:
        raise ValueError("seq_lens must be on the tree's device")
    _check_backend(backend, seq_lens)
    from .kernels.verify_mask import verify_mask_size
    need = None
    if out is None or validate:
        if (seq_lens < 0).any():
            raise ValueError("seq_lens must be >= 0")
        need = verify_mask_size(int(seq_lens.sum()), bs, N, mode)
    if out is None:
        out = torch.empty(need, dtype=torch.bool, device=seq_lens.device)
    elif out.dim() != 1 or out.dtype not in (torch.bool, torch.uint8):
        raise ValueError("out must be a 1-D bool or uint8 tensor")
    elif need is not None and out.numel() < need:
        raise ValueError(f"out has {out.numel()} elements, the mask needs {need}")
    if backend == "reference":
        from .kernels.verify_mask import verify_mask_torch
        ref = verify_mask_torch(tree.visibility.cpu(), seq_lens.cpu(), mode)
        out[: ref.numel()] = ref.to(out.device, out.dtype)
        return out
    from .kernels.verify_mask import verify_mask_triton
    return verify_mask_triton(tree.mask_words, seq_lens, out, mode)


def accept_greedy(tree: Tree, target_tokens: torch.Tensor, *, backend: str = "triton",
                  validate: bool = True, out: Optional[Accept] = None) -> Accept:
    """Longest root path whose tokens match the target's argmax at each parent.

    target_tokens [bs, N] int64: the target's greedy choice at every tree slot.
    """
    if not isinstance(tree, Tree):
        raise ValueError(f"tree must be a Tree, got {type(tree).__name__}")
    _check_tensor("target_tokens", target_tokens, 2, (torch.int64,))
    if target_tokens.shape != tree.tokens.shape:
        raise ValueError(f"target_tokens shape {tuple(target_tokens.shape)} != tree shape "
                         f"{tuple(tree.tokens.shape)}")
    if target_tokens.device != tree.tokens.device:
        raise ValueError("target_tokens must be on the tree's device")
    _check_backend(backend, target_tokens)
    if validate and target_tokens.numel() and (target_tokens < 0).any():
        raise ValueError("target_tokens must be >= 0")
    D = tree.draft_depth
    if backend == "reference":
        a, p, bonus = _ref.accept_greedy_ref(tree.tokens.cpu().numpy(), tree.parent.cpu().numpy(),
                                             target_tokens.cpu().numpy(), D)
        dev = target_tokens.device
        return Accept(torch.from_numpy(a).to(dev), torch.from_numpy(p).to(dev),
                      torch.from_numpy(bonus).to(dev))
    from .kernels.accept_greedy import accept_greedy_triton
    res = accept_greedy_triton(tree.tokens, tree.parent, target_tokens, D,
                               out=None if out is None else (out.accept_len, out.path, out.bonus))
    return Accept(*res)


def accept_sampled(tree: Tree, target_probs: torch.Tensor, uniforms: torch.Tensor, *,
                   backend: str = "triton", validate: bool = True,
                   out: Optional[Accept] = None) -> Accept:
    """Lossless sampled accept (temperature > 0): walk from the root, drawing the target's token
    at every visited node by inverse CDF with one coin per depth.

    target_probs [bs * N, V] or [bs, N, V] fp32: the target's next-token distribution at each slot
    (temperature / top-k / top-p applied, normalised; rows need not sum to exactly 1: the coin
    is scaled by the row's mass).  uniforms [bs, D + 1] fp32 in [0, 1): coin ``step`` draws at the
    node reached after ``step`` accepted steps (the caller draws them, e.g. with torch.rand, so
    the call holds no RNG state and is CUDA-graph safe).  A draw that is a child's token accepts
    that child; any other draw (or the draw at a leaf or at depth D) is the bonus.  Every
    emitted token is one exact draw from the target's row at its parent node, so the output
    has the target's own distribution for any tree.  Exact semantics:
    ``sglang_ddtree.kernels.accept_sampled`` (the kernel and its reference agree bit for bit).
    """
    if not isinstance(tree, Tree):
        raise ValueError(f"tree must be a Tree, got {type(tree).__name__}")
    bs, N = tree.tokens.shape
    D = tree.draft_depth
    if not isinstance(target_probs, torch.Tensor):
        raise ValueError(f"target_probs must be a torch.Tensor, got {type(target_probs).__name__}")
    if target_probs.dtype != torch.float32:
        raise ValueError(f"target_probs must have dtype torch.float32, got {target_probs.dtype}")
    if target_probs.dim() == 2:
        if target_probs.shape[0] != bs * N:
            raise ValueError(f"target_probs must have shape [bs * N = {bs * N}, V], got "
                             f"{tuple(target_probs.shape)}")
    elif target_probs.dim() == 3:
        if tuple(target_probs.shape[:2]) != (bs, N):
            raise ValueError(f"target_probs must have shape [{bs}, {N}, V], got "
                             f"{tuple(target_probs.shape)}")
    else:
        raise ValueError(f"target_probs must have 2 or 3 dimensions, got shape "
                         f"{tuple(target_probs.shape)}")
    V = target_probs.shape[-1]
    if V < 1:
        raise ValueError("target_probs must have a vocabulary of at least 1 column")
    _check_tensor("uniforms", uniforms, 2, (torch.float32,))
    if tuple(uniforms.shape) != (bs, D + 1):
        raise ValueError(f"uniforms must have shape [{bs}, {D + 1}] (bs, D + 1), got "
                         f"{tuple(uniforms.shape)}")
    for name, t in (("target_probs", target_probs), ("uniforms", uniforms)):
        if t.device != tree.tokens.device:
            raise ValueError(f"{name} must be on the tree's device")
    _check_backend(backend, target_probs)
    if out is not None:
        if (not isinstance(out, Accept) or out.accept_len.shape != (bs,)
                or out.path.shape != (bs, D + 1) or out.bonus.shape != (bs,)
                or out.accept_len.dtype != torch.int32 or out.path.dtype != torch.int32
                or out.bonus.dtype != torch.int64):
            raise ValueError(f"out must be an Accept with accept_len [{bs}] int32, path "
                             f"[{bs}, {D + 1}] int32, bonus [{bs}] int64")
    if validate and bs:
        probs = target_probs.reshape(bs, N, V)
        if torch.isnan(probs).any():
            raise ValueError("target_probs contain NaN")
        if torch.isinf(probs).any():
            raise ValueError("target_probs contain inf")
        if (probs < 0).any():
            raise ValueError("target_probs must be >= 0")
        if (probs > 1 + 1e-5).any():
            raise ValueError("target_probs must be probabilities (<= 1)")
        real = tree.parent >= 0
        real[:, 0] = True
        if ((probs.sum(-1) <= 0) & real).any():
            raise ValueError("target_probs has a row of zero mass at a tree node")
        if torch.isnan(uniforms).any() or (uniforms < 0).any() or (uniforms >= 1).any():
            raise ValueError("uniforms must lie in [0, 1)")
    if backend == "reference":
        from .kernels.accept_sampled import accept_sampled_ref
        a, p, bonus = accept_sampled_ref(tree.tokens.cpu().numpy(), tree.parent.cpu().numpy(),
                                         target_probs.detach().cpu().numpy(),
                                         uniforms.cpu().numpy(), D)
        dev = target_probs.device
        res = (torch.from_numpy(a).to(dev), torch.from_numpy(p).to(dev),
               torch.from_numpy(bonus).to(dev))
        if out is None:
            return Accept(*res)
        for o, r in zip((out.accept_len, out.path, out.bonus), res):
            o.copy_(r)
        return out
    from .kernels.accept_sampled import accept_sampled_triton
    res = accept_sampled_triton(tree.tokens, tree.parent, target_probs, uniforms, D,
                                out=None if out is None else (out.accept_len, out.path, out.bonus))
    return Accept(*res)


@dataclasses.dataclass
class RoundCommit:
    """What a round commits (``commit_round``), per request b, ``W = D + 1``, ``B`` drafter block:
    out_tokens [bs, W] int64 (the accepted path's tokens, the bonus at column accept_len, then 0);
    commit_lens [bs] int32 (= accept_len + 1); new_seq_lens [bs] (prefix's dtype, = prefix +
    commit_lens); hidden_rows [bs * W] int64 (verify row ``b * N + path[b, i]`` per path position,
    the root's for padding: ``hidden.index_select(0, hidden_rows)``); block_loc [bs, B] or None
    (``req_to_token[r, prefix + j]`` after the commit: the drafter's context K/V slots)."""

    out_tokens: Optional[torch.Tensor] = None
    commit_lens: Optional[torch.Tensor] = None
    new_seq_lens: Optional[torch.Tensor] = None
    hidden_rows: Optional[torch.Tensor] = None
    block_loc: Optional[torch.Tensor] = None


def commit_round(tree: Tree, accept: Accept, prefix: torch.Tensor, req_pool_indices: torch.Tensor,
                 req_to_token: torch.Tensor, *, remap: bool = True, block_size: Optional[int] = None,
                 out: Optional[RoundCommit] = None, backend: str = "triton") -> RoundCommit:
    """Commit one round in one launch (``kernels/commit_round.py`` states it exactly).

    prefix [bs] int32/int64 (the committed length before the round: ``seq_lens``);
    req_to_token [R, L] (page size 1, the verify wrote slot i's K/V at ``req_to_token[r, prefix + i]``).
    ``remap``: permute ``req_to_token[r, prefix : prefix + N]`` so the accepted path's locations come
    first (``tree_ops.commit_path_slots``); ``block_size`` B: also return ``block_loc [bs, B]`` (after
    the remap).  ``out``: a RoundCommit whose non-None tensors are written (block_loc there asks for
    it with its width); the rest are allocated.  No host sync.
    """
    if not isinstance(tree, Tree) or not isinstance(accept, Accept):
        raise ValueError("commit_round needs a Tree and an Accept")
    bs, N = tree.tokens.shape
    W = accept.path.shape[1]
    for name, t, dt in (("prefix", prefix, (torch.int32, torch.int64)),
                        ("req_pool_indices", req_pool_indices, (torch.int32, torch.int64))):
        _check_tensor(name, t, 1, dt)
        if t.shape[0] != bs:
            raise ValueError(f"{name} must have shape [{bs}], got {tuple(t.shape)}")
    _check_tensor("req_to_token", req_to_token, 2, (torch.int32, torch.int64))
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")
    if (accept.accept_len.shape != (bs,) or accept.path.dim() != 2 or accept.path.shape[0] != bs
            or accept.accept_len.dtype != torch.int32 or accept.path.dtype != torch.int32):
        raise ValueError(f"accept must hold accept_len [{bs}] int32 and path [{bs}, W] int32")
    if accept.bonus.shape != (bs,) or accept.bonus.dtype != torch.int64:
        raise ValueError(f"accept.bonus must be [{bs}] int64")
    if any(t.device != prefix.device for t in (tree.tokens, accept.path, accept.accept_len, accept.bonus,
                                                req_pool_indices, req_to_token)):
        raise ValueError("commit_round's tensors must all be on prefix's device")
    out = RoundCommit() if out is None else out
    if out.block_loc is not None:
        if block_size is not None and out.block_loc.shape[1] != block_size:
            raise ValueError(f"out.block_loc has width {out.block_loc.shape[1]}, block_size is {block_size}")
        block_size = out.block_loc.shape[1]
    want = {"out_tokens": ((bs, W), torch.int64), "commit_lens": ((bs,), torch.int32),
            "new_seq_lens": ((bs,), prefix.dtype), "hidden_rows": ((bs * W,), torch.int64),
            "block_loc": (None if block_size is None else (bs, block_size), None)}
    bufs = []
    for name, (shape, dtype) in want.items():
        t = getattr(out, name)
        if t is None and shape is not None:
            t = torch.empty(shape, dtype=dtype or torch.int64, device=prefix.device)
        elif t is not None and (tuple(t.shape) != shape or not t.is_contiguous() or t.device != prefix.device
                                or dtype not in (None, t.dtype)):
            raise ValueError(f"out.{name} must be a contiguous {dtype or 'int'} tensor of shape {shape} "
                             f"on {prefix.device}")
        bufs.append(t)
    _check_backend(backend, prefix)
    from .kernels import commit_round as _cr

    fn = _cr.commit_round_reference if backend == "reference" else _cr.commit_round_triton
    res = fn(*(t.contiguous() for t in (tree.tokens, accept.path, accept.accept_len, accept.bonus, prefix,
                                        req_pool_indices)),
             req_to_token, remap=remap, block_size=block_size, out=tuple(bufs))
    return RoundCommit(*res)


# ------------------------------------------------------------------ tree-verify attention
def _attention_out(result: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return result
    if out.shape != result.shape or out.dtype != result.dtype or out.device != result.device:
        raise ValueError(f"out must be a {result.dtype} tensor of shape {tuple(result.shape)} on "
                         f"{result.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    out.copy_(result)
    return out


def tree_verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          prefix_lens: torch.Tensor, mask_words: torch.Tensor, sm_scale: float, *,
                          out: Optional[torch.Tensor] = None, backend: str = "triton",
                          num_splits: Optional[int] = None, max_prefix: Optional[int] = None,
                          workspace=None) -> torch.Tensor:
    """Attention of a tree verify over SGLang's paged KV (page size 1) -> ``[bs*N, Hq, Dv]``.

    q ``[bs*N, Hq, D]`` (request b's query i is row b*N + i); ``k_cache [S, Hkv, D]``, ``v_cache
    [S, Hkv, Dv]``; request b's slots are ``req_to_token[req_pool_indices[b], 0:prefix_lens[b]+N]``
    (the prefix, then the tree's own K/V); ``mask_words [bs, N, ceil(N/32)] int32`` =
    ``Tree.mask_words``.  Query i sees the whole prefix and the tree slots whose bit is set.
    GQA: query head h reads kv head ``h // (Hq // Hkv)``.  fp32 softmax / accumulation.
    ``backend="triton"``: split-KV kernel (prefix without a mask, the N x N tail from the bits, LSE
    merge; static shapes, CUDA-graph capturable; ``num_splits`` / ``max_prefix`` host ints fix the
    split count, ``workspace`` is its optional fp32 scratch); ``"reference"``: dense torch.
    """
    _check_backend(backend, q)
    from .kernels import tree_verify_attention as _tva

    if backend == "reference":
        return _attention_out(_tva.tree_verify_attention_torch(
            q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, mask_words, sm_scale), out)
    return _tva.tree_verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices,
                                      prefix_lens, mask_words, sm_scale, out=out,
                                      num_splits=num_splits, max_prefix=max_prefix,
                                      workspace=workspace)


def tree_verify_attention_mla(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor,
                              kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                              req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                              mask_words: torch.Tensor, sm_scale: float, *, kv_lora_rank: int,
                              out: Optional[torch.Tensor] = None, backend: str = "triton",
                              num_splits: Optional[int] = None, max_prefix: Optional[int] = None,
                              workspace=None) -> torch.Tensor:
    """The absorbed-MLA form (DeepseekV3 / Kimi K2 as SGLang's triton backend runs it) ->
    ``[bs*N, H, kv_lora_rank]``: ``kv_cache [S, 1, kv_lora_rank + rope_dim]`` is the one latent
    head every query head reads; score = ``sm_scale * (q_nope_absorbed . kv[:lora] + q_rope .
    kv[lora:])``, value = ``kv[:lora]``.  Other arguments as :func:`tree_verify_attention`."""
    _check_backend(backend, q_nope_absorbed)
    from .kernels import tree_verify_attention as _tva

    if backend == "reference":
        return _attention_out(_tva.tree_verify_attention_mla_torch(
            q_nope_absorbed, q_rope, kv_cache, req_to_token, req_pool_indices, prefix_lens,
            mask_words, sm_scale, kv_lora_rank=kv_lora_rank), out)
    return _tva.tree_verify_attention_mla(q_nope_absorbed, q_rope, kv_cache, req_to_token,
                                          req_pool_indices, prefix_lens, mask_words, sm_scale,
                                          kv_lora_rank=kv_lora_rank, out=out, num_splits=num_splits,
                                          max_prefix=max_prefix, workspace=workspace)


_ROOT_ONLY_CONST: dict = {}


def root_only_tree(root_tokens: torch.Tensor, draft_depth: int):
    """The tree of a no-speculation round: the root alone (N = 1; what ``build_tree`` gives for
    budget 0).  root_tokens [bs] int64 -> Tree with tokens [bs, 1], no drafter input needed.  The
    constant parts (depth, parent, num_nodes, visibility, mask_words) are cached per (bs, device):
    no-speculation rounds come at high load, where every launch of the round's host work counts;
    nothing downstream writes into them."""
    bs, dev = root_tokens.shape[0], root_tokens.device
    key = (int(bs), str(dev))
    const = _ROOT_ONLY_CONST.get(key)
    if const is None:
        const = (torch.zeros((bs, 1), dtype=torch.int32, device=dev),
                 torch.full((bs, 1), -1, dtype=torch.int32, device=dev),
                 torch.ones((bs,), dtype=torch.int32, device=dev),
                 torch.ones((bs, 1, 1), dtype=torch.bool, device=dev),
                 torch.ones((bs, 1, 1), dtype=torch.int32, device=dev))
        _ROOT_ONLY_CONST[key] = const
    depth, parent, num_nodes, visibility, mask_words = const
    return Tree(tokens=root_tokens.reshape(bs, 1).to(torch.int64), depth=depth, parent=parent,
                num_nodes=num_nodes, visibility=visibility, mask_words=mask_words,
                budget=0, draft_depth=int(draft_depth))


_ROOT_ONLY_ACCEPT: dict = {}


def root_only_accept(target_top1: torch.Tensor, draft_depth: int):
    """The greedy accept of a no-speculation round (N = 1): nothing accepted, the target's token at
    the root is the bonus.  target_top1 [bs, 1] int64 -> ddtree.Accept (accept_len [bs] int32 zeros,
    path [bs, D + 1] int32 ``[0, -1, ...]``, bonus [bs] int64: a view of target_top1), what
    ``ddtree.accept_greedy`` returns on :func:`root_only_tree` without its launch: accept_len and
    path are constants cached per (bs, D, device), read by the commit and the statistics, never
    written (so a no-speculation round launches no more than plain decoding's argmax here)."""
    bs, dev = target_top1.shape[0], target_top1.device
    key = (int(bs), int(draft_depth), str(dev))
    const = _ROOT_ONLY_ACCEPT.get(key)
    if const is None:
        path = torch.full((bs, int(draft_depth) + 1), -1, dtype=torch.int32, device=dev)
        path[:, 0] = 0
        const = (torch.zeros((bs,), dtype=torch.int32, device=dev), path)
        _ROOT_ONLY_ACCEPT[key] = const
    return Accept(accept_len=const[0], path=const[1], bonus=target_top1.reshape(bs).to(torch.int64))
