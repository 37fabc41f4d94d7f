"""commit_round: the fused commit kernel against its reference (the worker's former composition of
Accept.new_tokens, tree_ops.commit_path_slots, the block_loc gather and gather_path_rows), on real
trees and accepts drawn fresh each run, request rows at random pool indices and prefixes of a
req_to_token whose locations are all distinct; outputs poisoned before the kernel runs."""
import pytest
import torch

from helpers import drafter_logits, logprobs_from_logits
from sglang_ddtree import ddtree, tree_ops

V = 40


def _tree_and_accept(rng, device, bs, N, W, chain=False):
    """A reference tree (budget N - 1, depth W - 1) per request and the reference greedy accept of
    a target that follows the root path to a random node (to the deepest one on odd rows)."""
    D, budget = W - 1, N - 1
    lp, ids = logprobs_from_logits(drafter_logits(bs, D, V, rng), max(1, min(budget, V)))
    if chain:   # top-1 far ahead at every depth: the tree holds the full-depth top-1 chain
        lp = torch.where(torch.arange(lp.shape[-1]) == 0, torch.full_like(lp, -0.01), lp - 20.0)
    roots = torch.randint(0, V, (bs,), generator=rng)
    tree = ddtree.build_tree(lp, ids, budget, root_tokens=roots, backend="reference")
    target = torch.randint(0, V, (bs, N), generator=rng)
    par, tok = tree.parent, tree.tokens
    for b in range(bs):
        real = [0] + [j for j in range(1, N) if par[b, j] >= 0]
        node = (max(real, key=lambda j: int(tree.depth[b, j])) if b % 2
                else real[int(torch.randint(0, len(real), (), generator=rng))])
        while node > 0:
            target[b, par[b, node]] = tok[b, node]
            node = int(par[b, node])
    acc = ddtree.accept_greedy(tree, target, backend="reference")
    dev = torch.device(device)
    tree.tokens = tree.tokens.to(dev)
    return tree, ddtree.Accept(acc.accept_len.to(dev), acc.path.to(dev), acc.bonus.to(dev))


def _kv_rows(rng, device, bs, N, B, prefix_dtype=torch.int64):
    """req_to_token [R, L] int32 of distinct locations, bs distinct rows, prefixes leaving room."""
    R, L = bs + 1 + int(torch.randint(0, 4, (), generator=rng)), max(N, B) + 40
    r2t = (torch.randperm(R * L, generator=rng).view(R, L) + 1).to(torch.int32)
    pool = torch.randperm(R, generator=rng)[:bs]
    prefix = torch.randint(0, L - max(N, B) + 1, (bs,), generator=rng).to(prefix_dtype)
    return r2t.to(device), pool.to(device), prefix.to(device)


def _poisoned(bs, W, B, prefix_dtype, device):
    full = lambda shape, dt: torch.full(shape, -7, dtype=dt, device=device)  # noqa: E731
    return ddtree.RoundCommit(full((bs, W), torch.int64), full((bs,), torch.int32), full((bs,), prefix_dtype),
                              full((bs * W,), torch.int64), None if B is None else full((bs, B), torch.int64))


def _check(tree, acc, r2t, pool, prefix, B, remap=True):
    """Kernel (poisoned outputs) vs reference (fresh outputs, its own copy of req_to_token); then the
    stated semantics on the kernel's result."""
    bs, N = tree.tokens.shape
    W = acc.path.shape[1]
    before = r2t.clone()
    r2t_ref = r2t.clone()
    want = ddtree.commit_round(tree, acc, prefix, pool, r2t_ref, remap=remap, block_size=B, backend="reference")
    got = ddtree.commit_round(tree, acc, prefix, pool, r2t, remap=remap,
                              out=_poisoned(bs, W, B, prefix.dtype, prefix.device))
    for name in ("out_tokens", "commit_lens", "new_seq_lens", "hidden_rows", "block_loc"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None) == (name == "block_loc" and B is None), name
        if g is not None:
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()), name
    assert torch.equal(r2t.cpu(), r2t_ref.cpu())
    # the semantics, request by request
    r2t, before, a = r2t.cpu(), before.cpu(), acc.accept_len.cpu()
    path, toks, bonus = acc.path.cpu(), tree.tokens.cpu(), acc.bonus.cpu()
    for b in range(bs):
        r, p, n = int(pool[b]), int(prefix[b]), int(a[b])
        assert got.out_tokens[b].tolist() == ([int(toks[b, path[b, k]]) for k in range(1, n + 1)]
                                              + [int(bonus[b])] + [0] * (W - n - 1))
        assert int(got.commit_lens[b]) == n + 1 and int(got.new_seq_lens[b]) == p + n + 1
        assert got.hidden_rows.view(bs, W)[b].tolist() == [b * N + max(int(s), 0) for s in path[b]]
        seg, old = r2t[r, p:p + N], before[r, p:p + N]
        assert torch.equal(r2t[r, :p], before[r, :p]) and torch.equal(r2t[r, p + N:], before[r, p + N:])
        assert sorted(seg.tolist()) == sorted(old.tolist())                         # a permutation
        if remap and N > 1:
            on = [int(s) for s in path[b, :n + 1]]
            assert seg.tolist() == [int(old[s]) for s in on + [s for s in range(N) if s not in on]]
        else:
            assert torch.equal(seg, old)
        if B is not None:
            assert got.block_loc[b].tolist() == r2t[r, p:p + B].tolist()
    rows = torch.ones(r2t.shape[0], dtype=torch.bool)
    rows[pool.cpu()] = False
    assert torch.equal(r2t[rows], before[rows])                                     # other requests
    return got


@pytest.mark.parametrize("N", [1, 2, 8, 9, 16, 32, 64])
@pytest.mark.parametrize("B", [8, 16])
def test_kernel_matches_reference(rng, device, N, B):
    for W in sorted({2, 3, int(torch.randint(2, 17, (), generator=rng)), 16}):
        bs = int(torch.randint(1, 10, (), generator=rng))
        tree, acc = _tree_and_accept(rng, device, bs, N, W)
        r2t, pool, prefix = _kv_rows(rng, device, bs, N, B)
        _check(tree, acc, r2t, pool, prefix, B)


def test_accept_zero_and_full_depth(rng, device):
    """Row 0 accepts nothing (its target matches no child of the root); the others walk the
    full-depth top-1 chain (accept_len = D); prefix int32, block narrower and wider than N."""
    bs, N, W = 5, 24, 8
    tree, acc = _tree_and_accept(rng, device, bs, N, W, chain=True)
    tgt = torch.full((bs, N), V, dtype=torch.int64)            # V: no tree token
    chain = [0]
    for _ in range(W - 1):                                      # the top-1 chain of every row
        chain.append([j for j in range(N) if tree.parent[:, j].eq(chain[-1]).all()
                      and tree.depth[:, j].eq(len(chain)).all()][0])
    for b in range(1, bs):
        for d in range(W - 1):
            tgt[b, chain[d]] = tree.tokens[b, chain[d + 1]].cpu()
    acc = ddtree.accept_greedy(ddtree.Tree(**{**tree.__dict__, "tokens": tree.tokens.cpu()}), tgt,
                               backend="reference")
    assert acc.accept_len.tolist() == [0] + [W - 1] * (bs - 1)
    acc = ddtree.Accept(*(t.to(device) for t in (acc.accept_len, acc.path, acc.bonus)))
    for B in (4, 8, 32):
        r2t, pool, prefix = _kv_rows(rng, device, bs, N, B, prefix_dtype=torch.int32)
        got = _check(tree, acc, r2t, pool, prefix, B)
        assert got.new_seq_lens.dtype == torch.int32
        assert got.out_tokens[0].tolist() == [int(acc.bonus[0])] + [0] * (W - 1)


def test_move_mode_and_no_block_loc_leave_req_to_token_alone(rng, device):
    bs, N, W = 4, 16, 6
    tree, acc = _tree_and_accept(rng, device, bs, N, W)
    for remap, B in ((False, None), (False, 8), (True, None)):
        r2t, pool, prefix = _kv_rows(rng, device, bs, N, 8)
        _check(tree, acc, r2t, pool, prefix, B, remap=remap)


def test_hidden_rows_select_what_gather_path_rows_gathers(rng, device):
    bs, N, W = 6, 9, 5
    tree, acc = _tree_and_accept(rng, device, bs, N, W)
    r2t, pool, prefix = _kv_rows(rng, device, bs, N, 8)
    got = ddtree.commit_round(tree, acc, prefix, pool, r2t)
    hidden = torch.randint(-1000, 1000, (bs * N, 7), generator=rng).to(device)
    assert torch.equal(hidden.index_select(0, got.hidden_rows), tree_ops.gather_path_rows(hidden, acc.path))


def test_out_buffers_checked(rng, device):
    bs, N, W = 2, 8, 4
    tree, acc = _tree_and_accept(rng, device, bs, N, W)
    r2t, pool, prefix = _kv_rows(rng, device, bs, N, 8)
    bad = ddtree.RoundCommit(commit_lens=torch.zeros(bs, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="out.commit_lens"):
        ddtree.commit_round(tree, acc, prefix, pool, r2t, out=bad)
    with pytest.raises(ValueError, match="block_size"):
        ddtree.commit_round(tree, acc, prefix, pool, r2t, block_size=4,
                            out=ddtree.RoundCommit(block_loc=torch.zeros(bs, 8, dtype=torch.int64, device=device)))
    assert ddtree.commit_round(tree, acc, prefix, pool, r2t).block_loc is None
