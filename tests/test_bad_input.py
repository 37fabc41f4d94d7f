"""Bad input raises ValueError naming the argument; never a silent wrong answer."""
import pytest
import torch

from sglang_ddtree import ddtree


def good(device):
    lp = torch.tensor([[[-0.5, -1.0], [-0.2, -3.0]]], device=device)
    ids = torch.tensor([[[3, 4], [5, 6]]], device=device)
    return lp, ids


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_build_tree_bad_args(backend, device):
    lp, ids = good(device)
    cases = [
        (dict(log_probs=lp[0]), "log_probs"),
        (dict(log_probs=lp.double()), "log_probs"),
        (dict(token_ids=ids.int()), "token_ids"),
        (dict(token_ids=ids[:, :1]), "token_ids"),
        (dict(budget=-1), "budget"),
        (dict(budget=2.5), "budget"),
        (dict(log_probs=lp[:, :0], token_ids=ids[:, :0], budget=3), "depth"),
        (dict(root_tokens=torch.tensor([1, 2], device=device)), "root_tokens"),
        (dict(root_tokens=torch.tensor([1], dtype=torch.int32, device=device)), "root_tokens"),
        (dict(log_probs=torch.tensor([[[-0.5, float("nan")], [-0.2, -3.0]]], device=device)), "NaN"),
        (dict(log_probs=torch.tensor([[[float("inf"), -1.0], [-0.2, -3.0]]], device=device)), "inf"),
        (dict(log_probs=torch.tensor([[[-1.0, -0.5], [-0.2, -3.0]]], device=device)), "sorted"),
        (dict(token_ids=torch.tensor([[[3, -4], [5, 6]]], device=device)), "token_ids"),
    ]
    for kw, word in cases:
        args = dict(log_probs=lp, token_ids=ids, budget=3, root_tokens=None)
        args.update(kw)
        with pytest.raises(ValueError, match=word):
            ddtree.build_tree(args["log_probs"], args["token_ids"], args["budget"],
                              root_tokens=args["root_tokens"], backend=backend)
    with pytest.raises(ValueError, match="backend"):
        ddtree.build_tree(lp, ids, 3, backend="cuda")


def test_budget_zero_with_empty_depth_is_fine(device):
    lp, ids = good(device)
    t = ddtree.build_tree(lp[:, :0], ids[:, :0], 0)
    assert t.num_nodes.tolist() == [1]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_topk_bad_args(backend, device):
    x = torch.randn(2, 3, 10, device=device)
    with pytest.raises(ValueError, match="logits"):
        ddtree.topk_logprobs(x[0], 2, backend=backend)
    with pytest.raises(ValueError, match="logits"):
        ddtree.topk_logprobs(x.to(torch.int32), 2, backend=backend)
    with pytest.raises(ValueError, match="k"):
        ddtree.topk_logprobs(x, 0, backend=backend)
    with pytest.raises(ValueError, match="k must be <="):
        ddtree.topk_logprobs(x, 11, backend=backend)
    bad = x.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ddtree.topk_logprobs(bad, 2, backend=backend)
    dead = x.clone()
    dead[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="-inf"):
        ddtree.topk_logprobs(dead, 2, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_accept_bad_args(backend, device):
    lp, ids = good(device)
    tree = ddtree.build_tree(lp, ids, 3)
    with pytest.raises(ValueError, match="tree"):
        ddtree.accept_greedy("tree", torch.zeros(1, 4, dtype=torch.int64), backend=backend)
    with pytest.raises(ValueError, match="target_tokens"):
        ddtree.accept_greedy(tree, torch.zeros(1, 3, dtype=torch.int64, device=device), backend=backend)
    with pytest.raises(ValueError, match="target_tokens"):
        ddtree.accept_greedy(tree, torch.zeros(1, 4, dtype=torch.float32, device=device), backend=backend)
    with pytest.raises(ValueError, match="target_tokens"):
        ddtree.accept_greedy(tree, torch.full((1, 4), -1, dtype=torch.int64, device=device),
                             backend=backend)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lp = torch.tensor([[[-0.5, -1.0]]])
    ids = torch.tensor([[[3, 4]]])
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ddtree.build_tree(lp, ids, 2)
