"""NaN / +inf / -inf from the drafter never give bad token ids or a crash (validate=False path).

Semantics under test: a non-finite logit or log-prob ranks as -inf everywhere (top-k selection,
logsumexp, tree scores).  topk_logprobs: ids always in [0, V), -inf entries ordered by smaller id,
a row with no finite logit gives log-probs all -inf (never NaN).  build_tree: kernel == reference
node for node, every token is an input id of its depth, -inf nodes after all finite ones.
"""
import pytest
import torch

from conftest import HAS_CUDA
from helpers import drafter_logits, tie_heavy_logprobs
from sglang_ddtree import ddtree
from sglang_ddtree.draft_head import DDTreeDraftHead
from sglang_ddtree.kernels.topk_logprobs import (topk_logprobs_torch, topk_logprobs_triton,
                                                 topk_merge_triton, topk_partial_triton)
from sglang_ddtree.kernels.tree_build import key_layout

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def sprinkle(x, rng, frac=None):
    """Set random positions of ``x`` to NaN, +inf and -inf (each with its own random fraction)."""
    x = x.clone()
    for v in (NAN, INF, -INF):
        f = float(torch.rand((), generator=rng)) * 0.3 if frac is None else frac
        x[torch.rand(x.shape, generator=rng) < f] = v
    return x


def oracle_topk(logits, k):
    """Non-finite -> -inf by hand, then an exact (value desc, id asc) top-k in fp64 on the CPU."""
    x = logits.detach().cpu().double()
    x = torch.where(torch.isfinite(x), x, torch.full_like(x, -INF))
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    vals, ids = vals[..., :k], ids[..., :k]
    logz = torch.logsumexp(x, dim=-1, keepdim=True)
    lp = torch.where(vals == -INF, vals, vals - logz)
    return lp, ids


def check_topk(lp, ids, logits, k, atol=2e-5):
    """(lp, ids) from any implementation vs the oracle: same ids, no NaN, -inf where expected."""
    V = logits.shape[-1]
    lp, ids = lp.cpu(), ids.cpu()
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32
    assert ((ids >= 0) & (ids < V)).all(), "token ids out of [0, V)"
    assert not torch.isnan(lp).any(), "NaN log-prob"
    assert not (lp == INF).any(), "+inf log-prob"
    want_lp, want_ids = oracle_topk(logits, k)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    fin = torch.isfinite(want_lp)
    assert torch.equal(torch.isfinite(lp), fin)
    torch.testing.assert_close(lp[fin].double(), want_lp[fin], atol=atol, rtol=1e-6)
    # explicit: past the finite entries, the ids are the smallest ids of non-finite logits
    x = logits.detach().cpu().float().reshape(-1, V)
    for r, (row_lp, row_ids) in enumerate(zip(lp.reshape(-1, k), ids.reshape(-1, k))):
        nf = int((~torch.isfinite(row_lp)).sum())
        if nf:
            dead = (~torch.isfinite(x[r])).nonzero().flatten()[:nf]
            assert torch.equal(row_ids[k - nf:], dead), (r, row_ids, dead)


def poisoned(shape, device):
    return (torch.full(shape, NAN, device=device),
            torch.full(shape, -999, dtype=torch.int64, device=device))


# ---------------------------------------------------------------------------- topk_logprobs
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 7, 32, 64])
def test_topk_random_nonfinite(dtype, k, rng, device):
    bs = int(torch.randint(1, 9 if HAS_CUDA else 3, (1,), generator=rng))
    D = int(torch.randint(3, 17 if HAS_CUDA else 5, (1,), generator=rng))
    V = int(torch.randint(k, 3000, (1,), generator=rng))
    x = sprinkle(drafter_logits(bs, D, V, rng, dtype=torch.float32), rng)
    x[0, 0] = NAN                       # a whole row of NaN
    x[0, 1] = INF                       # a whole row of +inf
    x[0, 2] = torch.tensor([NAN, INF, -INF])[torch.randint(0, 3, (V,), generator=rng)]
    if D > 3:                           # fewer finite entries than k (when k > 1)
        keep = torch.randperm(V, generator=rng)[: max(1, k // 2)]
        row = torch.full((V,), NAN)
        row[keep] = x[0, 3, keep]
        x[0, 3] = row
    x = x.to(dtype).to(device)
    out = poisoned((bs, D, k), device)
    lp, ids = ddtree.topk_logprobs(x, k, validate=False, out=out)
    assert lp.data_ptr() == out[0].data_ptr() and ids.data_ptr() == out[1].data_ptr()
    check_topk(lp, ids, x, k)
    for r in range(3):                  # no finite logit: all -inf, ids 0..k-1
        assert (lp[0, r] == -INF).all()
        assert ids[0, r].tolist() == list(range(k))
    # the torch and numpy references follow the same rule
    check_topk(*topk_logprobs_torch(x, k), x, k)
    check_topk(*ddtree.topk_logprobs(x, k, backend="reference", validate=False), x, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_split_segments_nonfinite(dtype, rng, device):
    """A few long rows: split over segments + merge kernel; whole segments non-finite."""
    V, k = (151936, 64) if HAS_CUDA else (4500, 16)
    cut = V // 2 if HAS_CUDA else 3072  # the interpreter's 2 segments: [0, 3072), [3072, V)
    x = sprinkle(drafter_logits(1, 4, V, rng, dtype=torch.float32), rng, frac=0.02)
    x[0, 1, :cut] = NAN                 # the first segment has no finite logit
    x[0, 2, cut:] = INF                 # nor the second one
    x[0, 3] = -INF
    x[0, 3, ::3] = NAN
    x = x.to(dtype).to(device)
    out = poisoned((1, 4, k), device)
    lp, ids = ddtree.topk_logprobs(x, k, validate=False, out=out)
    check_topk(lp, ids, x, k)
    assert (lp[0, 3] == -INF).all() and ids[0, 3].tolist() == list(range(k))


@pytest.mark.parametrize("V", [1, 2, 3, 5, 17])
def test_topk_vocab_as_small_as_k(V, rng, device):
    """k = V (the whole vocabulary) with non-finite entries; k > V is refused by the API and, at
    kernel level, fills the surplus with (-inf, id 0): never an id out of range."""
    x = sprinkle(drafter_logits(2, 6, V, rng, dtype=torch.float32), rng, frac=0.2)
    x[1, 0] = NAN
    x = x.bfloat16().to(device)
    out = poisoned((2, 6, V), device)
    lp, ids = ddtree.topk_logprobs(x, V, validate=False, out=out)
    check_topk(lp, ids, x, V)
    with pytest.raises(ValueError, match="k must be"):
        ddtree.topk_logprobs(x, V + 1, validate=False)
    k = V + 3
    flat = x.reshape(-1, V)
    lp2, ids2 = topk_logprobs_triton(flat, k, out=poisoned((flat.shape[0], k), device))
    assert ((ids2 >= 0) & (ids2 < V)).all() and not torch.isnan(lp2).any()
    assert (lp2[:, V:] == -INF).all() and (ids2[:, V:] == 0).all()
    check_topk(lp2[:, :V], ids2[:, :V], flat, V)


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_vocab_shards_nonfinite(P, dtype, rng, device):
    """Tensor parallelism: NaN/+inf in some shards, whole shards non-finite, shards smaller than
    k, rows with no finite logit in any shard; any gather order merges to the full-row result."""
    R, V, k = 6, 700, 32
    x = drafter_logits(1, R, V, rng, dtype=torch.float32)[0]
    cuts = sorted(torch.randperm(V - 1, generator=rng)[:P - 1].add(1).tolist())
    cuts[0] = min(cuts[0], 11)          # shard 0 smaller than k
    cuts = sorted(set(cuts))
    bounds = list(zip([0] + cuts, cuts + [V]))
    for lo, hi in bounds[1::2]:         # every other shard gets a sprinkle
        x[:, lo:hi] = sprinkle(x[:, lo:hi], rng)
    lo, hi = bounds[-1]
    x[0, lo:hi] = NAN                   # a shard with no finite logit in row 0
    x[1] = INF                          # row 1: nothing finite anywhere
    x[2, :] = NAN
    x[2, 5] = 1.5                       # row 2: one finite logit, in the small shard
    x = x.to(dtype).to(device)
    order = torch.randperm(len(bounds), generator=rng).tolist()
    parts = [topk_partial_triton(x[:, lo:hi].contiguous(), k, lo)
             for lo, hi in (bounds[i] for i in order)]
    m = torch.stack([p[0] for p in parts])
    s = torch.stack([p[1] for p in parts])
    keys = torch.stack([p[2] for p in parts])
    assert not torch.isnan(m).any() and not torch.isnan(s).any()
    lp, ids = topk_merge_triton(m, s, keys, k, out=poisoned((R, k), device))
    check_topk(lp, ids, x, k)
    assert (lp[1] == -INF).all() and ids[1].tolist() == list(range(k))
    assert ids[2, 0] == 5 and lp[2, 0] == 0.0 and (lp[2, 1:] == -INF).all()


# ---------------------------------------------------------------------------- draft head
class _FakeTPGroup:
    """all_gather_into_tensor over P simulated ranks: returns the ranks' precomputed tensors."""

    def __init__(self, per_rank):
        self.world_size = len(per_rank)
        self.per_rank = per_rank
        self.calls = 0

    def all_gather_into_tensor(self, out, inp):
        key = ("m", "s", "keys")[self.calls % 3]
        self.calls += 1
        out.copy_(torch.cat([r[key].reshape(-1) for r in self.per_rank]))


def _bad_head_inputs(rng, bs, B, H, V, device):
    """bf16 lm_head + hidden states whose logits hold NaN, +inf and -inf, and whole bad rows."""
    W = torch.randn(V, H, generator=rng) * 0.5
    bad = torch.randperm(V, generator=rng)[:6]
    W[bad[:2]] = NAN                    # NaN logits in every row
    W[bad[2:4]] = 3e38                  # +-inf (overflow) and NaN where signs mix
    W[bad[4:], 0] = INF
    hs = torch.randn(bs * B, H, generator=rng)
    hs[1] = NAN                         # a whole drafted position of NaN (block 0, position 1)
    W, hs = W.bfloat16().to(device), hs.bfloat16().to(device)
    logits = hs.view(bs, B, H)[:, 1:, :].reshape(-1, H) @ W.T
    assert torch.isnan(logits).any() and (logits.abs() == INF).any()
    return W, hs, logits


@pytest.mark.parametrize("exact", [True, False])
def test_draft_head_nonfinite(exact, rng, device):
    bs, B, H, V, K = 2, 5, 16, 300, 8
    W, hs, logits = _bad_head_inputs(rng, bs, B, H, V, device)
    head = DDTreeDraftHead(weight=W, block_size=B, topk=K, num_org=V, org_vocab_start=0, max_bs=bs,
                           exact_topk=exact)
    head.lp.fill_(NAN)
    head.ids.fill_(-7)
    head(hs)
    n = bs * (B - 1)
    lp, ids = head.lp[:n].cpu(), head.ids[:n].cpu()
    assert ((ids >= 0) & (ids < V)).all() and not torch.isnan(lp).any()
    assert (lp[0] == -INF).all()        # the NaN position: no finite logit
    if exact:
        check_topk(lp, ids, logits, K, atol=1e-5)
    else:                               # torch.topk: same values, ids may differ on ties
        want_lp, _ = oracle_topk(logits, K)
        assert torch.equal(torch.isfinite(lp), torch.isfinite(want_lp))
        fin = torch.isfinite(want_lp)
        torch.testing.assert_close(lp[fin].double(), want_lp[fin], atol=1e-5, rtol=1e-6)
        x = logits.cpu().float()
        picked = torch.gather(torch.where(torch.isfinite(x), x, -INF), 1, ids)
        assert torch.equal(torch.isfinite(picked), fin)  # finite values name finite logits


def test_draft_head_vocab_parallel_nonfinite(rng, device):
    bs, B, H, V, K = 2, 4, 16, 301, 8
    W, hs, logits = _bad_head_inputs(rng, bs, B, H, V, device)
    bounds = [0, 5, 211, V]             # rank 0's shard is smaller than K
    per_rank = []
    for r in range(3):
        m, s, keys = topk_partial_triton(logits[:, bounds[r]:bounds[r + 1]].contiguous(), K, bounds[r])
        per_rank.append({"m": m, "s": s, "keys": keys})
    for r in range(3):
        head = DDTreeDraftHead(weight=W[bounds[r]:bounds[r + 1]].contiguous(), block_size=B, topk=K,
                               num_org=bounds[r + 1] - bounds[r], org_vocab_start=bounds[r],
                               max_bs=bs, tp_group=_FakeTPGroup(per_rank))
        head.lp.fill_(NAN)
        head.ids.fill_(-7)
        head(hs)
        n = bs * (B - 1)
        check_topk(head.lp[:n], head.ids[:n], logits, K, atol=1e-5)


# ---------------------------------------------------------------------------- build_tree
FIELDS = ("tokens", "depth", "parent", "num_nodes", "visibility", "mask_words")


def assert_same_tree(got, want, ctx=""):
    for f in FIELDS:
        a, b = getattr(got, f).cpu(), getattr(want, f).cpu()
        assert a.dtype == b.dtype, (f, ctx)
        if not torch.equal(a, b):
            raise AssertionError(f"{f} differs at {(a != b).nonzero()[:5].tolist()} {ctx}")


def poisoned_tree(bs, budget, D, device):
    N = budget + 1
    return ddtree.Tree(
        tokens=torch.full((bs, N), 123456789, dtype=torch.int64, device=device),
        depth=torch.full((bs, N), -77, dtype=torch.int32, device=device),
        parent=torch.full((bs, N), 9999, dtype=torch.int32, device=device),
        num_nodes=torch.full((bs,), -5, dtype=torch.int32, device=device),
        visibility=torch.ones((bs, N, N), dtype=torch.bool, device=device),
        mask_words=torch.full((bs, N, (N + 31) // 32), 0x5A5A5A5A, dtype=torch.int32, device=device),
        budget=budget, draft_depth=D)


def check_tree(tree, lp, ids, budget, V):
    """Valid tree from these inputs: tokens of the right depth's row, parents before children;
    where the rows are sorted once NaN/+inf read as -inf (topk_logprobs' output always is), all
    finite-score nodes before all -inf ones (unsorted rows: the heap's lazy sibling order)."""
    bs, D, K = lp.shape
    clean = torch.where(lp < INF, lp, torch.full_like(lp, -INF)).cpu().double()
    tok, dep, par = tree.tokens.cpu(), tree.depth.cpu(), tree.parent.cpu()
    reachable = sum(K ** d for d in range(1, D + 1))
    assert (tree.num_nodes.cpu() == min(budget, reachable) + 1).all()
    for b in range(bs):
        n = int(tree.num_nodes[b])
        score = torch.zeros(n, dtype=torch.float64)
        nth = {}
        for i in range(1, n):
            p, d, t = int(par[b, i]), int(dep[b, i]), int(tok[b, i])
            assert 0 <= p < i and d == int(dep[b, p]) + 1 and 0 <= t < V
            r = nth.get(p, 0)           # siblings pop in rank order
            nth[p] = r + 1
            assert t == int(ids[b, d - 1, r]), (b, i)
            score[i] = -INF if score[p] == -INF else score[p] + clean[b, d - 1, r]
        fin = torch.isfinite(score[1:])
        row_sorted = bool((clean[b, :, 1:] <= clean[b, :, :-1]).all())
        if row_sorted and fin.any() and (~fin).any():
            assert fin.nonzero().max() < (~fin).nonzero().min(), "a -inf node before a finite one"


@pytest.mark.parametrize("D,K", [(4, 8), (16, 32), (16, 256), (22, 256)])
def test_build_tree_sprinkled_kernel_vs_reference(D, K, rng, device):
    """NaN/+inf sprinkled into tie-heavy log-probs (1-4 rank-path key words): kernel == reference
    node for node, == the tree of the same input with NaN/+inf replaced by -inf."""
    assert key_layout(D, K)[2] == {(4, 8): 1, (16, 32): 2, (16, 256): 3, (22, 256): 4}[(D, K)]
    bs, budget, V = 3, 48, max(K, 50)   # tie_heavy_logprobs draws ids below max(K, 50)
    lp, ids = tie_heavy_logprobs(bs, D, K, rng, levels=3, neg_inf_frac=0.1)
    lp[:, :, 0] = 0.0                   # a certain top-1 chain: deep paths, deep ties
    lp = sprinkle(lp, rng, frac=0.1)    # no longer sorted, nor finite: validate=False only
    lp[0, :, 0] = NAN                   # request 0: no finite top-1 at any depth
    tail = lp[1].clone()                # request 1: NaN/+inf only where -inf would sort
    lp[1] = torch.where(torch.isfinite(tail), tail, torch.full_like(tail, -INF))
    lp[1] = torch.sort(lp[1], dim=-1, descending=True).values
    dead = lp[1] == -INF
    lp[1][dead] = torch.tensor([NAN, INF, -INF])[torch.randint(0, 3, (int(dead.sum()),),
                                                               generator=rng)]
    lp, ids = lp.to(device), ids.to(device)
    got = ddtree.build_tree(lp, ids, budget, validate=False, out=poisoned_tree(bs, budget, D, device))
    want = ddtree.build_tree(lp.cpu(), ids.cpu(), budget, backend="reference", validate=False)
    assert_same_tree(got, want, f"D={D} K={K}")
    clean = torch.where(lp < INF, lp, torch.full_like(lp, -INF))
    assert_same_tree(ddtree.build_tree(clean, ids, budget, validate=False), want)
    check_tree(got, lp, ids, budget, V)


@pytest.mark.parametrize("budget", [1, 8, 31, 64])
def test_build_tree_drafter_nonfinite_logits(budget, rng, device):
    """The worker's hot path end to end: drafter logits with NaN/+inf -> topk_logprobs ->
    build_tree -> accept_greedy, all validate=False: in-vocabulary tokens, kernel == reference."""
    bs = 2 if not HAS_CUDA else 16
    D = int(torch.randint(1, 9, (1,), generator=rng))
    V = int(torch.randint(budget, 3 * budget + 8, (1,), generator=rng))
    K = min(budget, V)
    x = sprinkle(drafter_logits(bs, D, V, rng, dtype=torch.float32), rng)
    x[0] = NAN                          # request 0: the drafter is all NaN
    x = x.bfloat16().to(device)
    lp, ids = ddtree.topk_logprobs(x, K, validate=False)
    roots = torch.randint(0, V, (bs,), generator=rng).to(device)
    got = ddtree.build_tree(lp, ids, budget, root_tokens=roots, validate=False,
                            out=poisoned_tree(bs, budget, D, device))
    want = ddtree.build_tree(lp.cpu(), ids.cpu(), budget, root_tokens=roots.cpu(),
                             backend="reference", validate=False)
    assert_same_tree(got, want)
    check_tree(got, lp, ids, budget, V)
    assert ((got.tokens >= 0) & (got.tokens < V)).all()
    # the all-NaN request: a full tree of -inf nodes, ids 0..K-1 at every depth
    assert set(got.tokens[0, 1:].tolist()) <= set(range(K))
    target = torch.randint(0, V, got.tokens.shape, generator=rng).to(device)
    acc = ddtree.accept_greedy(got, target, validate=False)
    new = acc.new_tokens(got)
    assert ((new >= -1) & (new < V)).all() and (new[:, 0] >= 0).all()


@pytest.mark.parametrize("budget", [8, 32])
@pytest.mark.parametrize("fill", [NAN, INF, -INF])
def test_build_tree_row_without_finite_score(budget, fill, rng, device):
    """Every log-prob of a request NaN (or +inf, or -inf): the same valid tree as all -inf,
    rank-path order; one depth row of NaN in another request."""
    D, K = 4, 6
    lp, ids = tie_heavy_logprobs(3, D, K, rng)
    lp[0] = fill
    lp[1, 1] = NAN                      # depth 2 of request 1 is garbage
    lp, ids = lp.to(device), ids.to(device)
    got = ddtree.build_tree(lp, ids, budget, validate=False, out=poisoned_tree(3, budget, D, device))
    want = ddtree.build_tree(lp.cpu(), ids.cpu(), budget, backend="reference", validate=False)
    assert_same_tree(got, want)
    check_tree(got, lp, ids, budget, 50)
    # all -inf: pops by rank path only, e.g. (0), (0,0), (0,0,0), (0,0,0,0), (0,0,0,1), ...
    want_dep = [1, 2, 3, 4] + [4] * (K - 1) + [3]
    assert got.depth[0, 1:].tolist()[:min(budget, len(want_dep))] == want_dep[:budget]
    assert got.tokens[0, 1].item() == ids[0, 0, 0].item()
