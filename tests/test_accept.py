"""accept_greedy: Triton vs the reference walk, on random trees and crafted targets."""
import pytest
import torch

from helpers import drafter_logits, logprobs_from_logits
from sglang_ddtree import ddtree


def make_tree(bs, D, budget, rng, device, V=None):
    V = V or 4 * budget
    logits = drafter_logits(bs, D, V, rng).to(device)
    lp, ids = logprobs_from_logits(logits, min(budget, V))
    roots = torch.randint(0, V, (bs,), generator=rng).to(device)
    return ddtree.build_tree(lp, ids, budget, root_tokens=roots), V


def check(tree, target):
    got = ddtree.accept_greedy(tree, target)
    want = ddtree.accept_greedy(tree, target, backend="reference")
    assert torch.equal(got.accept_len.cpu(), want.accept_len.cpu())
    assert torch.equal(got.path.cpu(), want.path.cpu())
    assert torch.equal(got.bonus.cpu(), want.bonus.cpu())
    return got


def target_following(tree, leaf_of_row, V, rng):
    """Targets that walk from the root to leaf_of_row[b]; random (non-matching) elsewhere."""
    bs, N = tree.tokens.shape
    target = torch.randint(0, V, (bs, N), generator=rng)
    tok, par = tree.tokens.cpu(), tree.parent.cpu()
    for b, leaf in enumerate(leaf_of_row):
        node = leaf
        while node > 0:
            target[b, par[b, node]] = tok[b, node]
            node = int(par[b, node])
    return target


@pytest.mark.parametrize("budget", [8, 16, 64])
def test_random_targets(budget, rng, device):
    tree, V = make_tree(16, 8, budget, rng, device, V=6)  # tiny V: random targets often match
    target = torch.randint(0, 6, tree.tokens.shape, generator=rng)
    # every other row starts on the root's first child, so some walks surely go past the root
    first_child = (tree.parent.cpu() == 0).int().argmax(1)
    tok0 = tree.tokens.cpu()[torch.arange(16), first_child]
    target[::2, 0] = tok0[::2]
    got = check(tree, target.to(device))
    assert (got.accept_len[::2] > 0).all()


def test_full_depth_path(rng, device):
    D, budget = 6, 64
    tree, V = make_tree(8, D, budget, rng, device)
    deepest = tree.depth.cpu().argmax(dim=1).tolist()
    target = target_following(tree, deepest, V, rng).to(device)
    got = check(tree, target)
    assert torch.equal(got.accept_len.cpu(), tree.depth.cpu().max(dim=1).values)
    bonus_want = target.cpu()[torch.arange(8), torch.tensor(deepest)]
    assert torch.equal(got.bonus.cpu(), bonus_want)


def test_non_first_sibling(rng, device):
    """A path through a rank > 0 child (a sibling wins)."""
    tree, V = make_tree(8, 5, 32, rng, device)
    par = tree.parent.cpu()
    picks = []
    for b in range(8):
        # the first node that has an earlier sibling (a rank > 0 child)
        seen = set()
        for i in range(1, par.shape[1]):
            if int(par[b, i]) in seen:
                picks.append(i)
                break
            seen.add(int(par[b, i]))
    target = target_following(tree, picks, V, rng)
    # make sure the walk stops right after the sibling: its children never match
    for b, node in enumerate(picks):
        target[b, node] = V + 1
    got = check(tree, target.to(device))
    assert got.accept_len.tolist() == tree.depth.cpu()[torch.arange(8), torch.tensor(picks)].tolist()
    assert got.path.cpu()[torch.arange(8), got.accept_len.cpu().long()].tolist() == picks
    assert got.bonus.tolist() == [V + 1] * 8


def test_nothing_accepted(rng, device):
    tree, V = make_tree(4, 5, 16, rng, device)
    target = torch.full(tree.tokens.shape, V + 7, dtype=torch.int64, device=device)
    got = check(tree, target)
    assert got.accept_len.tolist() == [0] * 4
    assert (got.path[:, 1:] == -1).all() and (got.path[:, 0] == 0).all()
    assert got.bonus.tolist() == [V + 7] * 4


def test_new_tokens(rng, device):
    tree, V = make_tree(4, 6, 32, rng, device)
    deepest = tree.depth.cpu().argmax(dim=1).tolist()
    target = target_following(tree, deepest, V, rng).to(device)
    acc = ddtree.accept_greedy(tree, target)
    new = acc.new_tokens(tree).cpu()
    for b in range(4):
        n = int(acc.accept_len[b])
        path = acc.path[b, 1:n + 1].cpu()
        assert new[b, :n].tolist() == tree.tokens[b].cpu()[path].tolist()
        assert int(new[b, n]) == int(acc.bonus[b])
        assert (new[b, n + 1:] == -1).all()


def test_poisoned_outputs_are_overwritten(rng, device):
    tree, V = make_tree(5, 4, 16, rng, device)
    target = torch.randint(0, V, tree.tokens.shape, generator=rng).to(device)
    out = ddtree.Accept(torch.full((5,), -3, dtype=torch.int32, device=device),
                        torch.full((5, 5), 77, dtype=torch.int32, device=device),
                        torch.full((5,), -9, dtype=torch.int64, device=device))
    got = ddtree.accept_greedy(tree, target, out=out)
    want = ddtree.accept_greedy(tree, target, backend="reference")
    assert got.path.data_ptr() == out.path.data_ptr()
    assert torch.equal(got.path.cpu(), want.path.cpu())
    assert torch.equal(got.accept_len.cpu(), want.accept_len.cpu())
    assert torch.equal(got.bonus.cpu(), want.bonus.cpu())
