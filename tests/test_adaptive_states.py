"""The adaptive budget's start-up pieces with fake SGLang objects (CPU): one target verify state per
extra width, built while server_args say that width and restored after; the state swap of a round;
the cost table from a (fake) graph timer; the worker's init_cuda_graphs builds nothing unless asked
(issue 17 item 3)."""
import types

import pytest
import torch

from sglang_ddtree.policy import adaptive_config as AC
from sglang_ddtree import ddtree as DT
from sglang_ddtree import verify_states as VS
from sglang_ddtree import plain_decode as P
from sglang_ddtree import switches
from sglang_ddtree.policy import RoundPolicy
from sglang_ddtree.policy.budget_policy import NO_SPEC


class FakeArgs:
    """server_args with SGLang's ``override`` (fields set, mutation logged)."""

    def __init__(self, n):
        self.speculative_num_draft_tokens = n
        self.enable_return_hidden_states = False
        self.attention_backend, self.decode_attention_backend = "flashinfer", None
        self.log = []

    def override(self, source, **kw):
        self.log.append((source, dict(kw)))
        for k, v in kw.items():
            setattr(self, k, v)


class FakeBackend:
    def __init__(self, width):
        self.width = width                      # what server_args said when it was built
        self.cuda_graph_custom_mask = torch.zeros(100_000, dtype=torch.bool)
        self.prepared = False


class FakeRunner:
    def __init__(self, model_runner, *, attn_backend, speculative_num_steps=None,
                 speculative_num_draft_tokens=None):
        # SGLang's runner captures DECODE (width 1) on a non-speculative runner, else TARGET_VERIFY
        plain = model_runner.spec_algorithm == "NONE"
        assert plain == (speculative_num_draft_tokens is None)
        self.attn_backend, self.width = attn_backend, 1 if plain else speculative_num_draft_tokens
        self.hidden_full = model_runner.server_args.enable_return_hidden_states
        self.args_width = model_runner.server_args.speculative_num_draft_tokens
        self.backend_prepared = attn_backend.prepared   # prepared before capture?
        self.capture_bs, self.max_bs = [1, 2, 4, 8], 8
        self.buffers = types.SimpleNamespace(input_ids=torch.zeros(8 * self.width,
                                                                   dtype=torch.int64))


class FakeModelRunner:
    def __init__(self, n_max, graphs=True, fail_at=None):
        self.spec_algorithm = "DDTREE-GPU"
        self.server_args = FakeArgs(n_max)
        self.attn_backend = FakeBackend(n_max)
        self.decode_cuda_graph_runner = (FakeRunner(self, attn_backend=self.attn_backend,
                                                    speculative_num_steps=1,
                                                    speculative_num_draft_tokens=n_max)
                                         if graphs else None)
        self.init_new_workspace = False
        self.built = []
        self.fail_at = fail_at
        self.req_to_token_pool = types.SimpleNamespace(size=6)

    def _get_attention_backend(self, init_new_workspace=True):
        assert not init_new_workspace           # the server's flashinfer workspace, shared
        self.init_new_workspace = "set by SGLang"   # SGLang sets it; the build restores it
        if self.server_args.speculative_num_draft_tokens == self.fail_at:
            raise RuntimeError("backend build failed")
        b = FakeBackend(self.server_args.speculative_num_draft_tokens)
        self.built.append(b)
        return b


def _prepare(b):
    b.prepared = True


def test_build_state_sees_its_width_and_restores_server_args():
    mr = FakeModelRunner(32)
    st = VS.build_verify_state(mr, 8, use_graphs=True, runner_cls=FakeRunner, prepare_backend=_prepare,
                              free_gb=iter([50.0, 49.25]).__next__)
    assert st.width == 8 and st.attn_backend.width == 8 and st.attn_backend.prepared
    assert st.graph_runner.width == 8 and st.graph_runner.args_width == 8 and st.graph_runner.backend_prepared
    assert st.mem_gb == pytest.approx(0.75) and st.build_s >= 0
    assert mr.server_args.speculative_num_draft_tokens == 32        # KV stays reserved for the widest
    assert [kw for _, kw in mr.server_args.log] == [dict(speculative_num_draft_tokens=8),
                                                    dict(speculative_num_draft_tokens=32)]
    assert mr.init_new_workspace is False
    eager = VS.build_verify_state(mr, 1, use_graphs=False, runner_cls=FakeRunner)
    assert eager.graph_runner is None and eager.attn_backend.width == 1


def test_build_state_restores_server_args_on_failure():
    mr = FakeModelRunner(32, fail_at=16)
    with pytest.raises(RuntimeError):
        VS.build_verify_state(mr, 16, use_graphs=True, runner_cls=FakeRunner)
    assert mr.server_args.speculative_num_draft_tokens == 32 and mr.init_new_workspace is False


def test_installed_swaps_for_the_verify_only():
    mr = FakeModelRunner(32)
    home = (mr.attn_backend, mr.decode_cuda_graph_runner)
    states = VS.TargetStates(mr, 32)
    for w in (1, 8):
        states.add(VS.build_verify_state(mr, w, use_graphs=True, runner_cls=FakeRunner))
    with pytest.raises(ValueError):
        states.add(VS.VerifyState(8, None, None))
    from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

    for w in (8, 1, 32):
        with states.installed(w) as st:
            # SGLang's adaptive state record: only the target side, the steps DFlash runs (0: none)
            assert isinstance(st, SpecRuntimeState)
            assert (st.speculative_num_draft_tokens, st.speculative_num_steps) == (w, 0 if w == 1 else 1)
            assert st.target_attn_backend is mr.attn_backend
            assert st.target_graph_runner is mr.decode_cuda_graph_runner
            assert st.draft_attn_backend is None and st.cuda_graph_runner_for_draft_extend is None
            assert mr.attn_backend.width == w and mr.decode_cuda_graph_runner.width == w
            assert mr.decode_cuda_graph_runner.attn_backend is mr.attn_backend
        assert (mr.attn_backend, mr.decode_cuda_graph_runner) == home
    with pytest.raises(RuntimeError):
        with states.installed(8):
            raise RuntimeError("verify failed")
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == home
    with pytest.raises(KeyError):
        with states.installed(16):
            pass
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == home


def test_cost_table_from_a_fake_timer():
    calls = []

    def timer(w, bs):
        calls.append((w, bs))
        return 1.0 + 0.1 * w * bs

    t = VS.cost_table_from_timer({1: [1, 4], 8: [1, 4], 32: [1, 2]}, timer, draft_ms={1: 2.0, 4: 3.0},
                                no_spec=True)
    assert sorted(calls) == [(1, 1), (1, 4), (8, 1), (8, 4), (32, 1), (32, 2)]
    assert t.widths == [8, 32]
    assert t.base_ms == {1: pytest.approx(1.1), 4: pytest.approx(1.4)}          # no drafter in no-spec
    assert t.verify_ms[8] == {1: pytest.approx(1.8 + 2.0), 4: pytest.approx(4.2 + 3.0)}
    assert t.verify_ms[32][2] == pytest.approx(7.4 + 2 + 1 / 3)                # draft row interpolated
    assert t.cost(4, NO_SPEC) == pytest.approx(1.4)
    t2 = VS.cost_table_from_timer({8: [1], 32: [1]}, timer, no_spec=False)
    assert t2.base_ms == t2.verify_ms[8]                                         # placeholder, unused
    with pytest.raises(ValueError):
        VS.cost_table_from_timer({8: [1], 32: [1]}, timer, no_spec=True)
    with pytest.raises(ValueError):                                              # CostTable's checks
        VS.cost_table_from_timer({1: [1], 8: [1]}, lambda w, bs: 0.0, no_spec=True)


def test_graph_replay_ms_without_a_plain_graph():
    runner = types.SimpleNamespace(backend=types.SimpleNamespace(), _make_graph_key=lambda bs: bs)
    assert VS.graph_replay_ms(runner, 4) is None
    runner.backend._graphs = {}
    assert VS.graph_replay_ms(runner, 4) is None


class _FakeGpu:
    """A fake CUDA clock for graph_replay_ms: a graph's replay advances it by its ms (the first
    replay of each graph by ``first`` x that: its upload); events read it when recorded."""

    def __init__(self, first=1.0):
        self.t, self.first, self.replays = 0.0, first, {}

    def graph(self, ms):
        gpu = self

        class G:
            def replay(self):
                k = gpu.replays.get(id(self), 0)
                gpu.t += ms * (gpu.first if k == 0 else 1.0)
                gpu.replays[id(self)] = k + 1
        return G()

    def event_cls(self):
        gpu = self

        class Ev:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = gpu.t

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.at - self.at
        return Ev


def test_graph_replay_ms_times_a_large_graph_once_and_a_small_one_several_times(monkeypatch):
    """After two warm-up replays, the timed replays fill about TIMED_MS of GPU time, between 1 and
    ``replays``: an 80 ms graph is timed once (3 replays in all, 7 before), a 1 ms graph 5 times, a
    10 ms one twice; each mean is the graph's time.  The first replay's upload (3x here) changes
    neither the means nor the counts (control: the same counts without it)."""
    counts = {}
    for first in (3.0, 1.0):
        gpu = _FakeGpu(first=first)
        monkeypatch.setattr(VS.torch.cuda, "Event", gpu.event_cls())
        monkeypatch.setattr(VS.torch.cuda, "synchronize", lambda *a: None)
        graphs = {bs: gpu.graph(ms) for bs, ms in ((64, 80.0), (1, 1.0), (8, 10.0))}
        runner = types.SimpleNamespace(backend=types.SimpleNamespace(_graphs=graphs),
                                       _make_graph_key=lambda bs: bs)
        for bs, ms in ((64, 80.0), (1, 1.0), (8, 10.0)):
            assert VS.graph_replay_ms(runner, bs) == pytest.approx(ms), (first, bs)
        counts[first] = [gpu.replays[id(graphs[bs])] for bs in (64, 1, 8)]
    assert counts[3.0] == counts[1.0] == [3, 7, 4], counts
    assert VS.graph_replay_ms(types.SimpleNamespace(backend=types.SimpleNamespace(_graphs={}),
                                                    _make_graph_key=lambda bs: bs), 8) is None


def test_root_only_tree_is_the_budget_zero_tree(rng):
    from sglang_ddtree import ddtree

    bs, D, K = 4, 5, 6
    lp = torch.sort(torch.randn(bs, D, K, generator=rng).log_softmax(-1), descending=True).values
    ids = torch.randint(0, 90, (bs, D, K), generator=rng)
    roots = torch.randint(0, 90, (bs,), generator=rng)
    want = ddtree.build_tree(lp, ids, 0, root_tokens=roots, backend="reference")
    got = DT.root_only_tree(roots, D)
    for f in ("tokens", "depth", "parent", "num_nodes", "visibility", "mask_words"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert got.budget == 0 and got.draft_depth == D


def test_root_only_accept_is_the_greedy_accept_of_the_root_only_tree(rng):
    """What the no-speculation round uses instead of an accept launch: equal to the reference walk
    on the budget-0 tree for fresh targets, and its cached constants stay unchanged across rounds
    (the commit and the statistics only read them; bs 3 comes twice, the second time from the cache)."""
    from sglang_ddtree import ddtree

    D = 7
    for bs in (1, 3, 16, 3):
        roots = torch.randint(0, 50, (bs,), generator=rng)
        tree = DT.root_only_tree(roots, D)
        top1 = torch.randint(0, 50, (bs, 1), generator=rng)
        want = ddtree.accept_greedy(tree, top1, backend="reference")
        got = DT.root_only_accept(top1, D)
        for f in ("accept_len", "path", "bonus"):
            assert getattr(got, f).dtype == getattr(want, f).dtype, f
            assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert torch.equal(got.new_tokens(tree), want.new_tokens(tree))


# ------------------------------------------------------------------ the worker's start-up
def _worker_module():
    pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")
    from sglang_ddtree import worker
    return worker


VOCAB_FAKE = 5000


def _fake_worker(W, cfg, mr):
    mr.model_config = types.SimpleNamespace(vocab_size=VOCAB_FAKE)
    w = object.__new__(W.DDTreeWorker)
    w.__dict__.update(algo_name="DDTREE-GPU", device="cpu", gpu_id=0, ps=types.SimpleNamespace(tp_rank=0),
                      _adaptive_cfg=cfg, _policy=RoundPolicy(cfg.widest if cfg else 8), _verify_states=None,
                      _target_worker=types.SimpleNamespace(model_runner=mr),
                      draft_model_runner=types.SimpleNamespace(decode_cuda_graph_runner=None))
    return w


@pytest.fixture
def fake_startup(monkeypatch):
    W = _worker_module()
    super_calls = []
    monkeypatch.setattr(W.DFlashWorkerV2, "init_cuda_graphs", lambda self: super_calls.append(self))
    checked = []
    monkeypatch.setattr(W, "check_tree_verify_backend", lambda b, algo: checked.append(("check", b)))
    monkeypatch.setattr(W, "disable_causal_verify_shortcut",
                        lambda b, algo: (checked.append(("split", b)), _prepare(b)))
    monkeypatch.setattr(VS, "graph_runner_cls", lambda: FakeRunner)
    # the plain decode state's backend: SGLang's builder by name, seen on a non-speculative runner
    import sglang.srt.speculative.spec_info as SI
    monkeypatch.setattr(SI, "SpeculativeAlgorithm", types.SimpleNamespace(NONE="NONE"))

    def build_plain(mr, name):
        assert mr.spec_algorithm == "NONE" and mr.server_args.enable_return_hidden_states
        b = FakeBackend(1)
        b.name = name
        mr.built.append(b)
        return b

    monkeypatch.setattr(P, "_build_backend", build_plain)
    monkeypatch.setattr(W, "get_tp_group", lambda: types.SimpleNamespace(world_size=1))
    timed = []

    def fake_replay(runner, bs):
        ids = runner.buffers.input_ids           # randomized before timing: distinct, in the vocabulary
        assert 0 <= int(ids.min()) and int(ids.max()) < VOCAB_FAKE and ids.unique().numel() > ids.numel() // 2
        timed.append((runner.width, bs))
        return 1.0 + runner.width * bs / 10

    monkeypatch.setattr(VS, "graph_replay_ms", fake_replay)
    return types.SimpleNamespace(W=W, super_calls=super_calls, checked=checked, timed=timed)


def test_fixed_budget_builds_no_extra_state(fake_startup):
    W = fake_startup.W
    mr = FakeModelRunner(32)
    home = (mr.attn_backend, mr.decode_cuda_graph_runner)
    w = _fake_worker(W, AC.parse_config({"SGLANG_DDTREE_ADAPTIVE": "0"}, budget=31, algo="DDTREE-GPU"), mr)
    W.DDTreeWorker.init_cuda_graphs(w)
    assert len(fake_startup.super_calls) == 1                       # DFLASH's own capture still runs
    assert mr.built == [] and mr.server_args.log == [] and fake_startup.timed == []
    assert w._policy.controller is None and w._verify_states is None
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == home


def test_adaptive_startup_builds_each_extra_width_and_the_cost_table(fake_startup):
    W = fake_startup.W
    mr = FakeModelRunner(32)
    home = (mr.attn_backend, mr.decode_cuda_graph_runner)
    cfg = AC.parse_config({"SGLANG_DDTREE_BUDGETS": "0,7,31"}, budget=31,
                         algo="DDTREE-GPU")
    w = _fake_worker(W, cfg, mr)
    W.DDTreeWorker.init_cuda_graphs(w)
    assert len(fake_startup.super_calls) == 1
    assert [b.width for b in mr.built] == [1, 8]                    # the widest is SGLang's own
    st = w._verify_states.states
    assert sorted(st) == [1, 8, 32] and st[32].attn_backend is home[0] and st[32].graph_runner is home[1]
    assert st[8].graph_runner.width == 8 and st[8].graph_runner.backend_prepared
    assert ("check", st[8].attn_backend) in fake_startup.checked
    # no speculation: a DECODE graph on the user's decode backend (not the tree-verify one), capturing
    # hidden states for the drafter's deferred catch-up; the runner looks speculative again after
    assert st[1].graph_runner.width == 1 and st[1].graph_runner.hidden_full
    assert st[1].attn_backend.name == "flashinfer" and st[1].backend_name == "flashinfer"
    assert ("check", st[1].attn_backend) not in fake_startup.checked and not st[1].attn_backend.prepared
    assert mr.spec_algorithm == "DDTREE-GPU" and mr.server_args.enable_return_hidden_states is False
    assert w._catch_up is not None and w._catch_up.capacity == 8 * 6
    assert mr.server_args.speculative_num_draft_tokens == 32
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == home
    # every captured (width, bs) timed once; the policy got that table
    assert sorted(fake_startup.timed) == sorted((wd, bs) for wd in (1, 8, 32) for bs in (1, 2, 4, 8))
    table = w._policy.controller.policy.costs
    assert table.widths == [8, 32] and table.base_ms[4] == pytest.approx(1.4)
    assert w._policy.controller.policy.allow_no_spec


def test_adaptive_without_graphs(fake_startup):
    W = fake_startup.W
    cfg = AC.parse_config({"SGLANG_DDTREE_BUDGETS": "0,7,31"}, budget=31, algo="DDTREE-GPU")
    with pytest.raises(ValueError, match="needs the target's CUDA graphs"):
        W.DDTreeWorker.init_cuda_graphs(_fake_worker(W, cfg, FakeModelRunner(32, graphs=False)))
    # the default set without graphs: the fixed budget, logged, nothing built
    mr = FakeModelRunner(32, graphs=False)
    w = _fake_worker(W, AC.parse_config({}, budget=31, algo="DDTREE-GPU"), mr)
    w.budget = 31
    W.DDTreeWorker.init_cuda_graphs(w)
    assert w._policy.controller is None and w._adaptive_cfg is None and w._verify_states is None and mr.built == []
    # the forced cycle (the GPU lossless check) needs no cost table: eager states
    cfg = AC.parse_config({"SGLANG_DDTREE_BUDGETS": "0,7,31"}, budget=31, algo="DDTREE-GPU",
                         sw=switches.Switches(budget_cycle=(7, 31)))
    mr = FakeModelRunner(32, graphs=False)
    w = _fake_worker(W, cfg, mr)
    W.DDTreeWorker.init_cuda_graphs(w)
    assert w._verify_states.states[8].graph_runner is None and w._policy.controller.policy is None
    assert fake_startup.timed == []


def test_randomize_graph_input_ids_is_seeded_and_in_range():
    r = types.SimpleNamespace(buffers=types.SimpleNamespace(input_ids=torch.zeros(4096, dtype=torch.int32)))
    assert VS.randomize_graph_input_ids(r, 151936)
    a = r.buffers.input_ids.clone()
    assert a.dtype == torch.int32 and 0 <= int(a.min()) and int(a.max()) < 151936 and a.unique().numel() > 4000
    assert VS.randomize_graph_input_ids(r, 151936) and torch.equal(a, r.buffers.input_ids)   # every rank alike
    assert not VS.randomize_graph_input_ids(types.SimpleNamespace(), 100)
    assert not VS.randomize_graph_input_ids(r, 0)


def test_default_set_stops_building_widths_when_memory_runs_short(fake_startup, monkeypatch):
    """The default set (no budget setting) builds the plain state, then widths while the free memory
    covers twice the largest state so far (at least adaptive_config.MIN_FREE_GB); the rest are dropped from
    the set, the cost table and what requests may pin, with a warning.  An explicit set is built as
    asked."""
    W = fake_startup.W
    mr = FakeModelRunner(32)
    cfg = AC.parse_config({}, budget=31, algo="DDTREE-GPU")
    assert cfg.implicit and cfg.widths == (1, 8, 16, 32)
    w = _fake_worker(W, cfg, mr)
    w.budget = 31
    free = iter([50.0, 49.0, 1.5, 1.5])            # the plain state's build reads two, then width 8's check
    monkeypatch.setattr(W.DDTreeWorker, "_free_gb_reader", lambda self: (lambda: next(free)))
    AC.register_served("DDTREE-GPU", 31, cfg)
    W.DDTreeWorker.init_cuda_graphs(w)
    assert sorted(w._verify_states.states) == [1, 32]                 # widths 8 and 16 not built
    assert w._policy.controller.cfg.widths == (1, 32) and w._adaptive_cfg.budgets == (31,)
    assert w._policy.controller.policy.costs.widths == [32]
    assert AC.allowed_request_budgets(31, w._adaptive_cfg) == [0, 31]
    assert AC.request_budget_error({AC.REQUEST_BUDGET_KEY: 7}) is not None
    # an explicit set: built whatever the free memory says
    mr2 = FakeModelRunner(32)
    w2 = _fake_worker(W, AC.parse_config({"SGLANG_DDTREE_BUDGETS": "0,7,15,31"}, budget=31, algo="DDTREE-GPU"),
                      mr2)
    w2.budget = 31
    monkeypatch.setattr(W.DDTreeWorker, "_free_gb_reader", lambda self: (lambda: 0.5))
    W.DDTreeWorker.init_cuda_graphs(w2)
    assert sorted(w2._verify_states.states) == [1, 8, 16, 32]
