"""build_tree: Triton kernels vs the exact CPU reference, node for node."""
import pytest
import torch

from conftest import HAS_CUDA
from helpers import drafter_logits, logprobs_from_logits, tie_heavy_logprobs
from sglang_ddtree import ddtree
from sglang_ddtree.kernels.tree_mask import tree_mask_torch

BUDGETS = [0, 1, 2, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 256]
FIELDS = ("tokens", "depth", "parent", "num_nodes", "visibility", "mask_words")
# The interpreter runs one program at a time: keep bs * budget modest on the CPU.
CPU_WORK = 1200


def assert_same_tree(got, want, ctx=""):
    for f in FIELDS:
        a, b = getattr(got, f).cpu(), getattr(want, f).cpu()
        assert a.dtype == b.dtype, (f, a.dtype, b.dtype, ctx)
        if not torch.equal(a, b):
            bad = (a != b).nonzero()[:5].tolist()
            raise AssertionError(f"{f} differs at {bad} {ctx}")


def both(lp, ids, budget, roots=None):
    got = ddtree.build_tree(lp, ids, budget, root_tokens=roots)
    want = ddtree.build_tree(lp.cpu(), ids.cpu(), budget,
                             root_tokens=None if roots is None else roots.cpu(), backend="reference")
    return got, want


def pick_bs(budget, rng, hi=64):
    cap = hi if HAS_CUDA else max(1, min(hi, CPU_WORK // max(budget, 1)))
    return int(torch.randint(1, cap + 1, (1,), generator=rng))


@pytest.mark.parametrize("budget", BUDGETS)
def test_bf16_drafter_logits(budget, rng, device):
    bs = pick_bs(budget, rng)
    D = int(torch.randint(1, 17, (1,), generator=rng))
    V = int(torch.randint(max(budget, 8), 4 * max(budget, 8) + 1, (1,), generator=rng))
    k = min(max(budget, 1), V)
    logits = drafter_logits(bs, D, V, rng).to(device)
    lp, ids = logprobs_from_logits(logits, k)
    roots = torch.randint(0, V, (bs,), generator=rng).to(device)
    got, want = both(lp, ids, budget, roots)
    assert_same_tree(got, want, f"bs={bs} D={D} V={V} k={k}")
    # with V >= budget the heap never runs dry: exactly budget nodes + root
    assert (got.num_nodes.cpu() == budget + 1).all()


@pytest.mark.parametrize("budget", [7, 16, 32, 64, 128])
def test_exact_ties(budget, rng, device):
    """Log-probs from a handful of values: most pops are decided by the rank-path tie-break."""
    bs = pick_bs(budget, rng, 16)
    D = int(torch.randint(2, 17, (1,), generator=rng))
    K = min(budget, 24)
    lp, ids = tie_heavy_logprobs(bs, D, K, rng)
    got, want = both(lp.to(device), ids.to(device), budget)
    assert_same_tree(got, want, f"bs={bs} D={D} K={K}")


@pytest.mark.parametrize("budget", [8, 32, 64])
def test_neg_inf_entries(budget, rng, device):
    """-inf log-probs are legal: popped last, never above a finite score."""
    bs = pick_bs(budget, rng, 16)
    D = int(torch.randint(1, 9, (1,), generator=rng))
    logits = drafter_logits(bs, D, 3 * budget, rng, neg_inf_frac=0.9).to(device)
    lp, ids = logprobs_from_logits(logits, budget)
    assert torch.isinf(lp).any()
    got, want = both(lp, ids, budget)
    assert_same_tree(got, want)
    lp2, ids2 = tie_heavy_logprobs(bs, D, min(budget, 12), rng, neg_inf_frac=0.4)
    got, want = both(lp2.to(device), ids2.to(device), budget)
    assert_same_tree(got, want)
    # every finite-score node precedes every -inf node: depth-first score order holds
    scores = _path_scores(want, lp2)
    for b in range(bs):
        s = scores[b][1:int(want.num_nodes[b])]
        fin = torch.isfinite(s)
        if (~fin).any() and fin.any():
            assert fin.nonzero().max() < (~fin).nonzero().min()


def _path_scores(tree, lp):
    """Sum of log-probs along each node's path (for order checks)."""
    bs, N = tree.tokens.shape
    out = torch.full((bs, N), 0.0, dtype=torch.float64)
    ranks = torch.zeros((bs, N), dtype=torch.int64)
    for b in range(bs):
        # rank of node i among its siblings = number of earlier siblings (siblings pop in rank order)
        seen = {}
        for i in range(1, int(tree.num_nodes[b])):
            p = int(tree.parent[b, i])
            r = seen.get(p, 0)
            seen[p] = r + 1
            ranks[b, i] = r
            d = int(tree.depth[b, i])
            out[b, i] = out[b, p] + float(lp[b, d - 1, r])
    return out


@pytest.mark.parametrize("V,D,budget", [(1, 3, 8), (2, 2, 16), (3, 2, 31), (2, 4, 64), (5, 1, 16)])
def test_tiny_vocab_padding(V, D, budget, rng, device):
    """Fewer reachable prefixes than the budget: the heap runs dry, padding slots follow."""
    bs = 5
    logits = drafter_logits(bs, D, V, rng).to(device)
    lp, ids = logprobs_from_logits(logits, min(budget, V))
    got, want = both(lp, ids, budget)
    assert_same_tree(got, want)
    reachable = sum(V ** d for d in range(1, D + 1))
    n = min(budget, reachable) + 1
    assert (got.num_nodes.cpu() == n).all()
    if n < budget + 1:
        pad = slice(n, budget + 1)
        assert (got.parent[:, pad].cpu() == -1).all()
        assert (got.depth[:, pad].cpu() == 0).all()
        assert (got.tokens[:, pad].cpu() == -1).all()
        eye = torch.eye(budget + 1, dtype=torch.bool)[pad]
        assert torch.equal(got.visibility[:, pad].cpu(), eye.expand(bs, -1, -1))


def test_budget_zero_is_root_only(device):
    lp = torch.tensor([[[-0.1, -2.0]]], device=device)
    ids = torch.tensor([[[4, 9]]], device=device)
    t = ddtree.build_tree(lp, ids, 0, root_tokens=torch.tensor([7], device=device))
    assert t.tokens.tolist() == [[7]] and t.parent.tolist() == [[-1]] and t.num_nodes.tolist() == [1]
    assert t.visibility.tolist() == [[[True]]] and t.mask_words.tolist() == [[[1]]]


def test_hand_checked_order(device):
    """A small case worked out by hand, ties included.

    depth1: lp [-1, -1, -3] ids [10, 11, 12]; depth2: lp [-0.5, -2, -2] ids [20, 21, 22].
    Pops: (0) -1 ; (1) -1 [tie, larger rank path] ; (0,0) -1.5 ; (1,0) -1.5 ;
    then five at -3, lexicographic: (0,1) < (0,2) < (1,1) < (1,2) < (2) (each (x,2) is pushed
    when (x,1) pops, and still precedes (2)).
    """
    lp = torch.tensor([[[-1.0, -1.0, -3.0], [-0.5, -2.0, -2.0]]], device=device)
    ids = torch.tensor([[[10, 11, 12], [20, 21, 22]]], device=device)
    for backend in ("triton", "reference"):
        t = ddtree.build_tree(lp, ids, 9, backend=backend)
        assert t.tokens[0].tolist() == [-1, 10, 11, 20, 20, 21, 22, 21, 22, 12], backend
        assert t.parent[0].tolist() == [-1, 0, 0, 1, 2, 1, 1, 2, 2, 0], backend
        assert t.depth[0].tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2, 1], backend


def test_poisoned_outputs_are_overwritten(rng, device):
    """Every slot of a preallocated output is written (padding included)."""
    bs, D, V, budget = 4, 3, 2, 31  # V=2, D=3 -> 14 nodes: padding slots exist
    logits = drafter_logits(bs, D, V, rng).to(device)
    lp, ids = logprobs_from_logits(logits, 2)
    N = budget + 1
    poison = ddtree.Tree(
        tokens=torch.full((bs, N), 123456789, dtype=torch.int64, device=device),
        depth=torch.full((bs, N), -77, dtype=torch.int32, device=device),
        parent=torch.full((bs, N), 9999, dtype=torch.int32, device=device),
        num_nodes=torch.full((bs,), -5, dtype=torch.int32, device=device),
        visibility=torch.ones((bs, N, N), dtype=torch.bool, device=device),
        mask_words=torch.full((bs, N, 1), 0x5A5A5A5A, dtype=torch.int32, device=device),
        budget=budget, draft_depth=D)
    got = ddtree.build_tree(lp, ids, budget, out=poison)
    want = ddtree.build_tree(lp.cpu(), ids.cpu(), budget, backend="reference")
    assert_same_tree(got, want)
    assert got.tokens.data_ptr() == poison.tokens.data_ptr()


@pytest.mark.parametrize("budget", [16, 64])
def test_tree_mask_vs_torch_reference(budget, rng, device):
    bs = pick_bs(budget, rng, 32)
    D = 8
    logits = drafter_logits(bs, D, 4 * budget, rng).to(device)
    lp, ids = logprobs_from_logits(logits, budget)
    t = ddtree.build_tree(lp, ids, budget)
    assert torch.equal(t.visibility.cpu(), tree_mask_torch(t.parent.cpu(), D))
    vis, words = ddtree.tree_mask(t.parent, D, backend="reference")
    assert torch.equal(t.mask_words.cpu(), words.cpu())
    # ancestor-only: row i sees exactly depth(i) + 1 slots (itself and its ancestors)
    assert torch.equal(t.visibility.sum(-1).cpu(), t.depth.cpu() + 1)


def test_positions_are_start_plus_depth(device):
    lp = torch.tensor([[[-1.0, -2.0], [-1.0, -2.0]]], device=device)
    ids = torch.tensor([[[1, 2], [3, 4]]], device=device)
    t = ddtree.build_tree(lp, ids, 4)
    pos = t.positions(torch.tensor([100], device=device))
    assert pos.tolist() == [[100 + d for d in t.depth[0].tolist()]]


@pytest.mark.parametrize("D,K", [(4, 8), (16, 32), (16, 256), (22, 256)])
def test_rank_path_key_words(D, K, rng, device):
    """Rank paths packed into 1, 2, 3 and 4 int64 words all break ties like tuple compare."""
    from sglang_ddtree.kernels.tree_build import key_layout
    words = key_layout(D, K)[2]
    assert words == {(4, 8): 1, (16, 32): 2, (16, 256): 3, (22, 256): 4}[(D, K)]
    budget = 48
    lp, ids = tie_heavy_logprobs(2, D, K, rng, levels=3)
    lp[:, :, 0] = 0.0  # a certain top-1 chain: the tree reaches full depth, deep ties abound
    got, want = both(lp.to(device), ids.to(device), budget)
    assert_same_tree(got, want, f"D={D} K={K} words={words}")
    assert int(got.depth.max()) == D
