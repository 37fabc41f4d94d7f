"""verify_mask: the flattened verify mask in SGLang's layout, vs an independent torch reference."""
import pytest
import torch

from helpers import drafter_logits, logprobs_from_logits
from sglang_ddtree import ddtree
from sglang_ddtree.kernels.verify_mask import verify_mask_size, verify_mask_torch

POISON = 7


def make_tree(bs, D, budget, rng, device):
    logits = drafter_logits(bs, D, 4 * budget, rng).to(device)
    lp, ids = logprobs_from_logits(logits, budget)
    return ddtree.build_tree(lp, ids, budget)


@pytest.mark.parametrize("mode", ["full", "qlen"])
@pytest.mark.parametrize("budget", [1, 8, 31, 64])
def test_random_trees_and_prefixes(mode, budget, rng, device):
    bs = int(torch.randint(1, 9, (1,), generator=rng))
    tree = make_tree(bs, 6, budget, rng, device)
    seq_lens = torch.randint(0, 2500, (bs,), generator=rng).to(device)
    seq_lens[0] = 0  # an empty prefix is legal
    N = budget + 1
    need = verify_mask_size(int(seq_lens.sum()), bs, N, mode)
    out = torch.full((need + 100,), POISON, dtype=torch.uint8, device=device)
    ddtree.verify_mask(tree, seq_lens, mode=mode, out=out)
    want = verify_mask_torch(tree.visibility.cpu(), seq_lens.cpu(), mode)
    assert torch.equal(out[:need].cpu(), want.to(torch.uint8)), "mask differs"
    assert (out[need:] == POISON).all(), "wrote past the mask"
    ref = ddtree.verify_mask(tree, seq_lens, mode=mode, backend="reference")
    assert torch.equal(ref.cpu(), want)


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
