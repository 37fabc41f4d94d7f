"""tree_verify_attention (GQA) and tree_verify_attention_mla (absorbed MLA): the Triton kernels
against the dense torch reference in kernels/tree_verify_attention.py, and that reference against a
naive per-query loop whose mask comes from the tree's parent array (not from the mask words).

Inputs are fresh every run: trees from ``ddtree.build_tree`` on random drafter log-probs (real
ancestor masks), random prefix lengths (0 included, not multiples of the kernel's block), KV slots
scattered over a pool through a shuffled ``req_to_token``, random pool rows per request.
Tolerances: fp32 inputs 1e-4 (abs + rel), bf16 inputs 2e-2 (abs + rel) against the reference run
on the same bf16 values in fp32.
"""
import math

import pytest
import torch

from helpers import drafter_logits, logprobs_from_logits
from sglang_ddtree import ddtree
from sglang_ddtree.kernels.tree_verify_attention import (
    default_num_splits, tree_verify_attention, tree_verify_attention_mla,
    tree_verify_attention_mla_torch, tree_verify_attention_torch, unpack_mask_words_torch)

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def randint(lo, hi, rng):
    return int(torch.randint(lo, hi + 1, (1,), generator=rng))


def make_tree(bs, N, rng, device):
    """A DDTree of budget N-1 (draft depth 1-7) from random drafter log-probs."""
    budget = N - 1
    D = randint(1, 7, rng)
    V = 4 * budget
    lp, ids = logprobs_from_logits(drafter_logits(bs, D, V, rng), min(budget, V))
    tree = ddtree.build_tree(lp, ids, budget, backend="reference")
    return tree.parent.to(device), tree.mask_words.to(device).contiguous()


def make_paged(bs, N, prefixes, rng, device):
    """Shuffled slots: req_to_token rows of a pool larger than bs, random rows per request."""
    lens = [p + N for p in prefixes]
    S = sum(lens) + 37
    width = max(lens) + 11
    pool_rows = bs + 3
    perm = torch.randperm(S, generator=rng)
    r2t = torch.randint(0, S, (pool_rows, width), generator=rng)  # junk beyond each request
    rpi = torch.randperm(pool_rows, generator=rng)[:bs]
    off = 0
    for b in range(bs):
        r2t[rpi[b], :lens[b]] = perm[off:off + lens[b]]
        off += lens[b]
    return (S, r2t.to(torch.int32).to(device), rpi.to(torch.int64).to(device),
            torch.tensor(prefixes, dtype=torch.int32, device=device))


def draw_prefixes(bs, hi, rng):
    ps = [randint(0, hi, rng) for _ in range(bs)]
    if bs > 1:
        ps[randint(0, bs - 1, rng)] = 0 if randint(0, 1, rng) else randint(1, 5, rng)
    return ps


def gqa_case(bs, N, prefixes, Hkv, G, D, Dv, dtype, rng, device):
    parent, words = make_tree(bs, N, rng, device)
    S, r2t, rpi, plen = make_paged(bs, N, prefixes, rng, device)
    q = torch.randn(bs * N, Hkv * G, D, generator=rng).to(dtype).to(device)
    k = torch.randn(S, Hkv, D, generator=rng).to(dtype).to(device)
    v = torch.randn(S, Hkv, Dv, generator=rng).to(dtype).to(device)
    return dict(q=q, k_cache=k, v_cache=v, req_to_token=r2t, req_pool_indices=rpi,
                prefix_lens=plen, mask_words=words, sm_scale=1.0 / math.sqrt(D)), parent


def mla_case(bs, N, prefixes, H, L, R, dtype, rng, device):
    parent, words = make_tree(bs, N, rng, device)
    S, r2t, rpi, plen = make_paged(bs, N, prefixes, rng, device)
    qn = torch.randn(bs * N, H, L, generator=rng).to(dtype).to(device)
    qr = torch.randn(bs * N, H, R, generator=rng).to(dtype).to(device)
    kv = torch.randn(S, 1, L + R, generator=rng).to(dtype).to(device)
    return dict(q_nope_absorbed=qn, q_rope=qr, kv_cache=kv, req_to_token=r2t,
                req_pool_indices=rpi, prefix_lens=plen, mask_words=words,
                sm_scale=1.0 / math.sqrt(128 + R)), parent


def close(got, want, dtype):
    tol = TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


def ancestors(parent_row, i):
    out = set()
    while i >= 0:
        out.add(i)
        i = int(parent_row[i])
    return out


def test_reference_against_naive_loop(rng, device):
    """Tiny GQA and MLA cases: per query, per head, a Python softmax over the visible slots."""
    bs, N, Hkv, G, D, Dv = 2, 6, 2, 2, 8, 4
    args, parent = gqa_case(bs, N, [0, 7], Hkv, G, D, Dv, torch.float32, rng, device)
    ref = tree_verify_attention_torch(**args).cpu().double()
    q, k, v = (args[n].cpu().double() for n in ("q", "k_cache", "v_cache"))
    r2t, rpi, plen = (args[n].cpu() for n in ("req_to_token", "req_pool_indices", "prefix_lens"))
    par = parent.cpu()
    for b in range(bs):
        L = int(plen[b])
        row = r2t[int(rpi[b])]
        for i in range(N):
            seen = list(range(L)) + [L + j for j in sorted(ancestors(par[b], i))]
            slots = [int(row[c]) for c in seen]
            for h in range(Hkv * G):
                kh = h // G
                s = [float(q[b * N + i, h] @ k[sl, kh]) * args["sm_scale"] for sl in slots]
                mx = max(s)
                w = [math.exp(x - mx) for x in s]
                o = sum(wi * v[sl, kh] for wi, sl in zip(w, slots)) / sum(w)
                torch.testing.assert_close(ref[b * N + i, h], o, atol=1e-5, rtol=1e-5)

    margs, parent = mla_case(1, 5, [9], 3, 16, 8, torch.float32, rng, device)
    ref = tree_verify_attention_mla_torch(**margs, kv_lora_rank=16).cpu().double()
    qn, qr, kv = (margs[n].cpu().double() for n in ("q_nope_absorbed", "q_rope", "kv_cache"))
    row = margs["req_to_token"].cpu()[int(margs["req_pool_indices"][0])]
    for i in range(5):
        slots = [int(row[c]) for c in list(range(9)) + [9 + j for j in ancestors(parent.cpu()[0], i)]]
        for h in range(3):
            s = [float(qn[i, h] @ kv[sl, 0, :16] + qr[i, h] @ kv[sl, 0, 16:]) * margs["sm_scale"]
                 for sl in slots]
            mx = max(s)
            w = [math.exp(x - mx) for x in s]
            o = sum(wi * kv[sl, 0, :16] for wi, sl in zip(w, slots)) / sum(w)
            torch.testing.assert_close(ref[i, h], o, atol=1e-5, rtol=1e-5)


def test_unpack_matches_tree_visibility(rng, device):
    for N in (2, 33, 65):
        lp, ids = logprobs_from_logits(drafter_logits(2, 5, 4 * N, rng), N - 1)
        tree = ddtree.build_tree(lp, ids, N - 1, backend="reference")
        assert torch.equal(unpack_mask_words_torch(tree.mask_words, N).cpu(), tree.visibility.cpu())


# (bs, N, max prefix, Hkv, G, D, Dv, dtype, num_splits or None = from max_prefix)
GQA_CASES = [
    (1, 2, 0, 1, 1, 64, 64, torch.float32, None),
    (2, 17, 300, 2, 4, 128, 128, torch.bfloat16, None),
    (3, 33, 300, 1, 8, 64, 64, torch.float32, 3),
    (4, 9, 200, 2, 1, 128, 128, torch.bfloat16, 5),
    (2, 5, 150, 1, 4, 64, 32, torch.float32, 1),
    (1, 65, 130, 1, 4, 64, 64, torch.bfloat16, 2),
    (16, 4, 60, 1, 1, 64, 64, torch.bfloat16, 2),
    (2, 7, 90, 2, 2, 80, 48, torch.float16, 3),
]


@pytest.mark.parametrize("case", GQA_CASES, ids=lambda c: f"bs{c[0]}-N{c[1]}-P{c[2]}-G{c[4]}-D{c[5]}-{str(c[7])[6:]}")
def test_gqa_against_reference(case, rng, device):
    bs, N, P, Hkv, G, D, Dv, dtype, ns = case
    prefixes = draw_prefixes(bs, P, rng)
    args, _ = gqa_case(bs, N, prefixes, Hkv, G, D, Dv, dtype, rng, device)
    print("prefixes", prefixes)
    got = tree_verify_attention(**args, num_splits=ns, max_prefix=max(prefixes))
    close(got, tree_verify_attention_torch(**args), dtype)


@pytest.mark.parametrize("draw", range(3))
def test_gqa_random_configs(draw, rng, device):
    """bs 1-4, N 2-33, prefix 0-300, G 1/4/8, D 64/128, fp32 or bf16, 1-6 splits or the default."""
    pick = lambda xs: xs[randint(0, len(xs) - 1, rng)]
    bs, N = randint(1, 4, rng), randint(2, 33, rng)
    Hkv, G, D, dtype = pick([1, 2]), pick([1, 4, 8]), pick([64, 128]), pick([torch.float32, torch.bfloat16])
    if Hkv * G * N > 160:
        Hkv = 1
    ns = pick([None, 1, 2, 6])
    prefixes = draw_prefixes(bs, 300, rng)
    print("config", bs, N, Hkv, G, D, dtype, ns, prefixes)
    args, _ = gqa_case(bs, N, prefixes, Hkv, G, D, D, dtype, rng, device)
    got = tree_verify_attention(**args, num_splits=ns, max_prefix=max(prefixes))
    close(got, tree_verify_attention_torch(**args), dtype)


def test_long_prefix(rng, device):
    """One prefix of ~3000 tokens over the default split rule (12 splits of 256)."""
    P = randint(2900, 3100, rng)
    args, _ = gqa_case(1, 9, [P], 1, 4, 64, 64, torch.bfloat16, rng, device)
    assert default_num_splits(P) == -(-P // 256)
    got = tree_verify_attention(**args, max_prefix=P)
    close(got, tree_verify_attention_torch(**args), torch.bfloat16)


@pytest.mark.parametrize("bs,N,H,dtype", [(2, 17, 4, torch.bfloat16), (1, 9, 2, torch.float32),
                                          (3, 5, 16, torch.bfloat16)])
def test_mla_against_reference(bs, N, H, dtype, rng, device):
    prefixes = draw_prefixes(bs, 200, rng)
    args, _ = mla_case(bs, N, prefixes, H, 512, 64, dtype, rng, device)
    got = tree_verify_attention_mla(**args, kv_lora_rank=512, num_splits=2)
    close(got, tree_verify_attention_mla_torch(**args, kv_lora_rank=512), dtype)


def test_poisoned_out_and_split_invariance(rng, device):
    """``out`` full of NaN is overwritten in place; 1, 4 and the pool-size default of splits agree."""
    prefixes = draw_prefixes(3, 250, rng)
    args, _ = gqa_case(3, 11, prefixes, 2, 2, 64, 64, torch.float32, rng, device)
    want = tree_verify_attention_torch(**args)
    out = torch.full_like(want, float("nan"))
    got = tree_verify_attention(**args, out=out, num_splits=4)
    assert got.data_ptr() == out.data_ptr()
    close(out, want, torch.float32)
    for ns in (1, None):
        close(tree_verify_attention(**args, num_splits=ns), want, torch.float32)
    ws = (torch.full((33, 4, 3, 64), float("nan"), device=device),
          torch.full((33, 4, 3), float("nan"), device=device))
    close(tree_verify_attention(**args, num_splits=2, workspace=ws), want, torch.float32)

    margs, _ = mla_case(1, 3, [randint(0, 80, rng)], 2, 512, 64, torch.bfloat16, rng, device)
    mout = torch.full((3, 2, 512), float("nan"), dtype=torch.bfloat16, device=device)
    tree_verify_attention_mla(**margs, kv_lora_rank=512, out=mout, num_splits=3)
    close(mout, tree_verify_attention_mla_torch(**margs, kv_lora_rank=512), torch.bfloat16)


def test_dropped_mask_bit_changes_output(rng, device):
    """Clearing one ancestor bit (root column of a deep row) changes that row and only that row."""
    N, P = 17, randint(5, 60, rng)
    args, parent = gqa_case(1, N, [P], 1, 2, 64, 64, torch.float32, rng, device)
    base = tree_verify_attention(**args, num_splits=2).cpu()
    i = max(range(1, N), key=lambda r: len(ancestors(parent.cpu()[0], r)))
    words = args["mask_words"].clone()
    assert int(words[0, i, 0]) & 1
    words[0, i, 0] = int(words[0, i, 0]) & ~1
    args["mask_words"] = words
    dropped = tree_verify_attention(**args, num_splits=2).cpu()
    close(dropped, tree_verify_attention_torch(**args), torch.float32)
    diff = (dropped - base).abs().amax(dim=(1, 2))
    assert diff[i] > 1e-3
    assert torch.all(diff[torch.arange(N) != i] == 0)


def test_bad_shapes(rng, device):
    args, _ = gqa_case(2, 5, [3, 4], 2, 2, 16, 16, torch.float32, rng, device)
    with pytest.raises(ValueError):
        tree_verify_attention(**{**args, "mask_words": args["mask_words"][:, :4]})
    with pytest.raises(ValueError):
        tree_verify_attention(**{**args, "q": args["q"][:, :3]})
    with pytest.raises(ValueError):
        tree_verify_attention(**args, out=torch.empty(10, 4, 8, device=device))


def test_public_api_in_ddtree(rng, device):
    """``sglang_ddtree.ddtree.tree_verify_attention[_mla]``: the stable API the worker and tests bind
    to; both backends agree, ``out`` (poisoned) is written in place, and bad arguments raise."""
    bs, N = 3, 9
    prefixes = draw_prefixes(bs, 120, rng)
    args, _ = gqa_case(bs, N, prefixes, 2, 4, 64, 64, torch.bfloat16, rng, device)
    want = ddtree.tree_verify_attention(**args, backend="reference")
    out = torch.full_like(want, float("nan"))
    got = ddtree.tree_verify_attention(**args, out=out, num_splits=2)
    assert got.data_ptr() == out.data_ptr()
    close(got, want, torch.bfloat16)
    ref_out = torch.full_like(want, float("nan"))
    assert ddtree.tree_verify_attention(**args, backend="reference", out=ref_out) is ref_out
    close(ref_out, want, torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        ddtree.tree_verify_attention(**args, backend="reference", out=want[:, :1])
    with pytest.raises(ValueError, match="backend must be one of"):
        ddtree.tree_verify_attention(**args, backend="cuda")
    margs, _ = mla_case(2, 5, draw_prefixes(2, 60, rng), 4, 512, 64, torch.bfloat16, rng, device)
    close(ddtree.tree_verify_attention_mla(**margs, kv_lora_rank=512, num_splits=1),
          ddtree.tree_verify_attention_mla(**margs, kv_lora_rank=512, backend="reference"), torch.bfloat16)
