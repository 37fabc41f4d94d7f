"""The worker's decode round with the adaptive budget, on the CPU with fake SGLang pieces around the
real round code (``DDTreeWorker._forward_tree_round``, the reference tree / mask / accept): each
round verifies on the chosen width's target state (its backend holds the mask, its runner replays),
the state is restored after, the tree is the chosen budget's (the first nodes of the wide tree),
width 1 skips the drafter, probing runs the widest width every k rounds, and under any width
schedule the output equals the fake target's greedy sequence (issue 17 item 3).

The fake target is a deterministic "language model" over a hidden token sequence ``T``: at a slot
whose path (read back from the verify mask the round wrote) spells ``T`` from the root on, its argmax
is ``T``'s next token, else a wrong one; the fake drafter proposes ``T`` at a random rank or not at
all."""
import bisect
import types

import pytest
import torch

pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")

from sglang_ddtree.policy import adaptive as A  # noqa: E402
from sglang_ddtree.policy import adaptive_config as AC  # noqa: E402
from sglang_ddtree import verify_states as VS  # noqa: E402
from sglang_ddtree.policy.round_stats import CounterfactualWindow  # noqa: E402
from sglang_ddtree import ddtree  # noqa: E402
from sglang_ddtree import worker as W  # noqa: E402
from sglang_ddtree import warmup as WU  # noqa: E402
from sglang_ddtree import plain_decode as P  # noqa: E402
from sglang_ddtree import switches as S  # noqa: E402
from sglang_ddtree.policy.budget_policy import BudgetPolicy, CostTable  # noqa: E402
from sglang_ddtree.policy import RoundPolicy  # noqa: E402
from sglang_ddtree.profiling import RoundProfiler  # noqa: E402

V, B, K, H = 64, 6, 12, 3          # vocab, drafter block (depth 5), top-k, hidden width
CTX = 400                          # req_to_token row length


class Backend:
    def __init__(self, width):
        self.width = width
        self.cuda_graph_custom_mask = torch.zeros(200_000, dtype=torch.bool)


class Runner:
    def __init__(self, width, backend):
        self.width, self.attn_backend, self.max_bs = width, backend, 64

    def can_run_graph(self, fb):
        return True


class DraftInput:
    def __init__(self, bonus):
        self.bonus_tokens, self.reserved_seq_lens_cpu, self.max_top_k = bonus, None, 1


class VerifyInput:
    """Stands in for DFlashVerifyInput: keeps the verify inputs, records the installed state."""

    def __init__(self, draft_token, positions, draft_token_num, custom_mask, capture_hidden_mode):
        self.draft_token, self.positions, self.N, self.custom_mask = draft_token, positions, draft_token_num, custom_mask

    def prepare_for_verify(self, batch, target_worker):
        mr = target_worker.model_runner
        return types.SimpleNamespace(spec=self, backend=mr.attn_backend, runner=mr.decode_cuda_graph_runner,
                                     out_cache_loc=batch.out_cache_loc), True


class World:
    """The fake model pair + bookkeeping of one test."""

    def __init__(self, rng, bs, p0):
        self.rng = rng
        self.T = torch.randint(0, V, (bs, CTX), generator=rng)
        self.bs = bs
        self.log = []            # per round: dict(N, backend width, runner width, budget, drafted)
        self.cur = None

    # the drafter's head: top-K per drafted depth, T's token at a random rank (or absent)
    def head(self, positions, bs):
        D = B - 1
        pos = positions.view(bs, B)[:, 1:]                                    # prefix + 1..D
        lp = torch.sort(torch.randn(bs, D, K, generator=self.rng).log_softmax(-1), dim=-1,
                        descending=True).values
        ids = torch.empty(bs, D, K, dtype=torch.int64)
        for b in range(bs):
            for d in range(D):
                truth = int(self.T[b, pos[b, d]])
                others = [t for t in torch.randperm(V, generator=self.rng).tolist() if t != truth][:K]
                r = int(torch.randint(0, 3 * K, (), generator=self.rng))
                if r < K:                                                    # T at rank r (often 0)
                    r = 0 if r < K // 2 else r
                    others[r] = truth
                ids[b, d] = torch.tensor(others[:K])
        return types.SimpleNamespace(lp=lp.reshape(bs * D, K), ids=ids.reshape(bs * D, K))

    def plain_target(self, fb):
        """SGLang's DECODE step of the fake target: the root token (input) at position prefix."""
        bs, r2t = self.bs, self.mr.req_to_token_pool.req_to_token
        assert fb.forward_mode == "DECODE" and fb.spec_algorithm == "NONE" and fb.spec_info is None
        assert fb.capture_hidden_mode == "FULL"
        prefix = fb.positions
        assert torch.equal(fb.seq_lens, prefix + 1)
        assert (fb.seq_lens_cpu.to(torch.int64) >= fb.seq_lens).all()       # a host upper bound
        logits = torch.zeros(bs, V)
        for b in range(bs):
            p = int(prefix[b])
            assert self.kv[r2t[b, :p]].tolist() == self.T[b, :p].tolist(), "committed K/V out of place"
            assert int(fb.input_ids[b]) == int(self.T[b, p]) and int(fb.out_cache_loc[b]) == int(r2t[b, p])
            logits[b, int(self.T[b, p + 1])] = 1.0
        self.kv[fb.out_cache_loc.view(-1)] = fb.input_ids.view(-1)
        mr = self.mr
        self.cur.update(N=1, backend=mr.attn_backend.width, runner=mr.decode_cuda_graph_runner.width,
                        mask_in=False, plain=True)
        hidden = torch.randn(bs, H, generator=self.rng)
        return types.SimpleNamespace(logits_output=types.SimpleNamespace(next_token_logits=logits,
                                                                         hidden_states=hidden),
                                     can_run_cuda_graph=True)

    def target(self, fb):
        if getattr(fb, "plain", False):
            return self.plain_target(fb)
        spec = fb.spec
        N, bs = spec.N, self.bs
        tok = spec.draft_token.view(bs, N)
        pos = spec.positions.view(bs, N)
        prefix = pos[:, 0]
        logits = torch.zeros(bs * N, V)
        # the fake KV store: every committed position's location holds T's token there (the commit
        # put the accepted slots' K/V at positions prefix + 0..a); then this verify writes its slots
        r2t = self.mr.req_to_token_pool.req_to_token
        for b in range(bs):
            p = int(prefix[b])
            assert self.kv[r2t[b, :p]].tolist() == self.T[b, :p].tolist(), "committed K/V out of place"
        self.kv[fb.out_cache_loc.view(-1)] = tok.reshape(-1)
        off = 0
        for b in range(bs):
            p = int(prefix[b])
            row_len = p + N
            for i in range(N):
                row = spec.custom_mask[off + i * row_len: off + (i + 1) * row_len]
                assert bool(row[:p].all())                                   # the prefix is visible
                anc = [j for j in range(N) if bool(row[p + j])]
                assert anc[0] == 0 and anc[-1] == i                          # root ... itself
                path = [int(tok[b, j]) for j in anc[1:]]
                ok = path == self.T[b, p + 1: p + 1 + len(path)].tolist()
                nxt = int(self.T[b, p + 1 + len(path)])
                logits[b * N + i, nxt if ok else (nxt + 1) % V] = 1.0
            off += N * row_len
        self.cur.update(N=N, backend=fb.backend.width, runner=fb.runner.width,
                        mask_in=fb.backend.cuda_graph_custom_mask.data_ptr() == spec.custom_mask.data_ptr())
        hidden = torch.randn(bs * N, H, generator=self.rng)
        return types.SimpleNamespace(logits_output=types.SimpleNamespace(next_token_logits=logits,
                                                                         hidden_states=hidden),
                                     can_run_cuda_graph=True)


def _prepare_block(*, bonus_tokens, prefix_lens, req_pool_indices, req_to_token, block_ids_out,
                   positions_out, cache_loc_out, mask_token_id):
    off = torch.arange(B)
    block_ids_out.fill_(mask_token_id)
    block_ids_out[:, 0] = bonus_tokens
    positions_out.copy_(prefix_lens.view(-1, 1) + off)
    cache_loc_out.copy_(req_to_token[req_pool_indices.view(-1, 1), prefix_lens.view(-1, 1) + off])


def _assign_locs(*, req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                 draft_token_num, device):
    off = torch.arange(draft_token_num)
    return req_to_token[req_pool_indices.view(-1, 1), start_offset.view(-1, 1) + off].reshape(-1)


def _fake_init_new(cls, batch, model_runner, *, capture_hidden_mode, return_hidden_states_before_norm):
    """SGLang's ForwardBatch.init_new for a DECODE batch, reduced to what the fake target reads: the
    scheduler batch's fields at the call (plain_decode_forward_batch sets and then restores them)."""
    return types.SimpleNamespace(
        plain=True, forward_mode=batch.forward_mode, input_ids=batch.input_ids.clone(),
        seq_lens=batch.seq_lens.clone(), positions=batch.seq_lens - 1, seq_lens_cpu=batch.seq_lens_cpu.clone(),
        seq_lens_sum=batch.seq_lens_sum, out_cache_loc=batch.out_cache_loc, spec_info=batch.spec_info,
        spec_algorithm=batch.spec_algorithm, capture_hidden_mode=capture_hidden_mode)


@pytest.fixture
def world(monkeypatch, rng):
    from sglang.srt.model_executor import forward_batch_info as FBI
    from sglang.srt.speculative import spec_info as SI

    monkeypatch.setattr(FBI.ForwardBatch, "init_new", classmethod(_fake_init_new))
    monkeypatch.setattr(FBI, "ForwardMode", types.SimpleNamespace(DECODE="DECODE"))
    monkeypatch.setattr(FBI, "CaptureHiddenMode", types.SimpleNamespace(FULL="FULL"))
    monkeypatch.setattr(SI, "SpeculativeAlgorithm", types.SimpleNamespace(NONE="NONE"))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
    monkeypatch.setattr(W, "DFlashDraftInputV2", DraftInput)
    monkeypatch.setattr(W, "DFlashVerifyInput", VerifyInput)
    monkeypatch.setattr(W, "ForwardBatch", lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setattr(W, "_prepare_dflash_draft_block_unchecked", _prepare_block)
    monkeypatch.setattr(W, "assign_extend_cache_locs_func", _assign_locs)
    monkeypatch.setattr(W, "move_accept_tokens_to_target_kvcache", lambda *a: None)
    monkeypatch.setattr(W, "make_draft_input_v2", lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setattr(W, "GenerationBatchResult", lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.delenv("SGLANG_DDTREE_PROFILE_FILE", raising=False)
    built = []
    real_build = ddtree.build_tree

    def spy_build(lp, ids, budget, **kw):
        built.append(budget)
        return real_build(lp, ids, budget, **kw)

    monkeypatch.setattr(ddtree, "build_tree", spy_build)
    return types.SimpleNamespace(rng=rng, built=built)


def make_worker(world_fx, env, bs=3, p0=5, budget=15, sw=None):
    wd = World(world_fx.rng, bs, p0)
    wd.built = world_fx.built
    home_backend = Backend(budget + 1)
    mr = types.SimpleNamespace(
        attn_backend=home_backend, decode_cuda_graph_runner=Runner(budget + 1, home_backend),
        req_to_token_pool=types.SimpleNamespace(req_to_token=torch.arange(bs * CTX).view(bs, CTX) + 1),
        model=types.SimpleNamespace(get_input_embeddings=lambda: (lambda ids: ids.float().unsqueeze(-1))),
        server_args=None)
    mr.home = (mr.attn_backend, mr.decode_cuda_graph_runner)
    tw = types.SimpleNamespace(model_runner=mr,
                               forward_batch_generation=lambda batch, forward_batch, **kw: wd.target(forward_batch))
    w = object.__new__(W.DDTreeWorker)
    drafted = []
    r2t = mr.req_to_token_pool.req_to_token

    def draft_append(*, target_hidden, cache_loc, positions, cache_loc_2d=None, commit_lens=None):
        """DFLASH's drafter K/V write: the fake store keeps each written slot's position."""
        assert target_hidden.shape[0] == cache_loc.numel() == positions.numel()
        if cache_loc_2d is None:
            wd.dkv[cache_loc.view(-1)] = positions.view(-1)
            wd.flat_appends.append(cache_loc.numel())
            return
        for b in range(cache_loc_2d.shape[0]):
            n = int(commit_lens[b])
            wd.dkv[cache_loc_2d[b, :n]] = positions.view(cache_loc_2d.shape)[b, :n]
        wd.draft_appends.append((cache_loc_2d.clone(), commit_lens.clone(), positions.clone()))

    def draft_forward(fb):
        # the drafter reads its context K/V at every committed position: all of it must be written
        # (the deferred catch-up of no-speculation rounds included) before any draft
        for b in range(bs):
            p = int(fb.seq_lens[b])
            assert wd.dkv[r2t[b, :p]].tolist() == list(range(p)), "drafter context K/V missing"
        drafted.append(1)
        wd.cur["drafted"] = True
        return types.SimpleNamespace(can_run_graph=False,
                                     logits_output=types.SimpleNamespace(hidden_states=fb.positions))

    def ensure(n):
        if w._draft_block_ids_buf is None:
            w._draft_block_ids_buf = torch.zeros(8, B, dtype=torch.int64)
            w._draft_block_positions_buf = torch.zeros(8, B, dtype=torch.int64)
            w._draft_verify_out_cache_loc_buf = torch.zeros(8, B, dtype=torch.int64)
            w._draft_seq_lens_cpu_buf = torch.zeros(8, dtype=torch.int32)

    w.__dict__.update(
        algo_name="DDTREE-GPU", tree_backend="reference", device="cpu", block_size=B, topk=K,
        budget=budget, num_verify=budget + 1, ps=types.SimpleNamespace(tp_rank=0),
        _target_worker=tw, model_runner=mr, draft_model_runner=types.SimpleNamespace(forward=draft_forward),
        _draft_block_ids_buf=None, _mask_token_id=V - 1, _draft_block_spec_info=None, _draft_sampler=None,
        _ensure_draft_block_buffers=ensure, _eager_topk=lambda hidden, n: wd.head(hidden, n),
        _append_target_hidden_to_draft_kv_by_loc=draft_append, _rounds=0,
        _own_mask_buf=None, _eager_mask_rounds=0, _kv_commit="remap",
        _prof=RoundProfiler(dict(algo="DDTREE-GPU")), _policy=RoundPolicy(budget + 1), _verify_states=None,
        _adaptive_cfg=AC.parse_config(env, budget=budget, algo="DDTREE-GPU", sw=sw))
    if w._adaptive_cfg is not None:                      # what init_cuda_graphs builds, with fakes
        states = VS.TargetStates(mr, w._adaptive_cfg.widest)
        for width in w._adaptive_cfg.extra_widths:
            be = Backend(width)
            states.add(VS.VerifyState(width, be, Runner(width, be)))
        w._verify_states = states
        w._policy.start(A.WidthController(w._adaptive_cfg, policy=None, device="cpu", window_every=2,
                                          window_lag=1))
        if w._adaptive_cfg.no_spec:       # a small buffer: full after two plain rounds, then flushed
            w._catch_up = P.DraftCatchUp(draft_append, capacity=2 * bs)
    wd.w, wd.mr, wd.drafted = w, mr, drafted
    wd.seq = torch.full((bs,), p0, dtype=torch.int64)
    wd.draft_appends, wd.flat_appends = [], []
    wd.kv = torch.full((int(r2t.max()) + 1,), -1, dtype=torch.int64)
    wd.dkv = torch.full((int(r2t.max()) + 1,), -1, dtype=torch.int64)   # drafter K/V: its position
    for b in range(bs):
        wd.kv[r2t[b, :p0]] = wd.T[b, :p0]
        wd.dkv[r2t[b, :p0]] = torch.arange(p0)                           # the prompt's, at prefill
    wd.bonus = wd.T[:, p0].clone()
    wd.out = [[] for _ in range(bs)]
    return wd


def run_round(wd):
    bs = wd.bs
    batch = types.SimpleNamespace(seq_lens=wd.seq.clone(), seq_lens_cpu=wd.seq.clone().to(torch.int32),
                                  seq_lens_sum=int(wd.seq.sum()), req_pool_indices=torch.arange(bs),
                                  spec_info=DraftInput(wd.bonus.clone()), sampling_info=None,
                                  return_logprob=False, token_to_kv_pool_allocator=None, out_cache_loc=None,
                                  input_ids=None, forward_mode="sched-DECODE", spec_algorithm="DDTREE-GPU",
                                  reqs=[types.SimpleNamespace(rid=f"r{i}", sampling_params=types.SimpleNamespace(
                                      custom_params=cp)) for i, cp in
                                      enumerate(getattr(wd, "custom_params", [None] * bs))])
    for req, lim in zip(batch.reqs, getattr(wd, "req_limits", None) or []):   # (prompt length, max_new_tokens)
        req.origin_input_ids, req.sampling_params.max_new_tokens = [0] * lim[0], lim[1]
    wd.cur = dict(drafted=False)
    n_built, n_appends = len(wd.built), len(wd.draft_appends)
    seq_lens_before = batch.seq_lens
    res = wd.w._forward_tree_round(batch, None)
    # the verified tree is the round's first build (a prediction round builds the widest one after it)
    wd.cur["budget"] = wd.built[n_built] if len(wd.built) > n_built else None
    assert (wd.mr.attn_backend, wd.mr.decode_cuda_graph_runner) == wd.mr.home   # restored
    assert (batch.forward_mode, batch.spec_algorithm, batch.input_ids) == ("sched-DECODE", "DDTREE-GPU", None)
    assert batch.seq_lens is seq_lens_before                                     # the batch is restored
    toks = res.next_token_ids.view(bs, -1)
    for b in range(bs):
        n = int(res.accept_lens[b])
        wd.out[b] += toks[b, :n].tolist()
    r2t = wd.mr.req_to_token_pool.req_to_token
    if wd.cur.get("plain"):                              # no speculation: the drafter's K/V waits
        assert len(wd.draft_appends) == n_appends
    else:
        assert len(wd.draft_appends) == n_appends + 1
        loc2d, commit, pos = wd.draft_appends[-1]
        for b in range(bs):
            n = int(commit[b])
            p = int(wd.seq[b])
            assert loc2d[b, :n].tolist() == r2t[b, p:p + n].tolist()      # the drafter's context K/V slots
            assert pos.view(bs, -1)[b, :n].tolist() == list(range(p, p + n))
    wd.seq = res.new_seq_lens.clone()
    wd.bonus = res.next_draft_input.bonus_tokens.clone()
    wd.log.append(dict(wd.cur, commit=res.accept_lens.clone()))
    return wd.cur


def assert_lossless(wd, p0=5):
    for b in range(wd.bs):
        n = len(wd.out[b])
        assert n > 0 and wd.out[b] == wd.T[b, p0 + 1: p0 + 1 + n].tolist()


def test_fixed_budget_switch_runs_the_servers_budget(world):
    wd = make_worker(world, {"SGLANG_DDTREE_ADAPTIVE": "0"})
    assert wd.w._policy.controller is None
    for _ in range(6):
        r = run_round(wd)
        assert r["N"] == 16 and r["budget"] == 15 and r["drafted"] and r["backend"] == 16 and r["mask_in"]
    assert_lossless(wd)
    assert sum(len(o) for o in wd.out) > 6 * wd.bs                  # the drafter got tokens accepted


def test_forced_cycle_installs_each_width_and_stays_lossless(world):
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,7,15"}
    wd = make_worker(world, env, sw=S.Switches(budget_cycle=(15, 3, 0, 7, 0, 15, 7, 3)))
    cycle = [15, 3, 0, 7, 0, 15, 7, 3] * 2
    for b in cycle:
        r = run_round(wd)
        N = b + 1
        assert r["N"] == N and r["backend"] == N and r["runner"] == N
        if b == 0:   # SGLang's decode step on the plain state: no drafter, no tree, no mask
            assert r["plain"] and not r["mask_in"] and not r["drafted"] and r["budget"] is None
            assert (wd.log[-1]["commit"] == 1).all()                      # one token per request
        else:
            assert r["mask_in"] and r["drafted"] and r["budget"] == b
    assert_lossless(wd)
    # each tree width's mask buffer was written; the plain state's never
    for width in (4, 8, 16):
        assert wd.w._verify_states.states[width].attn_backend.cuda_graph_custom_mask.any()
    assert not wd.w._verify_states.states[1].attn_backend.cuda_graph_custom_mask.any()
    # the plain rounds' drafter K/V was written later, batched: one flush per plain stretch
    assert wd.flat_appends == [wd.bs, wd.bs, wd.bs, wd.bs] and wd.w._catch_up.rows == 0


def test_policy_no_spec_and_a_probe_once_its_credit_is_there(world):
    """A table that makes no-speculation the best choice: after the first window of counts the policy
    answers NO_SPEC; the widest-width probe (79 ms more than a 1 ms plain step) waits for its credit
    (5 % of each round's cost), then runs once (every 4th round at most)."""
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,15"}
    wd = make_worker(world, env, sw=S.Switches(probe_every=4))
    table = CostTable(verify_ms={4: {1: 50.0, 8: 60.0}, 16: {1: 80.0, 8: 90.0}}, base_ms={1: 1.0, 8: 1.2})
    ctl = wd.w._policy.controller
    ctl.policy, ctl._clock = BudgetPolicy(table, allow_no_spec=True), (lambda: 0.0)
    ctl.PROBE_OPTIMISM = 1e9          # the widest worth a probe (as shipped it could not win here)
    widths = [run_round(wd)["N"] for _ in range(14)]
    # rounds 0-2: no counts yet -> the widest (80 <= 2 x 50); window of rounds 0-1 arrives at round 3
    assert widths[:3] == [16, 16, 16] and widths[3:] == [1] * 11 and ctl.probes == 0
    assert 0 < ctl.probe_credit < 1.0
    ctl.probe_credit = 1e9                       # as after ~1600 plain rounds (capped at one probe)
    more = [run_round(wd)["N"] for _ in range(9)]
    assert more.count(16) == 1 and set(more) == {1, 16} and ctl.probes == 1, more
    assert ctl.policy.rounds_seen >= 1 and ctl.chosen[1] >= 18
    assert_lossless(wd)


def test_policy_switches_widths_and_learns_from_wide_rounds(world):
    """Costs that favour the narrow tree: the first rounds and the policy run width 4 (the widest costs
    over twice as much); the acceptance of width 16 arrives with its probe."""
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,15"}
    wd = make_worker(world, env, sw=S.Switches(probe_every=3))
    table = CostTable(verify_ms={4: {1: 1.0}, 16: {1: 100.0}}, base_ms={1: 1.0})
    pol = BudgetPolicy(table, allow_no_spec=False, hysteresis=0.0)
    ctl = wd.w._policy.controller
    ctl.policy, ctl._clock = pol, (lambda: 0.0)
    ctl.PROBE_OPTIMISM = 1e9          # the widest worth a probe (as shipped it could not win here)
    widths = [run_round(wd)["N"] for _ in range(12)]
    assert widths == [4] * 12 and pol.seen == {4}
    ctl.probe_credit = 1e9
    widths = [run_round(wd)["N"] for _ in range(12)]
    assert widths.count(16) == 1 and set(widths) == {4, 16}
    for _ in range(6):
        run_round(wd)
    assert pol.seen == {4, 16}
    assert_lossless(wd)


def test_no_spec_stretch_probes_with_the_drafter_alone(world):
    """No speculation is the choice and the table knows the drafter's cost: the probe is draft-only
    (the drafter's K/V owed by the plain rounds written first, the drafter block, the widest tree, a
    plain decode step: one token per request), never a widest-width verify; its predictions reach the
    policy, whose estimate then covers every width."""
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,15"}
    wd = make_worker(world, env, sw=S.Switches(probe_every=4))
    table = CostTable(verify_ms={4: {1: 50.0, 8: 60.0}, 16: {1: 80.0, 8: 90.0}}, base_ms={1: 1.0, 8: 1.2},
                      draft_ms={1: 0.5, 8: 0.6})
    ctl = wd.w._policy.controller
    ctl.policy, ctl._clock = BudgetPolicy(table, allow_no_spec=True), (lambda: 0.0)
    for _ in range(6):
        run_round(wd)
    assert wd.log[-1]["N"] == 1 and ctl.draft_probes == 0
    ctl.draft_credit = 1e9
    probe_at = None
    for i in range(8):
        n_built = len(wd.built)
        r = run_round(wd)
        assert r["N"] == 1 and r["plain"] and (wd.log[-1]["commit"] == 1).all()
        if r["drafted"]:
            assert probe_at is None and wd.built[n_built:] == [15]      # the widest tree, no verify
            probe_at = i
    assert probe_at is not None and ctl.draft_probes == 1 and ctl.probes == 0
    for _ in range(3):
        run_round(wd)
    pol = ctl.policy
    assert sum(pol.pred_n) > 0 and set(pol.ratio) == {4, 16}
    assert_lossless(wd)


def test_narrow_rounds_predict_every_width_on_their_cadence(world):
    """Width 4 is the choice: every PREDICT_EVERY-th round also builds the widest tree (budget 15)
    for the estimate, and verifies the narrow one; the policy's calibration pairs come from them."""
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,15"}
    wd = make_worker(world, env, sw=S.Switches(probe_every=1000))
    table = CostTable(verify_ms={4: {1: 1.0}, 16: {1: 100.0}}, base_ms={1: 1.0})
    pol = BudgetPolicy(table, allow_no_spec=False, hysteresis=0.0)
    ctl = wd.w._policy.controller
    ctl.policy, ctl._clock = pol, (lambda: 0.0)
    per_round = []
    for _ in range(12):
        n_built = len(wd.built)
        r = run_round(wd)
        assert r["N"] == 4 and r["budget"] == 3
        per_round.append(wd.built[n_built:])
    assert [b for b in per_round] == [[3, 15] if i % A.PREDICT_EVERY == 0 else [3] for i in range(12)]
    assert pol.cal_n[4] > 0 and pol.cal_n[16] == 0 and sum(pol.pred_n) > 0
    assert pol.ratio[16] == pytest.approx(pol.ratio[4])
    assert_lossless(wd)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fake world is on the CPU: its Triton path needs "
                    "the interpreter (on a GPU host the kernel's own tests run on CUDA)")
def test_rounds_commit_through_the_triton_kernel_losslessly(world, monkeypatch):
    """The round with every kernel on the Triton path (the interpreter on the CPU), the fused commit
    included: the fake target checks each committed position's K/V location before every verify and
    run_round the drafter's slots and positions; widths 16, 4 and 1 (no speculation) in a cycle."""
    from sglang_ddtree.kernels import commit_round as CR

    launched = []
    real = CR.commit_round_triton
    monkeypatch.setattr(CR, "commit_round_triton", lambda *a, **kw: launched.append(kw["out"][4] is not None)
                        or real(*a, **kw))
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,15"}
    wd = make_worker(world, env, sw=S.Switches(budget_cycle=(15, 3, 0, 15, 0, 3)))
    wd.w.tree_backend = "triton"
    plain_head = wd.w._eager_topk

    def head(positions, bs):
        """The fake drafter with T's token always at rank 0 (flat log-probs: siblings take the low
        slots first, so an accepted path of depth >= 2 is not slots 0, 1, 2, ...)."""
        h = plain_head(positions, bs)
        ids = h.ids.view(bs, B - 1, K)
        truth = wd.T.gather(1, positions.view(bs, B)[:, 1:])
        ids.masked_fill_(ids == truth.unsqueeze(-1), (V - 2))
        ids[..., 0] = truth
        return h
    wd.w._eager_topk = head
    widths = [run_round(wd)["N"] for _ in range(6)]
    assert widths == [16, 4, 1, 16, 1, 4]
    assert launched == [N > 1 for N in widths]          # one launch a round; drafter slots for N > 1
    assert_lossless(wd)
    assert all(int(c.max()) >= 3 for c, N in zip((r["commit"] for r in wd.log), widths) if N == 16)


def test_warm_batch_sizes_reach_every_bucket_and_specialisation():
    assert WU.warm_batch_sizes(1) == [1]
    assert WU.warm_batch_sizes(64) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 48, 64]
    s = WU.warm_batch_sizes(48)
    assert max(s) == 48 and 33 in s and 32 in s and 64 not in s
    def key(b):   # what a Triton specialisation can see of a batch size
        return (1 << (b - 1).bit_length(), b == 1, b % 16 == 0)
    for top in (1, 7, 48, 64, 100):
        warm = WU.warm_batch_sizes(top)
        assert max(warm) == top and min(warm) == 1
        for bs in range(1, top + 1):
            assert any(key(b) == key(bs) for b in warm), (top, bs)


def test_warm_round_kernels_runs_each_width_and_bucket(monkeypatch):
    calls = {"build": [], "mask": [], "accept": [], "commit": [], "assign": []}
    real = {n: getattr(ddtree, f) for n, f in (("build", "build_tree"), ("mask", "verify_mask"),
                                                ("accept", "accept_greedy"), ("commit", "commit_round"))}

    def spy(name):
        def f(*a, **kw):
            out = real[name](*a, **kw)
            if name == "build":
                calls[name].append(a[0].shape[0])
            elif name == "commit":   # (N, bs, remap, block_loc width, req_to_token row shape / dtype)
                calls[name].append((a[0].tokens.shape[1], a[0].tokens.shape[0], kw["remap"],
                                    None if out.block_loc is None else out.block_loc.shape[1],
                                    tuple(a[4].shape), a[4].dtype))
            else:
                calls[name].append(a[0].tokens.shape)
            return out
        return f
    for name, fn in (("build", "build_tree"), ("mask", "verify_mask"), ("accept", "accept_greedy"),
                     ("commit", "commit_round")):
        monkeypatch.setattr(ddtree, fn, spy(name))
    r2t = torch.zeros(3, 40, dtype=torch.int32)

    def assign(**kw):
        calls["assign"].append((kw["batch_size"], kw["req_to_token"].shape, kw["req_to_token"].dtype))
        return torch.zeros(kw["batch_size"], dtype=torch.int64)
    info = WU.warm_round_kernels(widths=(1, 8, 16), block_size=6, topk=5, vocab_size=50, max_bs=8,
                                tree_backend="reference", full_mask=True, device="cpu",
                                req_to_token=r2t, assign_locs=assign)
    sizes = WU.warm_batch_sizes(8)
    assert info["widths"] == [1, 8, 16] and info["batch_sizes"] == sizes
    assert len(calls["build"]) == len(calls["mask"]) == 2 * len(sizes)
    # tree widths only: a no-speculation round has no accept kernel (ddtree.root_only_accept)
    assert sorted(calls["accept"]) == sorted(torch.Size([b, N]) for N in (8, 16) for b in sizes)
    # the commit as the round calls it: every width and bucket, the drafter's slots for N > 1 (remap)
    assert sorted(calls["commit"]) == sorted((N, b, True, 6 if N > 1 else None, (1, 40), torch.int32)
                                             for N in (1, 8, 16) for b in sizes)
    assert [c[0] for c in calls["assign"]] == sizes
    assert all(c[1] == (1, 40) and c[2] == torch.int32 for c in calls["assign"])   # the real row length
    calls["commit"].clear()
    WU.warm_round_kernels(widths=(8,), block_size=6, topk=5, vocab_size=50, max_bs=2, tree_backend="reference",
                         full_mask=False, device="cpu", kv_commit="move")
    assert len(calls["mask"]) == 2 * len(sizes)   # our verify attention: no FULL mask to warm
    assert {c[2:4] for c in calls["commit"]} == {(False, None)}   # move: no remap, no drafter slots
    # tree widths only up to their CUDA graphs' largest batch (tree_max_bs), no speculation up to max_bs
    for k in calls:
        calls[k].clear()
    info = WU.warm_round_kernels(widths=(1, 8), block_size=6, topk=5, vocab_size=50, max_bs=40,
                                tree_backend="reference", full_mask=True, device="cpu", req_to_token=r2t,
                                assign_locs=assign, tree_max_bs=8)
    assert info["batch_sizes"] == WU.warm_batch_sizes(40) and info["tree_batch_sizes"] == sizes
    assert sorted(calls["build"]) == sorted(sizes) and [c[0] for c in calls["assign"]] == sizes
    assert sorted(b for N, b, *_ in calls["commit"] if N == 1) == WU.warm_batch_sizes(40)
    assert max(b for N, b, *_ in calls["commit"] if N == 8) == 8


def test_warm_round_kernels_launch_the_triton_kernels(device):
    """The warm-up's own inputs run through the Triton path (the interpreter on the CPU)."""
    info = WU.warm_round_kernels(widths=(1, 4), block_size=4, topk=3, vocab_size=20, max_bs=2,
                                tree_backend="triton", full_mask=True, device=device,
                                req_to_token=torch.zeros(2, 24, dtype=torch.int32, device=device))
    assert info["widths"] == [1, 4] and info["batch_sizes"] == [1, 2]


def test_worker_interrupts_the_width_controller_on_every_batch_but_a_decode_round(monkeypatch):
    """Prefill, mixed extend and idle batches call ``interrupt`` (their time is no round's overhead);
    a decode round does not."""
    seen = []
    w = object.__new__(W.DDTreeWorker)
    w.__dict__.update(_policy=types.SimpleNamespace(interrupt=lambda: seen.append("interrupt")))
    monkeypatch.setattr(W.DDTreeWorker, "_prefill", lambda self, b, p: seen.append("prefill"))
    monkeypatch.setattr(W.DDTreeWorker, "_forward_tree_round", lambda self, b, p: seen.append("round"))
    monkeypatch.setattr(W, "_SYNC_CHECK_FILE", None)
    monkeypatch.setattr(W.DFlashWorkerV2, "forward_batch_generation",
                        lambda self, b, on_publish=None: seen.append("idle"))

    def batch(extend=False, mixed=False, idle=False):
        return types.SimpleNamespace(
            forward_mode=types.SimpleNamespace(is_extend=lambda: extend, is_idle=lambda: idle),
            is_extend_in_batch=mixed, return_logprob=False)

    for b, want in ((batch(), ["round"]), (batch(extend=True), ["interrupt", "prefill"]),
                    (batch(mixed=True), ["interrupt", "prefill"]), (batch(idle=True), ["interrupt", "idle"]),
                    (batch(), ["round"])):
        seen.clear()
        w.forward_batch_generation(b)
        assert seen == want, (seen, want)


def test_prefill_matches_dflash_extend_branch_without_a_blocking_copy(monkeypatch):
    """DDTreeWorker._prefill == DFlashWorkerV2.forward_batch_generation's extend branch (SGLang
    0.5.16) call for call, on fakes: same target call, same drafter K/V append (positions, slots,
    hidden), same next draft input; the length vectors come from tree_ops.host_to_device (int32)."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    made = []
    real_h2d = W.host_to_device
    monkeypatch.setattr(W, "host_to_device", lambda v, d: made.append(list(v)) or real_h2d(v, d))

    def make(cls):
        calls = []
        hidden = torch.randn(9, 4)
        tw = types.SimpleNamespace(
            model_runner=None,
            forward_batch_generation=lambda batch, **kw: calls.append(("target", kw)) or types.SimpleNamespace(
                logits_output=types.SimpleNamespace(hidden_states=hidden), next_token_ids=torch.tensor([5, 7])))
        w = object.__new__(cls)
        w.__dict__.update(
            _target_worker=tw, algo_name="DDTREE-GPU", ps=types.SimpleNamespace(tp_rank=0),
            model_runner=types.SimpleNamespace(server_args=types.SimpleNamespace(attention_backend="torch_native")),
            _append_target_hidden_to_draft_kv_by_loc=lambda **kw: calls.append(("append", kw)),
            _warned_sampling_fallback=True, _policy=RoundPolicy(1))
        return w, calls, hidden

    batch = types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(is_extend=lambda: True, is_idle=lambda: False), is_extend_in_batch=True,
        return_logprob=False, sampling_info=None, extend_lens=[4, 5], prefix_lens=[3, 0],
        seq_lens=torch.tensor([7, 5]), out_cache_loc=torch.arange(100, 109))
    published = []
    ours, ours_calls, h1 = make(W.DDTreeWorker)
    theirs, their_calls, h2 = make(DFlashWorkerV2)
    r1 = ours.forward_batch_generation(batch, on_publish=published.append)
    r2 = DFlashWorkerV2.forward_batch_generation(theirs, batch, on_publish=published.append)
    assert made == [[4, 5], [3, 0]]
    assert [c[0] for c in ours_calls] == [c[0] for c in their_calls] == ["target", "append"]
    assert ours_calls[0][1] == their_calls[0][1]
    a1, a2 = ours_calls[1][1], their_calls[1][1]
    assert set(a1) == set(a2) and torch.equal(a1["positions"], a2["positions"])
    assert a1["positions"].tolist() == [3, 4, 5, 6, 0, 1, 2, 3, 4]
    assert torch.equal(a1["cache_loc"], a2["cache_loc"]) and a1["target_hidden"] is h1 and a2["target_hidden"] is h2
    assert r1.logits_output.hidden_states is None and r2.logits_output.hidden_states is None
    assert torch.equal(r1.next_draft_input.bonus_tokens, r2.next_draft_input.bonus_tokens)
    assert torch.equal(r1.new_seq_lens, batch.seq_lens) and len(published) == 2
    assert W.host_to_device is not real_h2d and real_h2d([1, 2], "cpu").dtype == torch.int32


def test_policy_snapshot_reaches_the_profiler_whichever_is_built_first(monkeypatch, tmp_path):
    """SGLang builds the CUDA graphs (and with them the width controller) after the worker's
    __init__ made its profiler: the snapshot must be attached in either order (it was not, on the
    H200: records without "adaptive")."""
    from sglang_ddtree import profiling
    monkeypatch.setenv(profiling.ENV_FILE, str(tmp_path / "p.jsonl"))
    ctl = types.SimpleNamespace(snapshot=lambda: {"lag": 1})
    for order in (("profiler", "controller"), ("controller", "profiler")):
        pol, prof = RoundPolicy(8), RoundProfiler({"algo": "DDTREE-GPU"})
        for name in order:
            pol.report_to(profiler=prof) if name == "profiler" else pol.start(ctl)
        assert prof.extra is ctl.snapshot
    monkeypatch.delenv(profiling.ENV_FILE)
    pol, prof = RoundPolicy(8), RoundProfiler({"algo": "DDTREE-GPU"})
    pol.start(ctl)
    pol.report_to(profiler=prof)
    assert prof.extra is None          # profiling off: nothing attached


def test_requests_pin_the_budget_narrowest_wins_and_stays_lossless(world):
    """custom_params["ddtree_budget"]: the round runs the narrowest budget its requests pin (0 = no
    speculation), whatever the policy would choose; requests without it do not constrain."""
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,7,15"}
    wd = make_worker(world, env)
    assert wd.bs >= 2
    key = AC.REQUEST_BUDGET_KEY
    plans = [([{key: 7}] + [None] * (wd.bs - 1), 8), ([{key: 15}] + [{key: 3}] * (wd.bs - 1), 4),
             ([{key: 0, "other": 1}] + [{"other": 2}] * (wd.bs - 1), 1), ([{key: 15}] * wd.bs, 16)]
    for cps, want in plans * 2:
        wd.custom_params = cps
        r = run_round(wd)
        assert r["N"] == want and r["backend"] == want
        if want == 1:
            assert not r["drafted"] and (wd.log[-1]["commit"] == 1).all()
        else:
            assert r["drafted"] and r["budget"] == want - 1
    assert_lossless(wd)
    assert wd.w._policy.controller.chosen == {8: 2, 4: 2, 1: 2, 16: 2}


def test_request_rounds_past_max_new_tokens_are_not_counted(world):
    """Under overlap scheduling a request that reached max_new_tokens still runs the next round; the
    counterfactual window must not count it, and a request's last round counts only what it keeps.
    Request 0 (prompt 5, max_new_tokens 1) has emitted its only token at prefill: never counted;
    request 1 (max_new_tokens 4) counts min(accepted, tokens left - 1) until it has 4; request 2
    (no limit) counts every round.  Each counts in the age bucket of its output so far (seq_lens -
    prompt + 1 before the round; the default edges)."""
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,15"}
    wd = make_worker(world, env)
    wd.req_limits = [(5, 1), (5, 4), (5, None)]
    ctl = wd.w._policy.controller
    edges = ctl.cfg.age_edges
    assert edges == AC.DEFAULT_AGE_EDGES
    ctl.window = CounterfactualWindow(ctl.window.budgets, device="cpu", every=1, lag=0, age_edges=edges)
    got, due = [], ctl.window.due
    ctl.window.due = lambda: [got.append(x) or x for x in due()]
    seq_before = []
    for _ in range(8):
        seq_before.append(wd.seq.clone())
        run_round(wd)
    ctl.window.due()
    assert len(got) == 8
    for (sums, counts, below, _pred), seq, log in zip(got, seq_before, wd.log):
        acc = (log["commit"] - 1).tolist()                          # accepted per request (width 16)
        left = [5 + 1 - int(seq[0]) - 1, 5 + 4 - int(seq[1]) - 1]   # tokens each may still emit
        want = [0, min(acc[1], max(left[1] - 1, 0)) if left[1] > 0 else 0, acc[2]]
        live = [False, left[1] > 0, True]
        bucket = [bisect.bisect_right(edges, int(seq[i]) - 5 + 1) for i in range(3)]
        for k in range(len(edges) + 1):
            mine = [i for i in range(3) if live[i] and bucket[i] == k]
            assert counts[k][1] == len(mine) and sums[k][1] == sum(want[i] for i in mine), (k, sums, counts)
    assert bisect.bisect_right(edges, int(seq_before[-1][2]) - 4) > 1    # request 2 crossed buckets
    assert_lossless(wd)
