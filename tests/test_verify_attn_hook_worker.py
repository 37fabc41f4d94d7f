"""The worker's side of ``SGLANG_DDTREE_VERIFY_ATTN=ddtree`` (CPU): start-up enables the hook's state on
the target's verify backend only (behind HybridAttnBackend; each adaptive width's backend too; never
the drafter's), bad values / uncovered backends refuse at start-up, ``_verify`` then writes only the
bitmask (no FULL_MASK) and its verify gives the default path's output and KV cache; switch off: the
FULL mask as before.  Also: the hook is registered by the plugin only with the switch on."""
import json
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

from conftest import DEVICE  # noqa: E402
from helpers import env_without_checkout  # noqa: E402
from sglang_ddtree.policy import adaptive_config as AC  # noqa: E402
from sglang_ddtree.policy import RoundPolicy  # noqa: E402
from sglang_ddtree import switches  # noqa: E402
from sglang_ddtree import verify_attn_hook as VA  # noqa: E402
from sglang_ddtree import verify_backend as VB  # noqa: E402
from sglang_ddtree import worker as W  # noqa: E402
from sglang_ddtree.profiling import RoundProfiler  # noqa: E402
from test_verify_attn_hook import LAYERS, TOL, World, hooked, make_backend  # noqa: E402,F401


def with_head(world):
    world.model.lm_head = torch.nn.Linear(4, 8, bias=False)
    return world.model


class FakeVerifyInput:
    """DFlashVerifyInput's role: a real ForwardBatch for TARGET_VERIFY, eager attention metadata."""
    made = []

    def __init__(self, draft_token, positions, draft_token_num, custom_mask, capture_hidden_mode):
        self.draft_token, self.positions, self.custom_mask = draft_token, positions, custom_mask
        FakeVerifyInput.made.append(self)

    def prepare_for_verify(self, batch, target_worker):
        fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(batch.seq_lens),
                          input_ids=self.draft_token, req_pool_indices=batch.req_pool_indices,
                          seq_lens=batch.seq_lens, out_cache_loc=batch.out_cache_loc,
                          seq_lens_sum=batch.seq_lens_sum, seq_lens_cpu=batch.seq_lens_cpu,
                          positions=self.positions, spec_info=self)
        target_worker.model_runner.attn_backend.init_forward_metadata(fb)
        return fb, False


def make_worker(world, backend):
    def forward(batch, forward_batch, **kw):      # every target layer's attention, in order
        return [backend.forward_extend(world.q, world.k, world.v, layer, forward_batch)
                for layer in world.layers]

    mr = types.SimpleNamespace(attn_backend=backend, decode_cuda_graph_runner=None, model=with_head(world),
                               req_to_token_pool=types.SimpleNamespace(req_to_token=world.r2t))
    w = object.__new__(W.DDTreeWorker)
    w.__dict__.update(algo_name="DDTREE-GPU", tree_backend="reference", device=DEVICE, model_runner=mr,
                      _target_worker=types.SimpleNamespace(model_runner=mr, forward_batch_generation=forward),
                      _prof=RoundProfiler(dict(algo="DDTREE-GPU")), _own_mask_buf=None,
                      _eager_mask_rounds=0, ps=types.SimpleNamespace(tp_rank=0))
    return w


def _assign_locs(*, req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                 draft_token_num, device):
    off = torch.arange(draft_token_num, device=req_to_token.device)
    return req_to_token[req_pool_indices.view(-1, 1), start_offset.view(-1, 1) + off].reshape(-1).long()


@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_verify_writes_only_the_bitmask_and_matches_the_default(hooked, rng, monkeypatch, arch):
    monkeypatch.setattr(W, "DFlashVerifyInput", FakeVerifyInput)
    monkeypatch.setattr(W, "assign_extend_cache_locs_func", _assign_locs)
    world = World(rng, arch=arch, bs=3, N=6, G=2, H=2)
    bs, N = world.bs, world.N
    batch = types.SimpleNamespace(seq_lens=world.seq, req_pool_indices=world.rpi, out_cache_loc=None,
                                  seq_lens_cpu=world.seq.to(torch.int32), seq_lens_sum=int(world.seq.sum()))
    runs = {}
    for on in (False, True):
        world.restore_cache()
        FakeVerifyInput.made.clear()
        be = world.backend()
        if on:
            monkeypatch.setenv(VA.ENV, "ddtree")
            state = VB.enable_tree_verify_attention(be, types.SimpleNamespace(model=world.model), "DDTREE-GPU")
        else:
            monkeypatch.setenv(VA.ENV, "sglang")
            assert VB.enable_tree_verify_attention(be, None, "DDTREE-GPU") is None
        w = make_worker(world, be)
        outs = w._verify(batch, world.tree, world.seq, world.seq.to(torch.int32), int(world.seq.sum()), bs, N)
        (vi,) = FakeVerifyInput.made
        runs[on] = (outs, world.cache_snapshot(), vi.custom_mask)
    (off_out, off_cache, off_mask), (on_out, on_cache, on_mask) = runs[False], runs[True]
    assert off_mask is not None and off_mask.numel() == N * N * bs + N * int(world.seq.sum())
    assert on_mask is None                                          # no FULL_MASK with the switch on
    assert state.calls == LAYERS and torch.equal(state.mask_words[:bs], world.tree.mask_words)
    for a, b in zip(on_cache, off_cache):
        assert torch.equal(a, b)
    for a, b in zip(on_out, off_out):
        assert (a - b).abs().max() <= TOL * (1 + b.abs().max())


def test_startup_enables_the_targets_verify_backend_only(hooked, rng, monkeypatch):
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    monkeypatch.setattr(DFlashWorkerV2, "init_attention_backends", lambda self: None)
    world = World(rng, arch="gqa", bs=1, N=4, G=2)
    target_be, drafter_be = world.backend(), world.backend()
    hybrid = object.__new__(HybridAttnBackend)
    hybrid.prefill_backend, hybrid.decode_backend = object.__new__(TorchNativeAttnBackend), target_be
    hybrid.spec_attn_is_decode = True
    w = make_worker(world, hybrid)
    w.draft_model_runner = types.SimpleNamespace(attn_backend=drafter_be)
    monkeypatch.setenv(VA.ENV, "sglang")
    w.init_attention_backends()
    assert VA.state_of(target_be) is None                            # =sglang: nothing attached
    for value in ("ddtree", None):                                   # None: unset, the default (auto)
        if value is None:
            monkeypatch.delenv(VA.ENV, raising=False)
            target_be.__dict__.pop(VA.STATE_ATTR, None)
        else:
            monkeypatch.setenv(VA.ENV, value)
        w.init_attention_backends()
        st = VA.state_of(target_be)
        assert st is not None and st.num_verify == 4 and not st.use_mla
        assert VA.state_of(drafter_be) is None and VA.state_of(hybrid) is None
    monkeypatch.setenv(VA.ENV, "on")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_VERIFY_ATTN must be one of"):
        w.init_attention_backends()
    monkeypatch.setenv(VA.ENV, "ddtree")
    w.draft_model_runner = types.SimpleNamespace(attn_backend=hybrid)        # one backend for both
    with pytest.raises(ValueError, match="drafter's attention backend is the target's"):
        w.init_attention_backends()
    w.draft_model_runner = types.SimpleNamespace(attn_backend=drafter_be)
    target_be.page_size = 64
    with pytest.raises(ValueError, match="page size 64"):
        w.init_attention_backends()
    # auto (the default): what the hook does not cover falls back to SGLang's masked kernel, no error
    monkeypatch.delenv(VA.ENV, raising=False)
    for be in (target_be, drafter_be):
        be.__dict__.pop(VA.STATE_ATTR, None)
    w.init_attention_backends()                                      # page size 64: not covered
    assert VA.state_of(target_be) is None
    target_be.page_size = 1
    w.draft_model_runner = types.SimpleNamespace(attn_backend=hybrid)  # the drafter on the target's backend
    w.init_attention_backends()
    assert VA.state_of(target_be) is None
    # the switch draft_attn=ddtree: the drafter's backend gets an all-visible state of the block
    # size (its layers must be ENCODER_ONLY: these are causal, so a start-up error names them)
    from sglang.srt.layers.radix_attention import AttentionType

    monkeypatch.setattr(switches, "CURRENT", switches.Switches(draft_attn="ddtree"))
    w.block_size = 4
    w.draft_model_runner = types.SimpleNamespace(attn_backend=drafter_be, model=world.model)
    with pytest.raises(ValueError, match="drafter's block.*attention type"):
        w.init_attention_backends()
    for layer in world.layers:
        layer.attn_type = AttentionType.ENCODER_ONLY
    target_be.__dict__.pop(VA.STATE_ATTR, None)
    drafter_be.__dict__.pop(VA.STATE_ATTR, None)
    monkeypatch.setenv(VA.ENV, "sglang")                             # the target's verify left to SGLang
    w.init_attention_backends()
    st = VA.state_of(drafter_be)
    assert st is not None and st.all_visible and st.num_verify == 4 and VA.state_of(target_be) is None


def test_each_adaptive_width_backend_gets_its_own_state(hooked, rng, monkeypatch):
    monkeypatch.setenv(VA.ENV, "ddtree")
    world = World(rng, arch="gqa", bs=1, N=8, G=1)
    made = []

    class Args:
        speculative_num_draft_tokens = 8

        def override(self, who, **kw):
            self.__dict__.update(kw)

    def get_backend(init_new_workspace):
        be = make_backend(world.pool, world.r2t, mr.server_args.speculative_num_draft_tokens,
                          use_mla=False, Hq=world.Hq, Dv=world.Dv)
        made.append(be)
        return be

    home = world.backend()
    mr = types.SimpleNamespace(attn_backend=home, decode_cuda_graph_runner=None, server_args=Args(),
                               model=with_head(world), _get_attention_backend=get_backend)
    w = make_worker(world, home)
    w._target_worker.model_runner = mr
    cfg = AC.parse_config({AC.ENV_BUDGETS: "3,7"}, budget=7, algo="DDTREE-GPU",
                         sw=switches.Switches(budget_cycle=(7, 3)))
    w._policy = RoundPolicy(8)           # what __init__ makes before SGLang builds the graphs
    w._init_adaptive(cfg)
    assert [VA.state_of(be).num_verify for be in made] == [4]
    assert VA.state_of(made[0]).mask_words.shape[1:] == (4, 1)


def _fresh(code, env):
    r = subprocess.run([sys.executable, "-c", code], cwd="/", env=env_without_checkout(**env),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("RESULT", 1)[1])


PROBE = r'''
import json
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang_ddtree.patches import triton_verify_attention as P
from sglang_ddtree.verify_attn_hook import hook_installed
print("RESULT" + json.dumps({"patched": P.TARGET in HookRegistry._patched, "installed": hook_installed(),
                             "wrapped": hasattr(TritonAttnBackend.forward_extend, "__wrapped__")}))
'''


def test_plugin_registers_the_hook_in_every_process():
    """Installed whatever SGLANG_DDTREE_VERIFY_ATTN says (the A/B's draft_attn switch may be set by a
    plugin that loads after ours); with ``sglang`` no backend carries a state, so every call goes to
    SGLang's forward_extend (the worker-side tests above)."""
    for value in ("", "auto", "ddtree", "sglang"):            # "": unset, the default (auto)
        assert _fresh(PROBE, {VA.ENV: value}) == dict(patched=True, installed=True, wrapped=True), value
