"""verify_mask: the flattened verify mask in SGLang 0.5.16's triton-backend layout, against an
expected mask built here in numpy, independently of kernels/verify_mask.py.

The expected mask comes from the tree's parent array alone (ancestor walk in plain Python; the
tree's own ``visibility`` must equal it) and the prefix lengths: per request ``b``, ``N`` rows of
``seq_lens[b] + N`` bytes, the prefix all 1, then row ``i`` of the N x N ancestor-only part
(``mode="full"``, FULL_MASK / ``custom_mask`` read through ``mask_indptr``); ``mode="qlen"`` is the
N x N part alone.  Requests back to back.  Trees, prefix lengths (0 included, some longer than
the kernel's 1024-wide prefix block), buffer offsets and poison bytes are drawn fresh each run.
"""
import numpy as np
import pytest
import torch

from helpers import drafter_logits, logprobs_from_logits
from sglang_ddtree import ddtree


def ancestors_numpy(parent):
    """[bs, N] parent -> [bs, N, N] bool: row i holds i and every ancestor (padding: only itself)."""
    bs, N = parent.shape
    vis = np.zeros((bs, N, N), dtype=bool)
    for b in range(bs):
        for i in range(N):
            j = i
            while j >= 0:
                vis[b, i, j] = True
                j = int(parent[b, j])
    return vis


def expected_mask(vis, seq_lens, mode):
    """The flattened mask as uint8, built row by row."""
    rows = []
    for b in range(vis.shape[0]):
        for i in range(vis.shape[1]):
            prefix = np.ones(int(seq_lens[b]) if mode == "full" else 0, dtype=np.uint8)
            rows.append(np.concatenate([prefix, vis[b, i].astype(np.uint8)]))
    return np.concatenate(rows) if rows else np.zeros(0, np.uint8)


def unpack_words(words, N):
    w = words.astype(np.int64) & 0xFFFFFFFF
    bits = (w[..., :, None] >> np.arange(32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :N].astype(bool)


def random_tree(rng, device):
    """A built DDTree (sometimes from a tiny vocabulary, so padding slots occur), or a random forest
    (parent[i] < i) run through ddtree.tree_mask: shapes best-first search does not make."""
    bs = int(torch.randint(1, 7, (1,), generator=rng))
    budget = int(torch.tensor([1, 2, 7, 31, 32, 33, 64])[torch.randint(0, 7, (1,), generator=rng)])
    D = int(torch.randint(1, 8, (1,), generator=rng))
    kind = int(torch.randint(0, 3, (1,), generator=rng))
    if kind < 2:
        V = 4 * budget if kind == 0 else int(torch.randint(2, 5, (1,), generator=rng))
        logits = drafter_logits(bs, D, V, rng).to(device)
        lp, ids = logprobs_from_logits(logits, min(budget, V))
        return ddtree.build_tree(lp, ids, budget), (kind, bs, budget, D)
    N = budget + 1
    parent = torch.full((bs, N), -1, dtype=torch.int32)
    depth = torch.zeros((bs, N), dtype=torch.int32)
    for b in range(bs):
        for i in range(1, N):
            if torch.rand(1, generator=rng) < 0.1:
                continue  # a padding-like slot: no parent
            cands = [j for j in range(i) if (j == 0 or parent[b, j] >= 0) and depth[b, j] < D]
            p = cands[int(torch.randint(0, len(cands), (1,), generator=rng))]
            parent[b, i], depth[b, i] = p, depth[b, p] + 1
    parent = parent.to(device)
    vis, words = ddtree.tree_mask(parent, D)
    tree = ddtree.Tree(torch.zeros((bs, N), dtype=torch.int64, device=device), depth.to(device), parent,
                       torch.full((bs,), N, dtype=torch.int32, device=device), vis, words, budget, D)
    return tree, (kind, bs, budget, D)


def random_seq_lens(bs, rng, dtype):
    lens = torch.randint(0, 40, (bs,), generator=rng)
    big = torch.rand(bs, generator=rng) < 0.3
    lens[big] = torch.randint(1000, 2600, (int(big.sum()),), generator=rng)
    lens[int(torch.randint(0, bs, (1,), generator=rng))] = 0  # an empty prefix is legal
    return lens.to(dtype)


@pytest.mark.parametrize("mode", ["full", "qlen"])
@pytest.mark.parametrize("trial", range(4))
def test_random_trees_and_prefixes(mode, trial, rng, device):
    tree, ctx = random_tree(rng, device)
    bs, N = tree.tokens.shape
    vis = ancestors_numpy(tree.parent.cpu().numpy())
    assert np.array_equal(tree.visibility.cpu().numpy(), vis), ctx
    assert np.array_equal(unpack_words(tree.mask_words.cpu().numpy(), N), vis), ctx
    seq_lens = random_seq_lens(bs, rng, (torch.int32, torch.int64)[trial % 2])
    want = expected_mask(vis, seq_lens.numpy(), mode)
    assert want.size == N * N * bs + (N * int(seq_lens.sum()) if mode == "full" else 0)
    seq_lens = seq_lens.to(device)
    # the kernel writes into a window of a larger poisoned buffer; bytes outside it stay as they were
    lead = int(torch.randint(0, 64, (1,), generator=rng))
    tail = int(torch.randint(1, 64, (1,), generator=rng))
    poison = torch.randint(2, 256, (lead + want.size + tail,), generator=rng, dtype=torch.uint8)
    for dtype in (torch.uint8, torch.bool):
        buf = poison.clone().to(device)
        out = buf[lead:]
        out = out if dtype == torch.uint8 else out.view(torch.bool)
        got = ddtree.verify_mask(tree, seq_lens, mode=mode, out=out)
        assert got.data_ptr() == out.data_ptr()
        raw = buf.cpu().numpy()
        assert np.array_equal(raw[lead:lead + want.size], want), (ctx, dtype, seq_lens.tolist())
        assert np.array_equal(raw[:lead], poison[:lead].numpy()), "wrote before the buffer's window"
        assert np.array_equal(raw[lead + want.size:], poison[lead + want.size:].numpy()), "wrote past the mask"
    alloc = ddtree.verify_mask(tree, seq_lens, mode=mode)
    assert alloc.dtype == torch.bool and np.array_equal(alloc.cpu().numpy().astype(np.uint8), want)
    ref = ddtree.verify_mask(tree, seq_lens, mode=mode, backend="reference")
    assert np.array_equal(ref.cpu().numpy().astype(np.uint8), want)


def test_hand_checked_layout(device):
    """Two requests, prefix lengths 2 and 1, a 3-slot tree: root -> a -> b (a chain)."""
    lp = torch.tensor([[[-0.1, -5.0], [-0.1, -5.0]]] * 2, device=device)
    ids = torch.tensor([[[4, 5], [6, 7]]] * 2, device=device)
    tree = ddtree.build_tree(lp, ids, 2)
    assert tree.parent.tolist() == [[-1, 0, 1]] * 2
    got = ddtree.verify_mask(tree, torch.tensor([2, 1], device=device)).cpu().int().tolist()
    want = ([1, 1, 1, 0, 0,
             1, 1, 1, 1, 0,
             1, 1, 1, 1, 1]
            + [1, 1, 0, 0,
               1, 1, 1, 0,
               1, 1, 1, 1])
    assert got == want


def test_hand_checked_siblings(device):
    """One request, prefix 1, root with two children: the siblings do not see each other."""
    lp = torch.tensor([[[-0.1, -0.2]]], device=device)
    ids = torch.tensor([[[4, 5]]], device=device)
    tree = ddtree.build_tree(lp, ids, 2)
    assert tree.parent.tolist() == [[-1, 0, 0]]
    got = ddtree.verify_mask(tree, torch.tensor([1], device=device)).cpu().int().tolist()
    assert got == [1, 1, 0, 0,
                   1, 1, 1, 0,
                   1, 1, 0, 1]
    got = ddtree.verify_mask(tree, torch.tensor([1], device=device), mode="qlen").cpu().int().tolist()
    assert got == [1, 0, 0,
                   1, 1, 0,
                   1, 0, 1]


def test_bad_args(device):
    lp = torch.tensor([[[-0.1, -5.0]]], device=device)
    ids = torch.tensor([[[4, 5]]], device=device)
    tree = ddtree.build_tree(lp, ids, 1)
    with pytest.raises(ValueError, match="seq_lens"):
        ddtree.verify_mask(tree, torch.tensor([1, 2], device=device))
    with pytest.raises(ValueError, match="seq_lens"):
        ddtree.verify_mask(tree, torch.tensor([1.0], device=device))
    with pytest.raises(ValueError, match="seq_lens"):
        ddtree.verify_mask(tree, torch.tensor([-1], device=device))
    with pytest.raises(ValueError, match="mode"):
        ddtree.verify_mask(tree, torch.tensor([3], device=device), mode="packed")
    with pytest.raises(ValueError, match="needs"):
        ddtree.verify_mask(tree, torch.tensor([3], device=device),
                           out=torch.zeros(5, dtype=torch.bool, device=device))
