"""patches/triton_cuda_graph_state.py: a DDTREE target's verify graph state keeps SGLang's buffers but
sizes the decode split-KV scratch by what reads it (decode rows, or our verify attention's workspace),
run through SGLang 0.5.16's own ``TritonAttnBackend.init_cuda_graph_state`` on the CPU."""
import types

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.triton_backend")

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402

from sglang_ddtree.config import SETTINGS_ATTR  # noqa: E402
from sglang_ddtree.patches import triton_cuda_graph_state as P  # noqa: E402
from sglang_ddtree import verify_attn_hook as V  # noqa: E402

ORIGINAL = getattr(TritonAttnBackend.init_cuda_graph_state, "__wrapped__", TritonAttnBackend.init_cuda_graph_state)


def _sa(algo="DDTREE-GPU", budget=15):
    return types.SimpleNamespace(speculative_algorithm=algo, **{SETTINGS_ATTR: {"budget": budget, "block_size": 16}})


def _backend(H=8, DV=64, splits=16, ctx=128, draft=False):
    return types.SimpleNamespace(num_head=H, v_head_dim=DV, swa_v_head_dim=None, max_kv_splits=splits,
                                 max_context_len=ctx, device=torch.device("cpu"), skip_prefill=False,
                                 is_draft_runner=draft, sliding_window_size=None,
                                 use_sliding_window_kv_pool=False, _translate_kv_loc=None)


@pytest.fixture(autouse=True)
def _fresh_pool():
    P._SHARED.clear()
    yield
    P._SHARED.clear()


def _run(backend, max_bs, width, sa):
    orig = P._server_args
    P._server_args = lambda: sa
    try:
        P.init_cuda_graph_state_ddtree(ORIGINAL, backend, max_bs, max_bs * width)
    finally:
        P._server_args = orig
    return backend


@pytest.mark.parametrize("H,DV,splits,max_bs,width", [(8, 64, 16, 4, 17), (16, 512 + 0, 128, 3, 32), (2, 32, 8, 1, 9)])
def test_ddtree_target_scratch_is_decode_sized_and_the_rest_is_sglangs(H, DV, splits, max_bs, width):
    ours = _run(_backend(H, DV, splits), max_bs, width, _sa())
    ref = _backend(H, DV, splits)
    ORIGINAL(ref, max_bs, max_bs * width)
    assert ref.cuda_graph_attn_logits.shape == (max_bs * width, H, splits, DV)   # SGLang: every verify row
    assert ours.cuda_graph_attn_logits.shape == (max_bs, H, splits, DV)
    assert ours.cuda_graph_attn_lse.shape == (max_bs, H, splits)
    assert ours.max_kv_splits == splits
    assert ours.cuda_graph_num_kv_splits.shape == ref.cuda_graph_num_kv_splits.shape
    assert bool((ours.cuda_graph_num_kv_splits == splits).all())
    for name in ("cuda_graph_kv_indices", "cuda_graph_custom_mask"):
        assert getattr(ours, name).shape == getattr(ref, name).shape, name
    saved = (ref.cuda_graph_attn_logits.numel() + ref.cuda_graph_attn_lse.numel()
             - ours.cuda_graph_attn_logits.numel() - ours.cuda_graph_attn_lse.numel()) * 4
    assert saved == P.saved_bytes(H, DV, splits, max_bs, width)


def test_kimi_k2_widths_arithmetic():
    # 64 heads, kv_lora 512, 128 splits, max bs 64: a budget-31 verify graph's scratch
    assert P.saved_bytes(64, 512, 128, 64, 32) > 30 * 2 ** 30
    assert P.saved_bytes(64, 512, 128, 64, 17) > 15 * 2 ** 30


@pytest.mark.parametrize("case", ["dflash", "draft", "decode_graph", "no_context"])
def test_everything_else_is_sglangs_sizing(case):
    sa = _sa("DFLASH") if case == "dflash" else _sa()
    b = _backend(draft=case == "draft")
    width = 1 if case == "decode_graph" else 17
    if case == "no_context":
        orig = P._server_args

        def boom():
            raise RuntimeError("no runtime context")
        P._server_args = boom
        try:
            P.init_cuda_graph_state_ddtree(ORIGINAL, b, 4, 4 * width)
        finally:
            P._server_args = orig
    else:
        _run(b, 4, width, sa)
    assert b.cuda_graph_attn_logits.shape == (4 * width, 8, 16, 64)
    assert not P._SHARED


def test_verify_attention_workspace_fits_and_is_a_view():
    b = _backend(H=4, DV=32, splits=16)
    state = V.VerifyAttnState(num_verify=9, mask_words=torch.zeros(2, 9, 1, dtype=torch.int32),
                              num_splits=5, use_mla=False)
    setattr(b, V.STATE_ATTR, state)
    _run(b, 2, 9, _sa(budget=8))
    T, NS = 2 * 9, state.num_splits + 1
    assert b.cuda_graph_attn_logits.numel() >= T * 4 * NS * 32
    o, l = V._workspace(b, T, 4, NS, 32, torch.device("cpu"))
    assert o.data_ptr() == b.cuda_graph_attn_logits.data_ptr()
    assert l.data_ptr() == b.cuda_graph_attn_lse.data_ptr()
    # still a decode-shaped buffer at the real split count
    assert b.cuda_graph_attn_logits.shape[1:] == (4, 16, 32)


def test_width_backends_share_the_widest_scratch():
    wide = _run(_backend(), 4, 32, _sa(budget=31))
    narrow = _run(_backend(), 4, 8, _sa(budget=31))
    assert narrow.cuda_graph_attn_logits.data_ptr() == wide.cuda_graph_attn_logits.data_ptr()
    assert narrow.cuda_graph_attn_lse.data_ptr() == wide.cuda_graph_attn_lse.data_ptr()
    # a later, larger request gets its own larger buffer; the earlier view stays valid
    state = V.VerifyAttnState(num_verify=32, mask_words=torch.zeros(4, 32, 1, dtype=torch.int32),
                              num_splits=7, use_mla=False)
    big = _backend()
    setattr(big, V.STATE_ATTR, state)
    _run(big, 4, 32, _sa(budget=31))
    assert big.cuda_graph_attn_logits.numel() >= 4 * 32 * 8 * 8 * 64
    assert wide.cuda_graph_attn_logits.shape == (4, 8, 16, 64)
