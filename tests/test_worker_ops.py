"""Worker logic that runs without a GPU: the tensor ops between the kernels (tree_ops), the
drafter's top-k head (DDTreeDraftHead, tp = 1; tp > 1 is tests/test_tp_gloo.py), and the
KV-commit index mapping, all on trees drawn fresh each run and checked against plain-Python
references."""
import numpy as np
import pytest
import torch

from sglang_ddtree import ddtree, tree_ops
from sglang_ddtree.draft_head import DDTreeDraftHead
from sglang_ddtree.kernels.topk_logprobs import topk_logprobs_torch

from helpers import drafter_logits, logprobs_from_logits


def _random_trees(rng, bs, D, budget, V=50):
    logits = drafter_logits(bs, D, V, rng)
    lp, ids = logprobs_from_logits(logits, min(budget, V))
    roots = torch.randint(0, V, (bs,), generator=rng)
    return ddtree.build_tree(lp, ids, budget, root_tokens=roots, backend="reference")


@pytest.mark.parametrize("budget", [1, 7, 16, 40])
def test_lcrs_links_match_python(rng, budget):
    tree = _random_trees(rng, 5, 6, budget)
    first, nxt = tree_ops.lcrs_links(tree.parent)
    par = tree.parent.numpy()
    for b in range(par.shape[0]):
        N = par.shape[1]
        children = {p: [j for j in range(N) if par[b, j] == p] for p in range(N)}
        for p in range(N):
            assert first[b, p].item() == (children[p][0] if children[p] else -1)
        for i in range(N):
            sib = children.get(par[b, i], []) if par[b, i] >= 0 else []
            later = [j for j in sib if j > i]
            assert nxt[b, i].item() == (later[0] if later else -1)


def _random_accept(rng, tree):
    """A random root path through each tree (what accept_greedy would return for some target)."""
    bs, N = tree.tokens.shape
    W = tree.draft_depth + 1
    path = torch.full((bs, W), -1, dtype=torch.int32)
    alen = torch.zeros(bs, dtype=torch.int32)
    par = tree.parent.numpy()
    for b in range(bs):
        cur, p = 0, [0]
        while True:
            kids = [j for j in range(N) if par[b, j] == cur]
            if not kids or torch.rand((), generator=rng) < 0.25:
                break
            cur = kids[int(torch.randint(0, len(kids), (), generator=rng))]
            p.append(cur)
        path[b, : len(p)] = torch.tensor(p)
        alen[b] = len(p) - 1
    bonus = torch.randint(0, 50, (bs,), generator=rng)
    return path, alen, bonus


@pytest.mark.parametrize("budget", [4, 16, 33])
def test_accept_index_roundtrip_and_output_tokens(rng, budget):
    tree = _random_trees(rng, 6, 5, budget)
    path, alen, bonus = _random_accept(rng, tree)
    N = tree.tokens.shape[1]
    idx = tree_ops.accept_index_from_path(path, N)
    assert idx.dtype == torch.int32
    for b in range(path.shape[0]):
        for i in range(path.shape[1]):
            assert idx[b, i].item() == (b * N + path[b, i].item() if path[b, i] >= 0 else -1)
    assert torch.equal(tree_ops.path_from_accept_index(idx, N), path)
    out = ddtree.Accept(alen, path, bonus).new_tokens(tree)  # the worker's output tokens
    for b in range(path.shape[0]):
        a = alen[b].item()
        assert out[b, : a].tolist() == [tree.tokens[b, path[b, i]].item() for i in range(1, a + 1)]
        assert out[b, a].item() == bonus[b].item()


def test_kv_commit_mapping_moves_path_to_front(rng):
    """SGLang's move_accept_tokens_to_target_kvcache copies out_cache_loc[accept_index[b, i]] to the
    slot of position prefix + i (gather, then scatter).  Simulated on a toy KV store: afterwards the
    first accept_len + 1 positions of every request hold the accepted nodes in path order."""
    tree = _random_trees(rng, 7, 6, 24)
    path, alen, _ = _random_accept(rng, tree)
    bs, N = tree.tokens.shape
    prefix = torch.randint(0, 30, (bs,), generator=rng)
    out_cache_loc = torch.randperm(bs * N, generator=rng) + 100            # slots of the N verify rows
    kv = {int(out_cache_loc[b * N + j]): (b, j) for b in range(bs) for j in range(N)}  # slot -> node
    idx = tree_ops.accept_index_from_path(path, N)
    src = [int(out_cache_loc[i]) for i in idx.flatten().tolist() if i >= 0]           # compacted
    tgt = [int(out_cache_loc[b * N + i]) for b in range(bs) for i in range(alen[b] + 1)]
    gathered = [kv[s] for s in src]
    for t, v in zip(tgt, gathered):
        kv[t] = v
    for b in range(bs):
        got = [kv[int(out_cache_loc[b * N + i])] for i in range(alen[b] + 1)]
        assert got == [(b, int(path[b, i])) for i in range(alen[b] + 1)]


@pytest.mark.parametrize("budget", [1, 5, 23])
def test_commit_by_slot_permutation_matches_the_kv_move(rng, budget):
    """tree_ops.commit_path_slots reorders req_to_token instead of moving K/V: on a toy KV store
    (location -> the node whose K/V the verify wrote there) every committed position reads the node
    the KV move would have put there, the request owns the same locations as before, positions
    outside [prefix, prefix + N) are untouched, and rows of requests outside the batch too."""
    tree = _random_trees(rng, 6, 8, budget)
    path, alen, _ = _random_accept(rng, tree)
    bs, N = tree.tokens.shape
    R, L = bs + 3, 90
    req_to_token = (torch.randperm(R * L, generator=rng).view(R, L) + 1).to(torch.int32)
    pool = torch.randperm(R, generator=rng)[:bs]
    prefix = torch.randint(0, L - N, (bs,), generator=rng)
    kv = {}
    for b in range(bs):
        for j in range(N):
            kv[int(req_to_token[pool[b], prefix[b] + j])] = (b, j)
    before = req_to_token.clone()
    tree_ops.commit_path_slots(req_to_token, pool, prefix, path, N)
    for b in range(bs):
        r, p = int(pool[b]), int(prefix[b])
        got = [kv[int(req_to_token[r, p + k])] for k in range(alen[b] + 1)]
        assert got == [(b, int(path[b, k])) for k in range(alen[b] + 1)]
        assert sorted(req_to_token[r].tolist()) == sorted(before[r].tolist())
        assert torch.equal(req_to_token[r, :p], before[r, :p]) and torch.equal(req_to_token[r, p + N:], before[r, p + N:])
        rest = [kv[int(req_to_token[r, p + k])][1] for k in range(alen[b] + 1, N)]
        assert rest == sorted(set(range(N)) - set(path[b, :alen[b] + 1].tolist()))
    others = sorted(set(range(R)) - set(pool.tolist()))
    assert torch.equal(req_to_token[others], before[others])


def test_commit_by_slot_permutation_root_only_is_identity(rng):
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    before = req_to_token.clone()
    path = torch.tensor([[0, -1, -1], [0, -1, -1]])
    tree_ops.commit_path_slots(req_to_token, torch.tensor([2, 0]), torch.tensor([3, 5]), path, 1)
    tree_ops.commit_path_slots(req_to_token, torch.tensor([2, 0]), torch.tensor([3, 5]), path, 4)
    assert torch.equal(req_to_token, before)


def test_gather_path_rows_and_verify_ids(rng):
    tree = _random_trees(rng, 3, 4, 9)
    path, alen, _ = _random_accept(rng, tree)
    bs, N = tree.tokens.shape
    rows = torch.randn(bs * N, 5, generator=rng)
    g = tree_ops.gather_path_rows(rows, path).view(bs, -1, 5)
    for b in range(bs):
        for i in range(path.shape[1]):
            j = max(int(path[b, i]), 0)
            assert torch.equal(g[b, i], rows[b * N + j])
    ids = tree_ops.verify_input_ids(tree.tokens)
    assert (ids >= 0).all() and torch.equal(ids[tree.tokens >= 0], tree.tokens[tree.tokens >= 0])


def _head_inputs(rng, bs, B, H, V, device):
    W = (torch.randn(V, H, generator=rng) * 0.5).to(torch.bfloat16).to(device)
    hs = torch.randn(bs * B, H, generator=rng).to(torch.bfloat16).to(device)
    logits = (hs.view(bs, B, H)[:, 1:, :].reshape(-1, H) @ W.T)
    return W, hs, logits


@pytest.mark.parametrize("K", [1, 5, 16])
def test_draft_head_tp1_exact(rng, K, device):
    bs, B, H, V = 3, 5, 16, 300
    W, hs, logits = _head_inputs(rng, bs, B, H, V, device)
    head = DDTreeDraftHead(weight=W, block_size=B, topk=K, num_org=V, org_vocab_start=0, max_bs=4)
    head.lp.fill_(float("nan"))  # poison
    head.ids.fill_(-7)
    head(hs)
    n = bs * (B - 1)
    ref_lp, ref_ids = topk_logprobs_torch(logits, K)
    assert torch.equal(head.ids[:n], ref_ids)
    torch.testing.assert_close(head.lp[:n], ref_lp, rtol=0, atol=1e-5)


def test_draft_head_ports_recipe_values(rng, device):
    """DDTREE-CPU's head (torch.topk + logsumexp) gives the same values; ids may differ on ties."""
    bs, B, H, V, K = 2, 4, 16, 200, 6
    W, hs, logits = _head_inputs(rng, bs, B, H, V, device)
    head = DDTreeDraftHead(weight=W, block_size=B, topk=K, num_org=V, org_vocab_start=0, max_bs=2,
                           exact_topk=False)
    head(hs)
    ref_lp, _ = topk_logprobs_torch(logits, K)
    torch.testing.assert_close(head.lp[: bs * (B - 1)], ref_lp, rtol=0, atol=1e-5)


# The vocabulary-parallel head (tp > 1) runs over a real gloo group in tests/test_tp_gloo.py.


def test_commit_ops_switch():
    """The A/B switch commit_ops picks the commit's backend: fused (default) = the tree backend's one
    launch, torch = the reference composition; anything else is refused when the switches are made."""
    from sglang_ddtree import switches
    from sglang_ddtree.switches import commit_ops_backend
    assert commit_ops_backend(switches.Switches(), "triton") == "triton"
    assert commit_ops_backend(switches.Switches(commit_ops="torch"), "triton") == "reference"
    with pytest.raises(ValueError, match="commit_ops must be 'fused' or 'torch'"):
        switches.Switches(commit_ops="kernel")
