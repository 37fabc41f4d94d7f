"""``sampling.verify_target_probs`` (the sampled verify's target distribution) against a plain
float64 per-row reference of SGLang's sampler semantics (joint top-k / top-p, then min-p), on random
logits and per-request parameters drawn fresh each run; chunked and unchunked; and on CUDA against
SGLang's own DFlash builder where the two semantics coincide (top-k and temperature only)."""
import pytest
import torch

from sglang_ddtree import sampling as S

TOL = 1e-5   # fp32 softmax vs the float64 reference


def _params(rng, bs, V):
    temps = 0.3 + 1.2 * torch.rand(bs, 1, generator=rng)
    ks = torch.where(torch.rand(bs, generator=rng) < 0.4, torch.full((bs,), S.TOP_K_ALL),
                     torch.randint(1, V + 3, (bs,), generator=rng))
    ps = torch.where(torch.rand(bs, generator=rng) < 0.4, torch.ones(bs), 0.05 + 0.9 * torch.rand(bs, generator=rng))
    ms = torch.where(torch.rand(bs, generator=rng) < 0.5, torch.zeros(bs), 0.3 * torch.rand(bs, generator=rng))
    return temps, ks, ps, ms


@pytest.mark.parametrize("chunk", [None, 37])
@pytest.mark.parametrize("V,N,bs", [(7, 3, 5), (50, 5, 4), (300, 2, 3)])
def test_matches_the_reference(rng, device, monkeypatch, chunk, V, N, bs):
    if chunk:
        monkeypatch.setattr(S, "CHUNK_ELEMS", chunk)
        monkeypatch.setattr(S, "SORT_CHUNK_ELEMS", chunk)
    for trial in range(4):
        temps, ks, ps, ms = _params(rng, bs, V)
        logits = torch.randn(bs * N, V, generator=rng) * (1 + 3 * torch.rand(1, generator=rng))
        need_k, need_p, need_m = bool((ks != S.TOP_K_ALL).any()), bool((ps < 1).any()), bool((ms > 0).any())
        out = torch.full((bs * N, V), float("nan"), device=device)       # poisoned
        got = S.verify_target_probs(logits.to(device), temperatures=temps.to(device), top_ks=ks.to(device),
                                    top_ps=ps.to(device), min_ps=ms.to(device), num_slots=N, need_top_k=need_k,
                                    need_top_p=need_p, need_min_p=need_m, out=out)
        assert got is out
        ref = S.verify_target_probs_reference(logits, temps, ks, ps, ms if need_m else None, N)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu().double(), ref, atol=TOL, rtol=0)
        # the same support (up to fp32 underflow of probabilities below 1e-30)
        g = got.cpu()
        assert not ((g > 0) & (ref == 0)).any()
        assert not ((g == 0) & (ref > 1e-30)).any()


def test_greedy_rows_are_one_hot(rng, device):
    bs, N, V = 3, 4, 64
    logits = torch.randn(bs * N, V, generator=rng)
    got = S.verify_target_probs(logits.to(device), temperatures=torch.ones(bs, 1, device=device),
                                top_ks=torch.ones(bs, dtype=torch.int64, device=device),
                                top_ps=torch.ones(bs, device=device), min_ps=None, num_slots=N,
                                need_top_k=True, need_top_p=False, need_min_p=False, max_top_k=1)
    assert torch.equal(got.argmax(-1).cpu(), logits.argmax(-1))
    assert torch.equal((got > 0).sum(-1).cpu(), torch.ones(bs * N, dtype=torch.int64))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="rows"):
        S.verify_target_probs(torch.zeros(5, 4), temperatures=torch.ones(2, 1), top_ks=torch.ones(2),
                              top_ps=torch.ones(2), min_ps=None, num_slots=3, need_top_k=False,
                              need_top_p=False, need_min_p=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang's builder needs CUDA (sgl-kernel)")
def test_equals_sglang_dflash_builder_where_semantics_coincide(rng):
    import types
    from sglang.srt.speculative.dflash_utils import build_dflash_verify_target_probs
    bs, N, V = 6, 9, 4096
    logits = (torch.randn(bs * N, V, generator=rng) * 3).cuda()
    temps = (0.5 + torch.rand(bs, 1, generator=rng)).cuda()
    ks = torch.randint(1, 200, (bs,), generator=rng).cuda()
    info = types.SimpleNamespace(temperatures=temps, top_ks=ks, top_ps=torch.ones(bs).cuda(),
                                 need_top_k_sampling=True, need_top_p_sampling=False)
    theirs = build_dflash_verify_target_probs(next_token_logits=logits, sampling_info=info, draft_token_num=N,
                                              bs=bs).view(bs * N, V)
    ours = S.verify_target_probs(logits, temperatures=temps, top_ks=ks, top_ps=torch.ones(bs).cuda(),
                                 min_ps=None, num_slots=N, need_top_k=True, need_top_p=False, need_min_p=False)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
