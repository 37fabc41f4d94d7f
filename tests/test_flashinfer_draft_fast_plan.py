"""patches/flashinfer_draft_fast_plan.py and its worker side (the A/B switch ``draft_fast_plan``):
only a marked flashinfer backend's TARGET_VERIFY graphs, at capture and without a custom mask, get
SGLang's ``fast_prefill_plan`` as their wrappers' ``begin_forward``; the worker marks only a covered
drafter backend, and while it is marked hands the drafter's forward a host length bound of prefix
+ B (its plan reads the KV lengths from there).  CPU: fakes for the backend, SGLang's real
``fast_prefill_plan`` and ``FlashInferAttnBackend`` class where they import.  The plan itself
needs the GPU (not yet run there)."""
import functools
import types

import pytest
import torch

fi = pytest.importorskip("sglang.srt.layers.attention.flashinfer_backend")
from sglang_ddtree import worker as W  # noqa: E402
from sglang_ddtree.patches import flashinfer_draft_fast_plan as FP  # noqa: E402


class _Mode:
    def __init__(self, verify):
        self.verify = verify

    def is_target_verify(self):
        return self.verify


def _backend(marked=True, bs=4):
    orig = [types.SimpleNamespace(begin_forward="plan") for _ in range(2)]
    b = types.SimpleNamespace(prefill_cuda_graph_metadata={bs: orig})
    if marked:
        setattr(b, FP.MARK, True)
    return b, orig


def _fb(verify=True, bs=4, mask=None):
    return types.SimpleNamespace(forward_mode=_Mode(verify), batch_size=bs,
                                 spec_info=types.SimpleNamespace(custom_mask=mask, ragged_verify_layout=None))


def test_only_a_marked_backends_verify_capture_without_a_mask_gets_the_fast_plan():
    calls = []

    def original(self, fb, *a, **k):
        calls.append((fb, a, k))
        return "meta"

    b, ws = _backend()
    assert FP.fast_plan_out_graph(original, b, _fb(), in_capture=True) == "meta" and len(calls) == 1
    for w in ws:
        assert isinstance(w.begin_forward, functools.partial)
        assert w.begin_forward.func is fi.fast_prefill_plan and w.begin_forward.args == (w,)
    # controls: each condition alone leaves SGLang's plan() (and SGLang's call always runs)
    for kw, fb in ((dict(marked=False), _fb()), ({}, _fb(verify=False)), ({}, _fb(mask=torch.ones(1)))):
        b, ws = _backend(**kw)
        FP.fast_plan_out_graph(original, b, fb, in_capture=True)
        assert [w.begin_forward for w in ws] == ["plan", "plan"]
    b, ws = _backend()
    FP.fast_plan_out_graph(original, b, _fb(), False)            # a replay (in_capture positional)
    assert [w.begin_forward for w in ws] == ["plan", "plan"] and len(calls) == 5


def test_enable_marks_only_a_covered_flashinfer_backend():
    with pytest.raises(ValueError, match="not FlashInferAttnBackend"):
        FP.enable(types.SimpleNamespace())
    b = object.__new__(fi.FlashInferAttnBackend)
    b.prefill_backend, b.dispatch_reason = "fa3", None
    with pytest.raises(ValueError, match="not fa2"):
        FP.enable(b)
    b.prefill_backend, b.dispatch_reason = "fa2", "SLIDING_WINDOW"
    with pytest.raises(ValueError, match="dispatch"):
        FP.enable(b)
    assert not getattr(b, FP.MARK, False)
    b.dispatch_reason = None
    FP.enable(b)
    assert getattr(b, FP.MARK) is True
    assert W.enable_draft_fast_plan(types.SimpleNamespace(), "DDTREE-GPU") is False   # logged, not raised


@pytest.mark.parametrize("fast", [False, True])
def test_the_drafters_host_lengths_bound_its_kv_while_marked(monkeypatch, fast):
    """The drafter's ForwardBatch: seq_lens_cpu is the host prefix bound, + B per request while the
    fast plan is on (its plan's KV lengths; the prefix bound alone may fall short by up to B)."""
    seen = {}

    class Stop(Exception):
        pass

    def fb(**kw):
        seen.update(kw)
        return types.SimpleNamespace(**kw)

    def forward(draft_fb):
        raise Stop

    monkeypatch.setattr(W, "ForwardBatch", fb)
    B, bs = 4, 2
    w = object.__new__(W.DDTreeWorker)
    model = types.SimpleNamespace(get_input_embeddings=lambda: (lambda ids: torch.zeros(*ids.shape, 8)))
    w.__dict__.update(block_size=B, topk=2, _draft_fast_plan=fast, _draft_block_spec_info=None,
                      _target_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model)),
                      draft_model_runner=types.SimpleNamespace(forward=forward))
    host = torch.tensor([10, 20], dtype=torch.int32)
    zeros = torch.zeros(bs, B, dtype=torch.int64)
    with pytest.raises(Stop):
        w._draft_block(types.SimpleNamespace(req_pool_indices=torch.zeros(bs, dtype=torch.int64)), zeros, zeros,
                       zeros, torch.tensor([9, 19]), host, 30, bs)
    want = [14, 24] if fast else [10, 20]
    assert seen["seq_lens_cpu"].tolist() == want and seen["seq_lens_sum"] == sum(want)
    assert host.tolist() == [10, 20]                          # the round's own bound is left as it was
