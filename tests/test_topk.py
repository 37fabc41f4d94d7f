"""topk_logprobs: Triton vs torch (stable sort + logsumexp in fp32) and the numpy reference."""
import os
import types
import pytest
import torch

from conftest import HAS_CUDA
from helpers import drafter_logits
from sglang_ddtree import ddtree
from sglang_ddtree.kernels.topk_logprobs import topk_logprobs_torch


def check(logits, k, atol=2e-5):
    lp, ids = ddtree.topk_logprobs(logits, k)
    assert lp.shape == (*logits.shape[:2], k) and lp.dtype == torch.float32
    assert ids.shape == lp.shape and ids.dtype == torch.int64
    assert (lp[..., 1:] <= lp[..., :-1]).all(), "rows must come out sorted descending"
    want_lp, want_ids = topk_logprobs_torch(logits, k)
    # selection and order are exact (they depend only on the logits and ids)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    fin = torch.isfinite(want_lp)
    assert torch.equal(torch.isfinite(lp), fin)
    torch.testing.assert_close(lp[fin].cpu(), want_lp[fin].cpu(), atol=atol, rtol=1e-6)
    # values are exactly logit - logZ with one logZ per row: differences are exact
    gathered = torch.gather(logits.float(), 2, ids)
    off = (gathered - lp)[fin]
    logz = (gathered - lp)[..., :1].expand_as(lp)[fin]
    assert torch.equal(off, logz) or torch.allclose(off, logz, atol=1e-6, rtol=0)
    return lp, ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [1, 8, 32, 64, 256])
def test_random_rows(dtype, k, rng, device):
    bs = int(torch.randint(1, 9 if HAS_CUDA else 3, (1,), generator=rng))
    D = int(torch.randint(1, 17 if HAS_CUDA else 4, (1,), generator=rng))
    V = int(torch.randint(k, 5000, (1,), generator=rng))
    check(drafter_logits(bs, D, V, rng, dtype=dtype).to(device), k)


@pytest.mark.parametrize("V", [32000, 151936, 163840])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_vocab(V, dtype, rng, device):
    bs, D = (8, 16) if HAS_CUDA else (1, 2)
    check(drafter_logits(bs, D, V, rng, dtype=dtype).to(device), 32)


@pytest.mark.parametrize("k", [8, 64, 128, 256])
@pytest.mark.parametrize("bs", [1, 4])
def test_split_rows(k, bs, rng, device):
    """Few rows: each row is split over several programs and merged (every k width)."""
    V = 151936 if HAS_CUDA else 9000
    check(drafter_logits(bs, 16 if HAS_CUDA else 1, V, rng).to(device), k)


def test_ties_take_smaller_id(device):
    """Equal logits (also -0.0 vs +0.0) order by token id, across chunk boundaries."""
    V = 3000
    x = torch.zeros(1, 2, V)
    x[0, 0, ::7] = 1.0  # many exact ties at the top
    x[0, 1, :] = -0.0
    x[0, 1, 1500:] = 0.0
    x[0, 1, 2999] = 0.5
    lp, ids = check(x.bfloat16().to(device), 16)
    assert ids[0, 0].tolist() == list(range(0, 16 * 7, 7))
    assert ids[0, 1].tolist() == [2999] + list(range(15))


def test_neg_inf_logits(rng, device):
    logits = drafter_logits(2, 3, 500, rng, neg_inf_frac=0.97).to(device)
    lp, ids = check(logits, 64)
    assert torch.isinf(lp).any()


def test_matches_numpy_reference(rng, device):
    logits = drafter_logits(2, 3, 2000, rng).to(device)
    lp, ids = ddtree.topk_logprobs(logits, 20)
    lp2, ids2 = ddtree.topk_logprobs(logits, 20, backend="reference")
    assert torch.equal(ids.cpu(), ids2.cpu())
    torch.testing.assert_close(lp.cpu(), lp2.cpu(), atol=2e-5, rtol=0)


def test_poisoned_outputs_are_overwritten(rng, device):
    logits = drafter_logits(3, 4, 700, rng).to(device)
    k = 24
    out = (torch.full((3, 4, k), float("nan"), device=device),
           torch.full((3, 4, k), -999, dtype=torch.int64, device=device))
    lp, ids = ddtree.topk_logprobs(logits, k, out=out)
    assert lp.data_ptr() == out[0].data_ptr()
    want_lp, want_ids = topk_logprobs_torch(logits, k)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(lp.cpu(), want_lp.cpu(), atol=2e-5, rtol=0)


def test_non_contiguous_rows(rng, device):
    big = drafter_logits(2, 3, 1200, rng).to(device)
    logits = big[:, :, :1000]  # row stride 1200
    check(logits, 16)


@pytest.mark.parametrize("P", [1, 2, 3, 8])
def test_vocab_shards_merge_like_one_pass(P, rng, device):
    """Tensor parallelism: per-shard partials (any shard order) merge to the full-row result."""
    from sglang_ddtree.kernels.topk_logprobs import topk_merge_triton, topk_partial_triton
    R, V, k = 6, 4000, 32
    logits = drafter_logits(1, R, V, rng)[0].to(device)
    cuts = sorted(torch.randperm(V - 1, generator=rng)[:P - 1].add(1).tolist())
    bounds = list(zip([0] + cuts, cuts + [V]))
    order = torch.randperm(P, generator=rng).tolist()  # gather order does not matter
    parts = [topk_partial_triton(logits[:, lo:hi].contiguous(), k, lo)
             for lo, hi in (bounds[i] for i in order)]
    m = torch.stack([p[0] for p in parts])
    s = torch.stack([p[1] for p in parts])
    keys = torch.stack([p[2] for p in parts])
    lp, ids = topk_merge_triton(m, s, keys, k)
    want_lp, want_ids = topk_logprobs_torch(logits, k)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(lp.cpu(), want_lp.cpu(), atol=2e-5, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter shim only acts under TRITON_INTERPRET")
def test_interpreter_reads_one_element_scalars_like_numpy_2_4_wants():
    """NumPy >= 2.4 refuses int() of a one-element 1-d array, which Triton 3.6's interpreter does for
    every runtime loop bound; the suite turns the NumPy 2.3 deprecation into an error (conftest), so
    every interpreter kernel test here runs as it would on NumPy 2.4.  The shim's own contract:"""
    import numpy as np
    from triton.runtime import interpreter
    from sglang_ddtree.kernels import _interpreter_compat

    assert _interpreter_compat.apply() and getattr(interpreter._patch_lang_tensor, "_ddtree_scalar_index", False)
    one = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([7], dtype=np.int32)))
    zero_d = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array(5, dtype=np.int64)))
    assert _interpreter_compat._scalar_index(one) == 7 and _interpreter_compat._scalar_index(zero_d) == 5
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises((DeprecationWarning, TypeError)):  # the interpreter's own conversion (2.3 / 2.4)
            int(np.array([7], dtype=np.int32))
