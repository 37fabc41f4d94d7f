"""The TARGET_VERIFY hook on SGLang's ``TritonAttnBackend.forward_extend``
(``patches/triton_verify_attention.py``, ``sglang_ddtree/verify_attn_hook.py``): on the CPU under the
Triton interpreter, on CUDA on the GPU host (there also a real CUDA-graph capture + replay).

A real ``TritonAttnBackend`` object (built without its CUDA-only ``__init__``, the attributes
``forward_extend`` / ``init_forward_metadata`` / the CUDA-graph metadata path read set by hand),
SGLang's real ``MHATokenToKVPool`` / ``MLATokenToKVPool``, ``RadixAttention`` layers, ``ForwardBatch``
and ``KVWriteLoc``; the hook applied through SGLang's ``HookRegistry``.  Fresh random inputs: trees from
``ddtree.build_tree``, bs 1-3, prefix 0-40, shuffled KV slots.  Checked: the hooked call (no FULL
mask, the state's bitmask) gives SGLang's own masked ``extend_attention_fwd`` output and the torch
reference's (fp32 inputs, 1e-4), writes the same KV cache; GQA groups 1 / 4 and MLA 512 + 64; eager
metadata and the CUDA-graph metadata path (static buffers, the decode workspace reused, a padded
graph batch); a backend
without the state (the drafter's) and non-verify modes go to SGLang unchanged; start-up refusals.
"""
import collections
import contextlib
import dataclasses
import inspect
import math
import types

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.triton_backend")

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

from conftest import DEVICE  # noqa: E402
from helpers import drafter_logits, logprobs_from_logits  # noqa: E402
from sglang_ddtree import ddtree  # noqa: E402
from sglang_ddtree import switches  # noqa: E402
from sglang_ddtree import verify_attn_hook as VA  # noqa: E402
from sglang_ddtree.kernels.tree_verify_attention import (  # noqa: E402
    tree_verify_attention_mla_torch, tree_verify_attention_torch)
from sglang_ddtree.patches import triton_verify_attention as P  # noqa: E402

TOL = 1e-4
LAYERS = 2
MAX_BS = 4


def randint(lo, hi, rng):
    return int(torch.randint(lo, hi + 1, (1,), generator=rng))


@contextlib.contextmanager
def _sglangs_own_forward_extend():
    """TritonAttnBackend.forward_extend as SGLang ships it and an empty HookRegistry for the block;
    the class and the registry as they were after.  An earlier test file's in-process load_plugins()
    leaves our hook applied (it is installed by default), and SGLang's wrappers keep the wrapped
    function as ``__wrapped__``: unwrapped here, so 'SGLang's path' is never ours."""
    before = TritonAttnBackend.__dict__["forward_extend"]
    saved = (HookRegistry._hooks, HookRegistry._patched)
    TritonAttnBackend.forward_extend = inspect.unwrap(before)
    HookRegistry._hooks, HookRegistry._patched = collections.defaultdict(list), set()
    try:
        yield inspect.unwrap(before)
    finally:
        TritonAttnBackend.forward_extend = before
        HookRegistry._hooks, HookRegistry._patched = saved


@pytest.fixture
def hooked():
    """Our AROUND hook applied to SGLang's own TritonAttnBackend.forward_extend through
    HookRegistry; yields SGLang's unhooked function; restores the class and the registry after."""
    with _sglangs_own_forward_extend() as orig:
        assert not VA.hook_installed()
        HookRegistry.register(P.TARGET, P.tree_verify_forward_extend, HookType.AROUND)
        HookRegistry.apply_hooks()
        assert TritonAttnBackend.forward_extend is not orig and VA.hook_installed()
        assert inspect.unwrap(TritonAttnBackend.forward_extend) is orig
        yield orig


@pytest.fixture
def unhooked():
    with _sglangs_own_forward_extend() as orig:
        yield orig


class Model(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


def make_backend(pool, r2t, N, *, use_mla, Hq, Dv, graphs=False):
    """A TritonAttnBackend as SGLang 0.5.16's __init__ leaves it for a page-size-1 target (on r2t's
    device: CPU here, CUDA on the GPU host)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    dev = r2t.device
    be = object.__new__(TritonAttnBackend)
    be.__dict__.update(
        token_to_kv_pool=pool, req_to_token_pool=types.SimpleNamespace(size=MAX_BS, req_to_token=r2t),
        req_to_token=r2t, num_draft_tokens=N, device=dev, max_context_len=1024,
        kv_indptr=torch.zeros(MAX_BS + 1, dtype=torch.int32, device=dev),
        qo_indptr=torch.zeros(MAX_BS + 1, dtype=torch.int64, device=dev),
        mask_indptr=torch.zeros(MAX_BS + 1, dtype=torch.int64, device=dev), sliding_window_size=None,
        window_kv_indptr=None, use_sliding_window_kv_pool=False, _translate_kv_loc=None, dcp_size=1,
        dcp_rank=0, enable_deterministic=False, use_verify_splitkv=False,
        allow_bidirectional_attention_in_extend=False, page_size=1, use_mla=use_mla, skip_prefill=False,
        is_draft_runner=False, max_kv_splits=4, num_head=Hq, v_head_dim=Dv, swa_v_head_dim=None,
        extend_attention_fwd=extend_attention_fwd, forward_metadata=None, cuda_graph_custom_mask=None,
        speculative_num_steps=1, topk=1)
    if graphs:
        be.init_cuda_graph_state(MAX_BS, MAX_BS * N)
    return be


def make_tree(bs, N, rng, device=DEVICE):
    D = randint(1, 5, rng)
    V = 4 * N
    lp, ids = logprobs_from_logits(drafter_logits(bs, D, V, rng), min(N - 1, V))
    tree = ddtree.build_tree(lp, ids, N - 1, backend="reference")
    return dataclasses.replace(tree, **{f.name: getattr(tree, f.name).to(device)
                                        for f in dataclasses.fields(tree)
                                        if isinstance(getattr(tree, f.name), torch.Tensor)})


class World:
    """One random verify: pool + slots + prefix KV in the cache, the tree, the layer inputs."""

    def __init__(self, rng, *, arch, bs, N, G=1, Hkv=2, D=16, Dv=16, H=2, L=512, R=64, prefixes=None,
                 device=DEVICE, attn_type=None):
        self.bs, self.N, self.arch = bs, N, arch
        dev = self.device = torch.device(device)
        self.prefixes = prefixes or [randint(0, 40, rng) for _ in range(bs)]
        if prefixes is None and bs > 1 and randint(0, 1, rng):
            self.prefixes[randint(0, bs - 1, rng)] = 0                 # an empty prefix beside others
        lens = [p + N for p in self.prefixes]
        S = sum(lens) + 13
        width = max(lens) + 7
        perm = torch.randperm(S, generator=rng) + 1                    # slot 0 = SGLang's padding slot
        r2t = torch.zeros(MAX_BS + 1, width, dtype=torch.int32)
        self.rpi = torch.randperm(MAX_BS + 1, generator=rng)[:bs].to(torch.int64)
        off = 0
        for b in range(bs):
            r2t[self.rpi[b], :lens[b]] = perm[off:off + lens[b]].to(torch.int32)
            off += lens[b]
        self.loc = torch.cat([r2t[self.rpi[b], self.prefixes[b]:lens[b]] for b in range(bs)]).to(torch.int64).to(dev)
        self.r2t, self.rpi = r2t.to(dev), self.rpi.to(dev)
        self.seq = torch.tensor(self.prefixes, dtype=torch.int64, device=dev)
        self.tree = make_tree(bs, N, rng, dev)
        T = bs * N
        kind = {} if attn_type is None else dict(attn_type=attn_type)   # ENCODER_ONLY: the drafter's layers
        if arch == "gqa":
            Hq = G * Hkv
            self.pool = MHATokenToKVPool(S + 1, 1, torch.float32, Hkv, D, LAYERS, str(dev), False, v_head_dim=Dv)
            self.layers = [RadixAttention(Hq, D, 1.0 / math.sqrt(D), num_kv_heads=Hkv, layer_id=i,
                                          v_head_dim=Dv, **kind) for i in range(LAYERS)]
            for i in range(LAYERS):
                self.pool.k_buffer[i].copy_(torch.randn(self.pool.k_buffer[i].shape, generator=rng))
                self.pool.v_buffer[i].copy_(torch.randn(self.pool.v_buffer[i].shape, generator=rng))
            self.q = torch.randn(T, Hq * D, generator=rng).to(dev)
            self.k = torch.randn(T, Hkv, D, generator=rng).to(dev)
            self.v = torch.randn(T, Hkv, Dv, generator=rng).to(dev)
            self.Hq, self.Dv = Hq, Dv
        else:
            self.pool = MLATokenToKVPool(S + 1, 1, torch.float32, L, R, LAYERS, str(dev), False)
            self.layers = [RadixAttention(H, L + R, 1.0 / math.sqrt(128 + R), num_kv_heads=1, layer_id=i,
                                          v_head_dim=L, **kind) for i in range(LAYERS)]
            for i in range(LAYERS):
                self.pool.kv_buffer[i].copy_(torch.randn(self.pool.kv_buffer[i].shape, generator=rng))
            self.q = torch.randn(T, H, L + R, generator=rng).to(dev)   # cat(q_nope W_kc, q_pe)
            self.k = torch.randn(T, 1, L + R, generator=rng).to(dev)   # cat(k_nope latent, k_pe)
            self.v = self.k[..., :L]                                    # the latent (v = k_nope)
            self.Hq, self.Dv, self.L = H, L, L
        self.model = Model(self.layers)
        self.cache0 = self.cache_snapshot()

    def kv_buffers(self, layer_id=None):
        """The pool's cache tensors (every layer's, or ``layer_id``'s): MLA one latent buffer a
        layer, GQA the K buffers then the V buffers."""
        groups = [self.pool.kv_buffer] if self.arch == "mla" else [self.pool.k_buffer, self.pool.v_buffer]
        return [b for g in groups for i, b in enumerate(g) if layer_id is None or i == layer_id]

    def cache_snapshot(self):
        return [b.clone() for b in self.kv_buffers()]

    def restore_cache(self):
        for b, s in zip(self.kv_buffers(), self.cache0):
            b.copy_(s)

    def forward_batch(self, *, full_mask, mode=ForwardMode.TARGET_VERIFY):
        mask = ddtree.verify_mask(self.tree, self.seq, mode="full", backend="reference") if full_mask else None
        return ForwardBatch(
            forward_mode=mode, batch_size=self.bs,
            input_ids=torch.zeros(self.bs * self.N, dtype=torch.int64, device=self.device),
            req_pool_indices=self.rpi, seq_lens=self.seq, out_cache_loc=self.loc,
            seq_lens_sum=int(self.seq.sum()), seq_lens_cpu=self.seq.to(torch.int32),
            positions=self.tree.positions(self.seq).reshape(-1),
            spec_info=types.SimpleNamespace(custom_mask=mask))

    def backend(self, **kw):
        return make_backend(self.pool, self.r2t, self.N, use_mla=self.arch == "mla", Hq=self.Hq,
                            Dv=self.Dv, **kw)

    def reference(self, layer):
        """Masked attention over prefix + tree (the tree's K/V in the cache) from the torch reference."""
        plen = self.seq.to(torch.int32)
        T = self.bs * self.N
        if self.arch == "gqa":
            return tree_verify_attention_torch(
                self.q.view(T, self.Hq, -1), self.pool.get_key_buffer(layer.layer_id),
                self.pool.get_value_buffer(layer.layer_id), self.r2t, self.rpi, plen,
                self.tree.mask_words, layer.scaling).reshape(T, -1)
        q = self.q
        return tree_verify_attention_mla_torch(
            q[..., :self.L], q[..., self.L:], self.pool.get_key_buffer(layer.layer_id), self.r2t, self.rpi,
            plen, self.tree.mask_words, layer.scaling, kv_lora_rank=self.L).reshape(T, -1)


def sglang_path(world, original, layer):
    """SGLang 0.5.16's own TARGET_VERIFY (eager metadata, FULL mask, extend_attention_fwd)."""
    be = world.backend()
    fb = world.forward_batch(full_mask=True)
    be.init_forward_metadata(fb)
    out = original(be, world.q, world.k, world.v, layer, fb)
    return out, world.cache_snapshot()


def run_hooked(world, layer, *, graphs, monkeypatch=None):
    """The hooked verify; with ``monkeypatch``: through ``RadixAttention.forward`` (SGLang's call
    chain: layer -> backend.forward -> forward_extend(..., save_kv_cache=True))."""
    be = world.backend(graphs=graphs)
    state = VA.enable(be, world.model, "DDTREE-GPU")
    state.write_mask(world.tree.mask_words)
    fb = world.forward_batch(full_mask=False)
    if graphs:
        be.init_forward_metadata_out_graph(fb, in_capture=True)     # the capture-time metadata
    else:
        be.init_forward_metadata(fb)
    assert be.forward_metadata.custom_mask is None or graphs
    if monkeypatch is not None:
        import sglang.srt.layers.radix_attention as RA

        monkeypatch.setattr(RA, "get_attn_backend", lambda: be)
        v = world.v if world.arch == "gqa" else world.k[..., :world.L]
        out = layer(world.q, world.k, v, fb)
    else:
        out = be.forward_extend(world.q, world.k, world.v, layer, fb)
    return out, state, be


CASES = [("gqa", 1), ("gqa", 4), ("mla", None)]


@pytest.mark.parametrize("arch,G", CASES)
@pytest.mark.parametrize("graphs", [False, True])
def test_hooked_verify_equals_sglangs_masked_path(hooked, rng, monkeypatch, arch, G, graphs):
    bs, N = randint(1, 3, rng), randint(2, 9, rng)
    kw = dict(G=G) if arch == "gqa" else dict(H=randint(1, 2, rng))
    if arch == "gqa" and G == 4:
        kw.update(Hkv=1, D=32, Dv=16)                                  # D != Dv too
    world = World(rng, arch=arch, bs=bs, N=N, **kw)
    layer = world.layers[randint(0, LAYERS - 1, rng)]
    want, want_cache = sglang_path(world, hooked, layer)
    ref = world.reference(layer)                                        # cache now holds the tree's K/V
    world.restore_cache()
    got, state, be = run_hooked(world, layer, graphs=graphs, monkeypatch=monkeypatch)
    assert state.calls == 1
    assert got.shape == want.shape == (bs * N, world.Hq * world.Dv)
    for a, b in zip(world.cache_snapshot(), want_cache):                # the same KV written
        assert torch.equal(a, b)
    assert (got - want).abs().max() <= TOL * (1 + want.abs().max()), (world.prefixes, N)
    assert (got - ref).abs().max() <= TOL * (1 + ref.abs().max())


def test_graph_path_reads_static_buffers_only(hooked, rng, monkeypatch):
    """Under the CUDA-graph metadata path the kernel gets the state's bitmask rows, the batch's
    (static) seq_lens / req_pool_indices and a workspace inside cuda_graph_attn_logits / _lse."""
    from sglang_ddtree.kernels import tree_verify_attention as K

    world = World(rng, arch="gqa", bs=2, N=5, G=2)
    seen = {}
    real = K.tree_verify_attention

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr(K, "tree_verify_attention", spy)
    got, state, be = run_hooked(world, world.layers[0], graphs=True)
    fb_seq, ws = seen["prefix_lens"], seen["workspace"]
    assert seen["mask_words"].data_ptr() == state.mask_words.data_ptr()
    assert fb_seq.data_ptr() == world.seq.data_ptr() and seen["req_pool_indices"].data_ptr() == world.rpi.data_ptr()
    assert ws[0].data_ptr() == be.cuda_graph_attn_logits.data_ptr()
    assert ws[1].data_ptr() == be.cuda_graph_attn_lse.data_ptr()
    assert seen["num_splits"] == state.num_splits == be.max_kv_splits - 1
    # the next round: new mask words into the same buffer, same output as the reference
    tree2 = make_tree(2, 5, rng, world.device)
    world.tree = tree2
    state.write_mask(tree2.mask_words)
    world.restore_cache()
    fb = world.forward_batch(full_mask=False)
    be.init_forward_metadata_out_graph(fb, in_capture=False)           # replay-time buffer refill
    got2 = be.forward_extend(world.q, world.k, world.v, world.layers[0], fb)
    ref2 = world.reference(world.layers[0])
    assert (got2 - ref2).abs().max() <= TOL * (1 + ref2.abs().max())


def test_drafter_backend_and_other_modes_are_untouched(hooked, rng, monkeypatch):
    """A backend without the state (the drafter's: it runs TARGET_VERIFY too) and non-verify modes
    on the target's backend reach SGLang's forward_extend with the very same arguments."""
    world = World(rng, arch="gqa", bs=2, N=4, G=2)
    layer = world.layers[1]
    calls = []

    def fake_original(self, *a, **kw):
        calls.append((self, a, kw))
        return "sglang"

    # the registry wrapper captured the real original: swap the hook's view of it via a fresh wrap
    drafter = world.backend()
    fb = world.forward_batch(full_mask=True)
    tried = []
    monkeypatch.setattr(VA, "forward_tree_verify", lambda *a, **kw: tried.append(1))
    assert P.tree_verify_forward_extend(fake_original, drafter, world.q, world.k, world.v, layer, fb,
                                        save_kv_cache=True) == "sglang"
    target = world.backend()
    VA.enable(target, world.model, "DDTREE-GPU")
    for mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND_V2, ForwardMode.DECODE):
        fbm = world.forward_batch(full_mask=False, mode=mode)
        assert P.tree_verify_forward_extend(fake_original, target, world.q, world.k, world.v, layer,
                                            forward_batch=fbm) == "sglang"
    assert not tried and len(calls) == 4
    assert calls[0][1][4] is fb and calls[0][2] == dict(save_kv_cache=True)
    assert all(c[2]["forward_batch"].forward_mode != ForwardMode.TARGET_VERIFY for c in calls[1:])
    # and the real hooked method on the drafter's backend gives SGLang's own output
    monkeypatch.undo()
    want, _ = sglang_path(world, hooked, layer)
    world.restore_cache()
    drafter.init_forward_metadata(fb)
    got = drafter.forward_extend(world.q, world.k, world.v, layer, fb)
    assert torch.equal(got, want)


def test_mode_switch_values(monkeypatch):
    assert VA.mode({}) == "auto" and VA.enabled({}) and not VA.required({})      # the default
    assert VA.mode({VA.ENV: ""}) == "auto" and VA.mode({VA.ENV: " AUTO "}) == "auto"
    assert VA.mode({VA.ENV: "sglang"}) == "sglang" and not VA.enabled({VA.ENV: "sglang"})
    assert VA.enabled({VA.ENV: " DDTree "}) and VA.required({VA.ENV: "ddtree"})
    with pytest.raises(ValueError, match="SGLANG_DDTREE_VERIFY_ATTN must be one of"):
        VA.mode({VA.ENV: "flashinfer"}, "DDTREE-GPU")
    be = types.SimpleNamespace(max_kv_splits=8, max_context_len=100_000)
    monkeypatch.setattr(switches, "CURRENT", switches.Switches())
    assert VA.default_splits(be) == 7 and VA.splits_override() is None
    assert VA.default_splits(types.SimpleNamespace(max_kv_splits=64, max_context_len=300)) == 2
    monkeypatch.setattr(switches, "CURRENT", switches.Switches(verify_attn_splits=20))   # the A/B switch
    assert VA.default_splits(be) == 20


def test_refusals_at_startup(hooked, rng):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    world = World(rng, arch="gqa", bs=1, N=3, G=2)
    with pytest.raises(ValueError, match="TorchNativeAttnBackend; only SGLang's TritonAttnBackend"):
        VA.enable(object.__new__(TorchNativeAttnBackend), world.model, "DDTREE-GPU")
    for attr, value, msg in (("dcp_size", 2, "context parallelism"), ("page_size", 16, "page size 16"),
                             ("enable_deterministic", True, "deterministic"),
                             ("sliding_window_size", 128, "sliding-window"),
                             ("_translate_kv_loc", lambda x: x, "unified")):
        be = world.backend()
        setattr(be, attr, value)
        with pytest.raises(ValueError, match=msg):
            VA.enable(be, world.model, "DDTREE-GPU")
        assert VA.state_of(be) is None
    be = world.backend()
    be.token_to_kv_pool = types.SimpleNamespace(dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="KV cache dtype"):
        VA.enable(be, world.model, "DDTREE-GPU")
    for attr, value, msg in (("logit_cap", 30.0, "logit cap"), ("sliding_window_size", 64, "sliding window"),
                             ("k_scale", torch.ones(1), "KV scales"), ("is_cross_attention", True, "cross")):
        layer = world.layers[1]
        old = getattr(layer, attr)
        setattr(layer, attr, value)
        try:
            with pytest.raises(ValueError, match=f"layers.1: .*{msg}"):
                VA.enable(world.backend(), world.model, "DDTREE-GPU")
        finally:
            setattr(layer, attr, old)
    state = VA.enable(world.backend(), world.model, "DDTREE-GPU")
    assert state.mask_words.shape == (MAX_BS, 3, 1) and state.mask_words.dtype == torch.int32


def test_refused_without_the_hook_installed(unhooked, rng):
    world = World(rng, arch="gqa", bs=1, N=3)
    with pytest.raises(ValueError, match="hook is not installed"):
        VA.enable(world.backend(), world.model, "DDTREE-GPU")


def test_per_call_refusals(hooked, rng):
    world = World(rng, arch="gqa", bs=2, N=3)
    be = world.backend()
    state = VA.enable(be, world.model, "DDTREE-GPU")
    fb = world.forward_batch(full_mask=False)
    be.init_forward_metadata(fb)
    with pytest.raises(RuntimeError, match="sinks"):
        be.forward_extend(world.q, world.k, world.v, world.layers[0], fb, sinks=torch.zeros(4))
    with pytest.raises(RuntimeError, match="not bs x 3"):
        be.forward_extend(world.q[:5], world.k[:5], world.v[:5], world.layers[0], fb)
    with pytest.raises(ValueError, match="do not fit"):
        state.write_mask(torch.zeros(2, 4, 1, dtype=torch.int32))
    assert state.calls == 0


@pytest.mark.parametrize("arch,G", CASES)
@pytest.mark.parametrize("graphs", [False, True])
def test_drafter_block_equals_sglangs_unmasked_path(hooked, rng, arch, G, graphs):
    """The switch draft_attn: the drafter's block forward (TARGET_VERIFY on its own backend, every
    layer ENCODER_ONLY, no custom mask: each block query sees the whole context and the whole block,
    SGLang's extend kernel with causal off) through our kernel with the all-set bitmask gives
    SGLang's output, the torch reference's over an all-ones mask, and the same KV cache."""
    from sglang.srt.layers.radix_attention import AttentionType

    bs, N = randint(1, 3, rng), randint(2, 17, rng)                   # N: the drafter's block size
    kw = dict(G=G) if arch == "gqa" else dict(H=randint(1, 2, rng))
    world = World(rng, arch=arch, bs=bs, N=N, attn_type=AttentionType.ENCODER_ONLY, **kw)
    world.tree = dataclasses.replace(world.tree, mask_words=VA.all_set_words(bs, N, world.device))
    layer = world.layers[randint(0, LAYERS - 1, rng)]
    be = world.backend()
    fb = world.forward_batch(full_mask=False)                          # DFLASH's block: no custom mask
    be.init_forward_metadata(fb)
    assert be.forward_metadata.custom_mask is None
    want = hooked(be, world.q, world.k, world.v, layer, fb)
    want_cache = world.cache_snapshot()
    ref = world.reference(layer)
    world.restore_cache()
    drafter = world.backend(graphs=graphs)
    state = VA.enable(drafter, world.model, "DDTREE-GPU", num_verify=N, all_visible=True)
    assert state.all_visible and state.mask_words.shape == (MAX_BS, N, (N + 31) // 32)
    fb = world.forward_batch(full_mask=False)
    if graphs:
        drafter.init_forward_metadata_out_graph(fb, in_capture=True)
    else:
        drafter.init_forward_metadata(fb)
    got = drafter.forward_extend(world.q, world.k, world.v, layer, fb)
    assert state.calls == 1 and got.shape == want.shape
    for a, b in zip(world.cache_snapshot(), want_cache):
        assert torch.equal(a, b)
    assert (got - want).abs().max() <= TOL * (1 + want.abs().max()), (world.prefixes, N)
    assert (got - ref).abs().max() <= TOL * (1 + ref.abs().max())
    with pytest.raises(ValueError, match="fixed"):
        state.write_mask(world.tree.mask_words)


def test_drafter_block_refusals_and_switch(hooked, rng):
    """The layer kinds each state accepts and the switch's values (off by default)."""
    from sglang.srt.layers.radix_attention import AttentionType

    causal = World(rng, arch="gqa", bs=1, N=4)
    with pytest.raises(ValueError, match="switch draft_attn=ddtree cannot serve the drafter's block.*"
                                         "attention type"):
        VA.enable(causal.backend(), causal.model, "DDTREE-GPU", all_visible=True)
    enc = World(rng, arch="gqa", bs=1, N=4, attn_type=AttentionType.ENCODER_ONLY)
    with pytest.raises(ValueError, match="SGLANG_DDTREE_VERIFY_ATTN=ddtree cannot serve this target's verify"):
        VA.enable(enc.backend(), enc.model, "DDTREE-GPU")
    assert switches.Switches().draft_attn == "sglang"
    with pytest.raises(ValueError, match="draft_attn must be"):
        switches.Switches(draft_attn="on")


def test_worker_enables_the_drafter_block(hooked, rng, monkeypatch, caplog):
    """``verify_backend.enable_draft_block_attention``: off by default; ``auto`` logs why it falls back
    (another req_to_token, the target's backend); ``ddtree`` raises; covered: the state, logged with
    the line the A/B records."""
    import logging

    from sglang.srt.layers.radix_attention import AttentionType

    from sglang_ddtree import verify_backend as W
    from sglang_ddtree.ab.runner import DRAFT_ATTN_LINE

    world = World(rng, arch="gqa", bs=1, N=5, attn_type=AttentionType.ENCODER_ONLY)
    monkeypatch.setattr(switches, "CURRENT", switches.Switches())
    assert W.enable_draft_block_attention(world.backend(), world.model, 5, world.r2t, "DDTREE-GPU") is None
    monkeypatch.setattr(switches, "CURRENT", switches.Switches(draft_attn="auto"))
    caplog.set_level(logging.INFO, logger=W.logger.name)
    other = world.r2t.clone()
    assert W.enable_draft_block_attention(world.backend(), world.model, 5, other, "DDTREE-GPU") is None
    assert "another req_to_token" in caplog.text
    be = world.backend()
    assert W.enable_draft_block_attention(be, world.model, 5, world.r2t, "DDTREE-GPU", target_backend=be) is None
    assert "the target's" in caplog.text and VA.state_of(be) is None
    monkeypatch.setattr(switches, "CURRENT", switches.Switches(draft_attn="ddtree"))
    with pytest.raises(ValueError, match="another req_to_token"):
        W.enable_draft_block_attention(world.backend(), world.model, 5, other, "DDTREE-GPU")
    caplog.clear()
    be = world.backend()
    state = W.enable_draft_block_attention(be, world.model, 5, world.r2t, "DDTREE-GPU")
    assert VA.state_of(be) is state and state.all_visible and state.num_verify == 5
    assert DRAFT_ATTN_LINE + "sglang_ddtree tree_verify_attention (block 5, all visible" in caplog.text


@pytest.mark.parametrize("arch", ["gqa", "mla"])
@pytest.mark.parametrize("caller_wrote", [True, False])
def test_save_kv_cache_false_still_verifies_from_the_tree_kv(hooked, rng, arch, caller_wrote):
    """``save_kv_cache=False`` (Qwen3-MoE's fused RoPE + KV store in SGLang 0.5.16 passes it): the
    output is SGLang's masked path's and the cache holds the tree's K/V afterwards, whether the caller
    stored them (as the fused kernel does) or left the slots stale (poisoned here)."""
    bs, N = randint(1, 3, rng), randint(2, 9, rng)
    world = World(rng, arch=arch, bs=bs, N=N, **(dict(G=2) if arch == "gqa" else dict(H=2)))
    layer = world.layers[randint(0, LAYERS - 1, rng)]
    want, want_cache = sglang_path(world, hooked, layer)
    if caller_wrote:
        for b, w in zip(world.kv_buffers(), want_cache):
            b.copy_(w)
    else:
        world.restore_cache()
        for b in world.kv_buffers(layer.layer_id):
            b[world.loc] = float("nan")                                  # the tree's slots: stale
    be = world.backend()
    state = VA.enable(be, world.model, "DDTREE-GPU")
    state.write_mask(world.tree.mask_words)
    fb = world.forward_batch(full_mask=False)
    be.init_forward_metadata(fb)
    got = be.forward_extend(world.q, world.k, world.v, layer, fb, save_kv_cache=False)
    assert state.calls == 1 and torch.isfinite(got).all()
    assert (got - want).abs().max() <= TOL * (1 + want.abs().max()), (world.prefixes, N)
    for a, b in zip(world.cache_snapshot(), want_cache):
        assert torch.equal(a, b)


def test_padded_graph_batch(hooked, rng):
    """A replay pads the batch to the captured size (seq_len 1, pool row 0, KV slot 0): the padded
    rows stay finite and the real rows are the reference's."""
    world = World(rng, arch="gqa", bs=2, N=4, G=2)
    bs, N, pad = world.bs, world.N, MAX_BS - world.bs
    layer = world.layers[0]
    be = world.backend(graphs=True)
    state = VA.enable(be, world.model, "DDTREE-GPU")
    state.write_mask(world.tree.mask_words)
    dev = world.device
    seq = torch.cat([world.seq, torch.ones(pad, dtype=torch.int64, device=dev)])
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=MAX_BS,
                      input_ids=torch.zeros(MAX_BS * N, dtype=torch.int64, device=dev),
                      req_pool_indices=torch.cat([world.rpi, torch.zeros(pad, dtype=torch.int64, device=dev)]),
                      seq_lens=seq, out_cache_loc=torch.cat([world.loc, torch.zeros(pad * N, dtype=torch.int64, device=dev)]),
                      seq_lens_sum=int(seq.sum()), seq_lens_cpu=seq.to(torch.int32),
                      spec_info=types.SimpleNamespace(custom_mask=None))
    be.init_forward_metadata_out_graph(fb, in_capture=True)

    def padded(x):
        return torch.cat([x, torch.randn((pad * N,) + tuple(x.shape[1:]), generator=rng).to(dev)])

    out = be.forward(padded(world.q), padded(world.k), padded(world.v), layer, fb)
    assert out.shape == (MAX_BS * N, world.Hq * world.Dv) and torch.isfinite(out).all()
    ref = world.reference(layer)
    assert (out[:bs * N] - ref).abs().max() <= TOL * (1 + ref.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs the GPU")
@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_real_cuda_graph_capture_then_replay_with_new_bits(hooked, rng, arch):
    """GPU host only: the hooked verify (KV write + our kernel) captured in a CUDA graph with the
    capture-time metadata; the next round's mask words written into the state's buffer, then a
    replay gives the reference of the new tree (the captured kernel reads the buffer)."""
    world = World(rng, arch=arch, bs=2, N=5, G=2, H=2)
    layer = world.layers[1]
    be = world.backend(graphs=True)
    state = VA.enable(be, world.model, "DDTREE-GPU")
    fb = world.forward_batch(full_mask=False)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                      # warm-up: Triton compiles
        be.forward_extend(world.q, world.k, world.v, layer, fb)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = be.forward_extend(world.q, world.k, world.v, layer, fb)
    world.restore_cache()
    world.tree = make_tree(world.bs, world.N, rng, world.device)       # the next round's tree
    state.write_mask(world.tree.mask_words)
    g.replay()
    torch.cuda.synchronize()
    ref = world.reference(layer)
    assert (out - ref).abs().max() <= TOL * (1 + ref.abs().max())
