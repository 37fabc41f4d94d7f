"""The plain regime's serving path (issue 52 item 1, design step 2): batches made while the regime
is plain take SGLang's plain path and the DDTree worker hands them to the target as base would.

Checked on SGLang 0.5.16's real objects where they run on the CPU (``ScheduleBatch.init_new``,
``FutureMap``, ``resolve_forward_inputs``, the registered ``SpeculativeAlgorithm`` of DDTREE-GPU),
the worker on fakes that record what it asked of the target; each case with a control that must
come out the other way."""
import types

import pytest
import torch

pytest.importorskip("sglang.srt.managers.overlap_utils")

from sglang_ddtree import plugin, regime_state, switches  # noqa: E402
from sglang_ddtree import worker as W  # noqa: E402
from sglang_ddtree.policy import NO_SPEC  # noqa: E402

plugin.register()

import inspect  # noqa: E402

from sglang.srt.managers.overlap_utils import FutureMap  # noqa: E402
from sglang.srt.managers.overlap_utils import resolve_forward_inputs as _resolve  # noqa: E402
from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_ddtree.patches import regime_batch_algo, regime_forward_inputs  # noqa: E402

# SGLang's own functions, whether or not another test of this process applied the plugin's hooks
resolve_forward_inputs = inspect.unwrap(_resolve)

DDTREE = SpeculativeAlgorithm.from_string("DDTREE-GPU")
DFLASH = SpeculativeAlgorithm.from_string("DFLASH")
NONE = SpeculativeAlgorithm.NONE


@pytest.fixture(autouse=True)
def _fresh_state():
    regime_state.disable()
    yield
    regime_state.disable()


def _new_batch(algo):
    """SGLang's own init_new through the hook (as HookRegistry chains it), on CPU stand-ins."""
    return regime_batch_algo.init_new_in_regime(
        inspect.unwrap(ScheduleBatch.init_new.__func__), ScheduleBatch, [], types.SimpleNamespace(device="cpu"), None,
        None, types.SimpleNamespace(vocab_size=100), False, algo)


# ------------------------------------------------------------------ regime_state + batch creation
def test_new_batches_take_the_plain_path_only_while_a_ddtree_server_is_plain():
    assert _new_batch(DDTREE).spec_algorithm is DDTREE          # no regime served: SGLang's value
    regime_state.enable(regime_state.SPEC)
    assert _new_batch(DDTREE).spec_algorithm is DDTREE          # speculative regime
    regime_state.request(regime_state.PLAIN)
    assert _new_batch(DDTREE).spec_algorithm is DDTREE          # pending is not yet switched
    regime_state.switched()
    assert _new_batch(DDTREE).spec_algorithm.is_none()          # plain regime: SGLang's plain path
    assert _new_batch(DFLASH).spec_algorithm is DFLASH          # another algorithm: never touched
    assert _new_batch(NONE).spec_algorithm.is_none()
    regime_state.request(regime_state.SPEC)
    regime_state.switched()
    assert _new_batch(DDTREE).spec_algorithm is DDTREE and regime_state.STATE.switches == 2


def test_regime_state_refuses_bad_requests():
    with pytest.raises(RuntimeError, match="not served"):
        regime_state.request(regime_state.PLAIN)
    with pytest.raises(ValueError, match="regime must be"):
        regime_state.enable("fast")
    regime_state.enable(regime_state.PLAIN)
    regime_state.request(regime_state.PLAIN)                    # already there: nothing pending
    assert regime_state.STATE.pending is None
    with pytest.raises(RuntimeError, match="no switch was pending"):
        regime_state.switched()


# ------------------------------------------------------------------ the input ids of a plain decode
def _future_map(algo, size=8):
    fm = FutureMap(torch.device("cpu"), algo, types.SimpleNamespace(req_to_token=torch.zeros(size, 4)),
                   False)
    fm.output_tokens_buf.copy_(torch.arange(100, 100 + size))
    return fm


def _sched_batch(algo, mode=ForwardMode.DECODE):
    return types.SimpleNamespace(prefill_input_ids_cpu=None, mix_running_indices=None, input_ids=None,
                                 spec_algorithm=algo, forward_mode=mode, enable_overlap=False,
                                 req_pool_indices=torch.tensor([3, 1, 6]))


def test_a_plain_decode_batch_of_a_ddtree_server_gathers_its_input_ids():
    hook = regime_forward_inputs.resolve_with_plain_batches
    b = _sched_batch(NONE)
    hook(resolve_forward_inputs, b, _future_map(DDTREE))
    assert b.input_ids.tolist() == [103, 101, 106]              # the last step's relayed tokens
    # control: SGLang's own function leaves it None on a DDTREE server's FutureMap (why the hook exists)
    b = _sched_batch(NONE)
    resolve_forward_inputs(b, _future_map(DDTREE))
    assert b.input_ids is None
    # a speculative batch takes its tokens from its draft input: untouched
    b = _sched_batch(DDTREE)
    hook(resolve_forward_inputs, b, _future_map(DDTREE))
    assert b.input_ids is None
    # a base server: SGLang's gather, once, the same values
    b = _sched_batch(NONE)
    hook(resolve_forward_inputs, b, _future_map(NONE))
    assert b.input_ids.tolist() == [103, 101, 106]
    # an idle plain batch gathers nothing
    b = _sched_batch(NONE, ForwardMode.IDLE)
    hook(resolve_forward_inputs, b, _future_map(DDTREE))
    assert b.input_ids is None


# ------------------------------------------------------------------ the worker's dispatch
class FakeTarget:
    """The target TpModelWorker: records each forward (the batch, its keyword arguments, which
    target state was installed) and returns a plain result with hidden states set."""

    def __init__(self, mr):
        self.mr, self.calls = mr, []
        self.model_runner = types.SimpleNamespace(prefill_cuda_graph_runner=None)   # no prefill graph

    def forward_batch_generation(self, batch, **kw):
        self.calls.append((batch, kw, self.mr.attn_backend))
        bs = len(batch.seq_lens)
        return types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=torch.ones(bs, 2)),
                                     next_token_ids=torch.zeros(bs, dtype=torch.long), next_draft_input=None)


class FakeStates:
    def __init__(self, mr, widths):
        self.mr, self.states = mr, {w: f"backend_w{w}" for w in widths}

    def installed(self, width):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.mr.attn_backend = self.states[width]
            try:
                yield
            finally:
                self.mr.attn_backend = "backend_widest"
        return cm()


class FakeCatchUp:
    rows = 3

    def flush(self):
        self.rows = 0


def _worker(widths=(NO_SPEC, 8, 16)):
    w = W.DDTreeWorker.__new__(W.DDTreeWorker)
    w.algo_name = "DDTREE-GPU"
    mr = types.SimpleNamespace(attn_backend="backend_widest")
    w._target_worker = FakeTarget(mr)
    w._verify_states = FakeStates(mr, widths)
    w._policy = types.SimpleNamespace(interrupts=0, regime_controller=None)
    w._policy.interrupt = lambda: setattr(w._policy, "interrupts", w._policy.interrupts + 1)
    w._catch_up = FakeCatchUp()
    w.ps = types.SimpleNamespace(tp_rank=0)
    w._forward_tree_round = lambda *a, **k: "tree round"
    w._prefill = lambda *a, **k: "ddtree prefill"
    return w


def _batch(algo, mode, bs=3, input_ids="ids"):
    return types.SimpleNamespace(spec_algorithm=algo, forward_mode=mode, is_extend_in_batch=mode.is_extend(),
                                 seq_lens=torch.zeros(bs), input_ids=input_ids, return_hidden_states=False)


def test_plain_batches_go_to_the_target_as_base_runs_them():
    w = _worker()
    out = w.forward_batch_generation(_batch(NONE, ForwardMode.DECODE), on_publish=None)
    (batch, kw, backend), = w._target_worker.calls
    assert backend == f"backend_w{NO_SPEC}"          # the plain decode state
    assert kw == {}                        # SGLang's own sampling, no capture, no verify
    assert out.logits_output.hidden_states is None and out.next_draft_input is None
    assert w._catch_up.rows == 0 and w._policy.interrupts == 1
    assert w._verify_states.mr.attn_backend == "backend_widest"              # restored
    # a plain prefill: the target's extend on the server's own state, no hidden capture, no drafter write
    out = w.forward_batch_generation(_batch(NONE, ForwardMode.EXTEND), on_publish=None)
    batch, kw, backend = w._target_worker.calls[-1]
    assert backend == "backend_widest" and kw == {}
    # controls: a batch of the speculative regime never reaches the target this way
    w2 = _worker()
    assert w2.forward_batch_generation(_batch(DDTREE, ForwardMode.DECODE)) == "tree round"
    assert w2.forward_batch_generation(_batch(DDTREE, ForwardMode.EXTEND)) == "ddtree prefill"
    assert not w2._target_worker.calls


def test_a_plain_decode_refuses_what_it_cannot_run():
    w = _worker(widths=(8, 16))
    with pytest.raises(RuntimeError, match="no plain decode state"):
        w.forward_batch_generation(_batch(NONE, ForwardMode.DECODE))
    w = _worker()
    with pytest.raises(RuntimeError, match="without input ids"):
        w.forward_batch_generation(_batch(NONE, ForwardMode.DECODE, input_ids=None))


def test_the_worker_starts_the_regime_its_switch_names(monkeypatch):
    from sglang_ddtree.policy import RoundPolicy
    from sglang_ddtree.policy.regime import RegimeController

    monkeypatch.setattr(W, "get_tp_group", lambda: types.SimpleNamespace(world_size=1))
    # the default: auto, starting in speculation, rank 0's controller measuring
    w = _worker()
    w._policy = RoundPolicy(17)
    monkeypatch.setattr(switches, "CURRENT", switches.Switches())
    w._start_regime()
    assert regime_state.STATE.enabled and regime_state.STATE.regime == regime_state.SPEC
    assert isinstance(w._policy.regime_controller, RegimeController)
    w = _worker()
    monkeypatch.setattr(switches, "CURRENT", switches.Switches(regime="spec"))
    w._start_regime()
    assert regime_state.STATE.enabled and regime_state.STATE.regime == regime_state.SPEC
    assert w._policy.regime_controller is None      # spec: no controller, never switches
    monkeypatch.setattr(switches, "CURRENT", switches.Switches(regime="plain"))
    w._start_regime()
    assert regime_state.STATE.plain()
    # without the plain decode state (a fixed budget): plain refused at start-up, not at the first
    # batch; the default only speculates
    w = _worker(widths=(8, 16))
    with pytest.raises(ValueError, match="regime=plain needs the plain decode state"):
        w._start_regime()
    monkeypatch.setattr(switches, "CURRENT", switches.Switches())
    w._start_regime()
    assert not regime_state.STATE.enabled          # spec only: new batches keep the server's algorithm
    assert _new_batch(DDTREE).spec_algorithm is DDTREE


def test_the_regime_switch_and_its_arm_and_stage_names():
    assert switches.parse('{"regime": "plain"}').regime == "plain"
    assert switches.parse('{"regime": "auto"}').regime == "auto"
    with pytest.raises(ValueError, match="regime must be"):
        switches.parse('{"regime": "fast"}')
    from sglang_ddtree.ab.servers import arm_switches, parse_arm

    assert arm_switches(parse_arm("ddtree_regimeplain")) == {"regime": "plain"}
    assert arm_switches(parse_arm("ddtree_regimeauto")) == {"regime": "auto"}
    assert arm_switches(parse_arm("ddtree_regimespec")) == {"regime": "spec"}
    assert switches.Switches().regime == "auto" and switches.describe(switches.Switches(regime="spec")) == "regime='spec'"
    with pytest.raises(ValueError, match="only adaptive arms"):
        parse_arm("ddtree_b16_regimeplain")


# ------------------------------------------------------------------ the regime controller's feed
def _req(rid, n):
    return types.SimpleNamespace(rid=rid, output_ids=[0] * n,
                                 sampling_params=types.SimpleNamespace(custom_params=None))


def test_launch_tracker_counts_the_tokens_and_admissions_between_launches():
    from sglang_ddtree.policy.regime import LaunchTracker

    t = LaunchTracker()
    a, b = _req("a", 1), _req("b", 1)                     # just prefilled: one token each
    v = t.view([a, b])
    assert (v.bs, v.emitted, v.admitted) == (2, 0.0, 2)
    a.output_ids += [0] * 3
    b.output_ids += [0]
    v = t.view([a, b])
    assert (v.emitted, v.admitted) == (4.0, 0)
    b.output_ids += [0] * 2                               # b's last round, then it finished
    a.output_ids += [0]
    c = _req("c", 1)
    v = t.view([a, c])
    # a's 1 and the finished b's last 2: counting the launch's own requests only would give 1
    assert (v.rids, v.emitted, v.admitted) == (("a", "c"), 3.0, 1)


def test_the_cycle_switches_every_k_launches_both_ways_through_the_hook(monkeypatch):
    from sglang_ddtree.policy import RoundPolicy
    from sglang_ddtree.policy.regime import CycleRegime

    monkeypatch.setattr(switches, "CURRENT", switches.Switches(regime="cycle3"))
    w = _worker()
    w._policy = RoundPolicy(17)
    w._start_regime()
    assert isinstance(w._policy.regime_controller, CycleRegime)
    assert regime_state.STATE.enabled and regime_state.STATE.regime == regime_state.SPEC
    reqs = [_req("a", 1), _req("b", 1)]
    batch = types.SimpleNamespace(reqs=reqs)
    for _ in range(2):
        w._regime_launch(batch, no_spec=False)
    assert regime_state.STATE.pending is None
    w._regime_launch(batch, no_spec=False)
    assert regime_state.STATE.pending == regime_state.PLAIN
    w._regime_launch(batch, no_spec=False)                # pending: nothing more is asked
    assert w._policy.regime_controller.launches == 3
    regime_state.switched()                               # what the transition hook calls
    assert w._policy.regime_controller.regime == regime_state.PLAIN      # told through on_switch
    assert _new_batch(DDTREE).spec_algorithm.is_none()
    for _ in range(3):
        w._regime_launch(batch, no_spec=True)
    assert regime_state.STATE.pending == regime_state.SPEC
    regime_state.switched()
    assert _new_batch(DDTREE).spec_algorithm is DDTREE and w._policy.regime_controller.switches == 2
    # control: a forced regime has no controller, and nothing is ever asked of the hook
    monkeypatch.setattr(switches, "CURRENT", switches.Switches(regime="plain"))
    w = _worker()
    w._policy = RoundPolicy(17)
    w._start_regime()
    for _ in range(10):
        w._regime_launch(batch, no_spec=True)
    assert regime_state.STATE.pending is None and regime_state.STATE.plain()


def test_cycle_values_are_checked():
    from sglang_ddtree.policy.regime import CycleRegime

    assert switches.regime_cycle("cycle7") == 7 and switches.regime_cycle("cycle0") is None
    for bad in ("cycle", "cycle0", "cyclex", "automatic"):
        with pytest.raises(ValueError, match="regime must be"):
            switches.Switches(regime=bad)
    with pytest.raises(ValueError, match="integer >= 1"):
        CycleRegime(0)
    with pytest.raises(RuntimeError, match="no switch was pending"):
        CycleRegime(2).switched()


# ------------------------------------------------------------------ SGLang's bookkeeping of plain steps
def test_a_log_interval_of_plain_batches_logs_as_plain_decoding():
    from sglang_ddtree.patches.regime_decode_stats import report_plain_interval

    seen = []

    def original(self, *a, **k):        # SGLang's line: divides when the server's algorithm speculates
        seen.append(self.scheduler.spec_algorithm)
        if not self.scheduler.spec_algorithm.is_none():
            return self.spec_num_accept_tokens / self.spec_num_forward_ct
        return 0

    rep = types.SimpleNamespace(scheduler=types.SimpleNamespace(spec_algorithm=DDTREE),
                                spec_num_forward_ct=0, spec_num_accept_tokens=0)
    assert report_plain_interval(original, rep, True) == 0 and seen[-1].is_none()
    assert rep.scheduler.spec_algorithm is DDTREE                     # restored
    rep.spec_num_forward_ct, rep.spec_num_accept_tokens = 4, 10
    assert report_plain_interval(original, rep, True) == 2.5 and seen[-1] is DDTREE
    # control: SGLang's line on its own divides by zero; another algorithm is never touched
    rep.spec_num_forward_ct = 0
    with pytest.raises(ZeroDivisionError):
        original(rep)
    rep.scheduler.spec_algorithm = DFLASH
    with pytest.raises(ZeroDivisionError):
        report_plain_interval(original, rep, True)


def test_a_ddtree_future_map_stashes_a_plain_step_after_a_round():
    from sglang.srt.managers.overlap_utils import RelayPayload
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
    from sglang.srt.speculative.spec_utils import spec_need_hidden_states as _need

    spec_need_hidden_states = inspect.unwrap(_need)       # SGLang's, even if the hook was applied

    from sglang_ddtree.patches.relay_hidden_states import need_hidden_states_unless_ddtree

    def stash_round_then_plain(monkeypatch, need):
        import sglang.srt.speculative.spec_utils as su
        monkeypatch.setattr(su, "spec_need_hidden_states", need)
        fm = _future_map(DDTREE)
        idx = torch.tensor([1, 2])
        fm.stash(idx, RelayPayload.from_draft_input(make_draft_input_v2(
            bonus_tokens=torch.tensor([7, 8]), new_seq_lens=torch.tensor([5, 6]))))
        fm.stash(idx, RelayPayload(bonus_tokens=torch.tensor([9, 10])))      # a plain step's relay
        return fm.output_tokens_buf[idx].tolist()

    sa = types.SimpleNamespace(speculative_algorithm="DDTREE-GPU", enable_multi_layer_eagle=False)
    assert not need_hidden_states_unless_ddtree(spec_need_hidden_states, sa)
    assert need_hidden_states_unless_ddtree(
        spec_need_hidden_states, types.SimpleNamespace(speculative_algorithm="EAGLE3",
                                                       enable_multi_layer_eagle=False))
    mp = pytest.MonkeyPatch()
    try:
        assert stash_round_then_plain(mp, lambda *a: need_hidden_states_unless_ddtree(
            spec_need_hidden_states, sa)) == [9, 10]
        # control: SGLang's answer for a DDTREE server makes the plain step's relay fail
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'to'"):
            stash_round_then_plain(mp, lambda *a: spec_need_hidden_states(sa))
    finally:
        mp.undo()


def test_auto_under_tp_switches_every_rank_at_the_same_launch_on_rank_0s_decision(monkeypatch):
    """regime=auto: rank 0 measures and decides; at every REGIME_SYNC_EVERY-th launch all ranks take
    rank 0's decision (the broadcast, here a shared box), so rank 1, whose own clock would have
    decided nothing, asks the hook for the same switch at the same launch."""
    from sglang_ddtree.policy import RoundPolicy
    from sglang_ddtree.policy.regime import FollowerRegime, RegimeController

    monkeypatch.setattr(switches, "CURRENT", switches.Switches(regime="auto"))
    monkeypatch.setattr(W, "get_tp_group", lambda: types.SimpleNamespace(world_size=2))
    box = {}

    def make(rank):
        w = _worker()
        w.ps = types.SimpleNamespace(tp_rank=rank)
        w._policy = RoundPolicy(17)
        w._start_regime()
        w._tp_shared = (lambda obj: box.__setitem__("v", obj) or obj) if rank == 0 else (lambda obj: box["v"])
        return w

    # rank 0's controller decides plain from its 3rd launch on (forced here); the ranks share one
    # STATE in this process, so each rank's request is read right after its own launch and reset
    def ranks(shared):
        regime_state.disable()
        r0, r1 = make(0), make(1)
        assert isinstance(r0._policy.regime_controller, RegimeController) and r0._regime_shared
        assert isinstance(r1._policy.regime_controller, FollowerRegime)
        n = [0]

        def rank0_decision(view):
            n[0] += 1
            return types.SimpleNamespace(pending=regime_state.PLAIN if n[0] >= 3 else None)

        r0._policy.regime = rank0_decision
        r0._regime_shared = r1._regime_shared = shared
        asked = {0: [], 1: []}
        for launch in range(1, 2 * W.REGIME_SYNC_EVERY + 1):
            for rank, w in ((0, r0), (1, r1)):
                regime_state.STATE.pending = None
                w._regime_launch(types.SimpleNamespace(reqs=[_req("a", 1)]), no_spec=False)
                if regime_state.STATE.pending is not None:
                    asked[rank].append(launch)
        return asked, r1

    asked, r1 = ranks(shared=True)
    assert asked[0] == asked[1] == [W.REGIME_SYNC_EVERY, 2 * W.REGIME_SYNC_EVERY]
    assert r1._policy.regime_controller.pending == regime_state.PLAIN
    # control: without the sync (each rank on its own decisions), the ranks ask at different launches
    asked, _ = ranks(shared=False)
    assert asked[0][:1] == [3] and asked[1] == []


def test_a_plain_prefill_asks_for_the_capture_sglangs_prefill_graph_replays(monkeypatch):
    """SGLang 0.5.16 captures a DFLASH-family server's prefill CUDA graph with FULL hidden capture and
    replays it only for batches asking that mode: a plain-regime prefill asks for it (its hidden rows
    dropped), so it replays the graph as base's prefill does; with no prefill graph (or SGLang's eager
    runner) it asks for none; plain decode batches never ask (the decode runner replays a FULL graph
    for a batch asking none)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    # the premise: DDTREE-GPU is of the DFLASH family, whose prefill graph SGLang captures with FULL
    assert DDTREE.is_dflash_family() and "is_dflash_family()" in inspect.getsource(PrefillCudaGraphRunner.__init__)
    # SGLang's own rule, on its class: a batch asking another mode does not replay the graph
    graph = PrefillCudaGraphRunner.__new__(PrefillCudaGraphRunner)
    graph._is_full_backend, graph.capture_hidden_mode = False, CaptureHiddenMode.FULL
    monkeypatch.setattr(PrefillCudaGraphRunner, "_has_unsupported_mha_prefix", lambda self, fb: False)
    fb = types.SimpleNamespace(input_embeds=None, replace_embeds=None, forward_mode=ForwardMode.EXTEND,
                               capture_hidden_mode=CaptureHiddenMode.NULL)
    assert PrefillCudaGraphRunner.can_run_graph(graph, fb) is False

    w = _worker()
    w._target_worker.model_runner.prefill_cuda_graph_runner = graph
    out = w.forward_batch_generation(_batch(NONE, ForwardMode.EXTEND), on_publish=None)
    _, kw, backend = w._target_worker.calls[-1]
    assert kw == {"capture_hidden_mode": CaptureHiddenMode.FULL} and backend == "backend_widest"
    assert out.logits_output.hidden_states is None
    w.forward_batch_generation(_batch(NONE, ForwardMode.DECODE), on_publish=None)
    assert w._target_worker.calls[-1][1] == {}
    # controls: no prefill graph, SGLang's eager runner, a graph captured without hidden output
    for runner in (None, EagerRunner.__new__(EagerRunner)):
        w._target_worker.model_runner.prefill_cuda_graph_runner = runner
        w.forward_batch_generation(_batch(NONE, ForwardMode.EXTEND), on_publish=None)
        assert w._target_worker.calls[-1][1] == {}, runner
    graph.capture_hidden_mode = CaptureHiddenMode.NULL
    w._target_worker.model_runner.prefill_cuda_graph_runner = graph
    w.forward_batch_generation(_batch(NONE, ForwardMode.EXTEND), on_publish=None)
    assert w._target_worker.calls[-1][1] == {}
