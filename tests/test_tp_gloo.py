"""The drafter head's vocabulary-parallel path over a real torch.distributed group (gloo, CPU).

2 and 3 spawned processes each hold one vocabulary shard of a random lm_head laid out as SGLang's
ParallelLMHead lays it out (``VocabParallelEmbedding._get_indices``: padded vocabulary / tp rows
per rank, ``num_org`` / ``org_vocab_start`` per rank, padding rows at the end of the last shards,
filled here with rows whose logit would beat every real token).  Each rank builds
``DDTreeDraftHead(tp_group=...)`` over its shard, with SGLang's own ``GroupCoordinator`` on gloo as
the group, and its top-K log-probs must equal one full-row pass (``topk_logprobs_torch`` on
``hidden @ W[:V].T``) on every rank, ids exactly.  The inputs are on a 1/8 x 1/16 grid, so every
logit is exact and the sharded and unsharded matmuls agree bit for bit (checked), and bf16
rounding makes ties across shard boundaries common.  Fresh inputs every run (seed printed,
``DDTREE_TEST_SEED`` replays it).

Power: in the same processes, mutated heads (the per-shard partial zeroed, its sum zeroed, its
vocab_start dropped, a gather that ignores the other ranks) must each disagree with the reference.

The same processes also check ``spec_algo.settings_for_worker`` across the ranks: equal settings
pass, a rank whose target vocabulary differs makes every rank raise.
"""
import os
import socket
import sys
import time
import traceback
import types

import pytest
import torch

pytest.importorskip("sglang.srt.distributed")

TIMEOUT_S = float(os.environ.get("DDTREE_TP_TEST_TIMEOUT", "420"))

# (name, vocab, hidden, K, bs, block, dtype).  Layouts (padding 64, x tp where SGLang's CPU path
# multiplies it so the padded vocabulary divides):
CASES = {
    2: [
        ("v100_pad", 100, 24, 8, 3, 5, "bfloat16"),    # 128 rows: 64 | 36 + 28 padding
        ("v128_even", 128, 16, 12, 2, 4, "float32"),  # 64 | 64, no padding, K not a power of 2
        ("v70_small_shard", 70, 16, 16, 2, 4, "bfloat16"),  # rank 1: 6 tokens < K
        ("v300_k1", 300, 16, 1, 2, 3, "bfloat16"),    # 320 rows: 160 | 140 + 20 padding; K = 1
    ],
    3: [
        ("v301_pad", 301, 24, 8, 3, 5, "bfloat16"),   # 384 rows: 128 | 128 | 45 + 83 padding
        ("v120_empty_rank", 120, 16, 5, 2, 4, "float32"),  # 192 rows: 64 | 56 + 8 | 0 + 64 padding
        ("v130_tiny_rank", 130, 16, 16, 2, 6, "bfloat16"),  # rank 2: 2 tokens < K
    ],
}
MUTANTS = ("partial_zeroed", "sum_zeroed", "vocab_start_dropped", "gather_ignores_peers")


def _layout(V, P):
    """Per-rank (rows, org_vocab_start, num_org) of SGLang's ParallelLMHead(V) under tp = P."""
    from sglang.srt.layers.vocab_parallel_embedding import (DEFAULT_VOCAB_PADDING_SIZE,
                                                            VocabParallelEmbedding, pad_vocab_size)

    pad_to = DEFAULT_VOCAB_PADDING_SIZE
    if pad_vocab_size(V, pad_to) % P:
        pad_to *= P  # what VocabParallelEmbedding does on CPU (on CUDA such a tp is refused)
    padded = pad_vocab_size(V, pad_to)
    rows = padded // P
    out = []
    for r in range(P):
        ix = VocabParallelEmbedding._get_indices(padded, padded, V, V, r, P)
        assert ix.padded_org_vocab_start_index == r * rows and ix.num_elements_padded == rows
        out.append((rows, ix.org_vocab_start_index, ix.num_org_elements))
    return padded, out


def _inputs(seed, ci, case, padded):
    """The full (padded) lm_head and the drafter hidden states, the same in every process."""
    _, V, H, K, bs, B, dtype = case
    g = torch.Generator().manual_seed(seed * 131 + ci)
    W = torch.randint(-8, 9, (padded, H), generator=g).float() / 8
    W[V:] = 0.0
    W[V:, 0] = 64.0  # padding rows: logit 64 for every row (hidden[:, 0] = 1), above any real one
    hs = torch.randint(-16, 17, (bs * B, H), generator=g).float() / 16
    hs[:, 0] = 1.0
    dt = getattr(torch, dtype)
    return W.to(dt), hs.to(dt)


def _drafted_rows(hs, B):
    H = hs.shape[-1]
    return hs.view(-1, B, H)[:, 1:, :].reshape(-1, H)


# ------------------------------------------------------------------ the rank processes
def _rank_main(rank, P, port, seed, layouts, outdir):
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton import (SGLang's, the kernels')
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    res = {}
    try:
        from sglang.srt.distributed import parallel_state as ps

        ps.init_distributed_environment(world_size=P, rank=rank, local_rank=rank, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        timeout=int(TIMEOUT_S))
        group = ps.init_model_parallel_group(
            [list(range(P))], rank, "gloo", use_pynccl=False, use_custom_allreduce=False,
            use_mscclpp_allreduce=False, use_torch_symm_mem_allreduce=False,
            group_name="ddtree_test_tp")
        assert group.world_size == P and group.rank_in_group == rank
        # GroupCoordinator.all_gather_into_tensor dispatches to SGLang's custom op
        # sglang::reg_all_gather_into_tensor, registered for CUDA tensors only; on CPU call the body
        # that op runs (_all_gather_into_tensor: pynccl when enabled, else
        # torch.distributed.all_gather_into_tensor on the group's device group, gloo here).
        group.all_gather_into_tensor = group._all_gather_into_tensor
        res["settings"] = _rank_settings_checks(rank, P, group)
        res["regime"] = _rank_regime_checks(rank, P, group)
        import sglang_ddtree.draft_head as dh
        from sglang_ddtree.kernels import topk_logprobs as tk

        res["head_file"] = dh.__file__
        for ci, case in enumerate(CASES[P]):
            padded, lay = layouts[ci]
            rows, start, num_org = lay[rank]
            W, hs = _inputs(seed, ci, case, padded)
            _, V, H, K, bs, B, _ = case
            shard = W[rank * rows:(rank + 1) * rows].contiguous()

            def run(bs_run, tp_group=group, weight=shard):
                head = dh.DDTreeDraftHead(weight=weight, block_size=B, topk=K, num_org=num_org,
                                          org_vocab_start=start, max_bs=bs, tp_group=tp_group)
                head.lp.fill_(float("nan"))
                head.ids.fill_(-7)
                head(hs[: bs_run * B])
                n = bs_run * (B - 1)
                return head.lp[:n].clone(), head.ids[:n].clone()

            out = {"shard_logits": _drafted_rows(hs, B) @ shard[:num_org].T}
            out["small"] = run(bs - 1)   # a batch below the buffers' capacity
            out["full"] = run(bs)
            real_partial = tk.topk_partial_triton
            mutated = {
                "partial_zeroed": lambda x, k, v0: tuple(t.zero_() for t in real_partial(x, k, v0)),
                "sum_zeroed": lambda x, k, v0: (lambda m, s, q: (m, s.zero_(), q))(
                    *real_partial(x, k, v0)),
                "vocab_start_dropped": lambda x, k, v0: real_partial(x, k, 0),
            }
            out["mutants"] = {}
            for name in MUTANTS:
                if name == "gather_ignores_peers":
                    local = types.SimpleNamespace(
                        world_size=P,
                        all_gather_into_tensor=lambda o, i: o.copy_(i.reshape(-1).repeat(P)))
                    out["mutants"][name] = run(bs, tp_group=local)
                    continue
                tk.topk_partial_triton = mutated[name]
                if hasattr(dh, "topk_partial_triton"):  # if the head imports it at module level
                    dh.topk_partial_triton = mutated[name]
                try:
                    out["mutants"][name] = run(bs)
                finally:
                    tk.topk_partial_triton = real_partial
                    if hasattr(dh, "topk_partial_triton"):
                        dh.topk_partial_triton = real_partial
            res[ci] = out
        torch.distributed.barrier(group=group.cpu_group)
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:  # noqa: BLE001 - reported by the parent
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)


def _rank_settings_checks(rank, P, group):
    """settings_for_worker on every rank: the launcher's settings travel on server_args."""
    from sglang_ddtree import config as C
    from sglang_ddtree.spec_algo import record_settings, settings_for_worker

    sa = types.SimpleNamespace(speculative_draft_model_path="drafter", speculative_dflash_block_size=8,
                               speculative_num_draft_tokens=17)
    launcher = C.resolve_settings(algo="DDTREE-GPU", num_draft_tokens=17, block_size=8,
                                  vocab_size=1000, env={})
    record_settings(sa, launcher, vocab_size=1000)
    out = {}
    got = settings_for_worker(sa, algo="DDTREE-GPU", vocab_size=1000, cpu_group=group.cpu_group,
                              env={})
    out["same"] = got == launcher
    try:  # the last rank's target has a vocabulary below the budget: its top-k would differ
        settings_for_worker(sa, algo="DDTREE-GPU", vocab_size=10 if rank == P - 1 else 1000,
                            cpu_group=group.cpu_group, env={})
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def _rank_regime_checks(rank, P, group):
    """regime=auto under TP: rank 0's RegimeController decides on its own clock (here a fake one that
    makes every launch 50 ms and every round no-speculation, so the first window's close asks for the
    plain regime), the other ranks follow; the launch at which each rank asks the scheduler hook for
    the switch (``regime_state.request``), shared through the real broadcast on the gloo group, and
    the same without the sharing (the control: only rank 0 asks)."""
    from sglang_ddtree import regime_state, switches
    from sglang_ddtree import worker as W
    from sglang_ddtree.policy import RoundPolicy

    switches.CURRENT = switches.Switches(regime="auto")
    W.get_tp_group = lambda: group
    out = {}
    for shared in (True, False):
        w = W.DDTreeWorker.__new__(W.DDTreeWorker)
        w.algo_name = "DDTREE-GPU"
        w.ps = types.SimpleNamespace(tp_rank=rank)
        w._verify_states = types.SimpleNamespace(states={1: None, 16: None})
        w._policy = RoundPolicy(17)
        w._start_regime()
        w._regime_shared = shared and w._regime_shared
        ctl = w._policy.regime_controller
        if rank == 0:
            clock = [0.0]
            ctl._clock = lambda: clock[0]
        asked = None
        for launch in range(1, 200):
            if rank == 0:
                clock[0] += 0.05 * (1 + 0.1 * rank)
            w._regime_launch(types.SimpleNamespace(reqs=[types.SimpleNamespace(
                rid="a", output_ids=[0] * launch, sampling_params=types.SimpleNamespace(custom_params=None))]),
                             no_spec=True)
            if regime_state.STATE.pending is not None:
                asked = launch
                break
        torch.distributed.barrier(group=group.cpu_group)
        out["shared" if shared else "alone"] = {"asked": asked, "controller": type(ctl).__name__,
                                                "sync_every": W.REGIME_SYNC_EVERY}
        regime_state.disable()
    return out


# ------------------------------------------------------------------ the test (parent)
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(P, seed, layouts, outdir):
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, P, port, seed, layouts, str(outdir)),
                         daemon=True) for r in range(P)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(2)  # let the others write their error too, then stop them
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(10)
    errs = [(outdir / f"rank{r}.err") for r in range(P)]
    msgs = [f"rank {r}:\n{e.read_text()}" for r, e in enumerate(errs) if e.exists()]
    if msgs:
        pytest.fail("\n".join(msgs)[-6000:])
    codes = [p.exitcode for p in procs]
    if codes != [0] * P:
        pytest.fail(f"rank processes did not finish in {TIMEOUT_S:.0f}s (exit codes {codes})")
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(P)]


def _matches(got, ref):
    lp, ids = got
    return torch.equal(ids, ref[1]) and torch.allclose(lp, ref[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("P", sorted(CASES))
def test_vocab_parallel_head_over_gloo(P, tmp_path, monkeypatch):
    from sglang_ddtree.kernels.topk_logprobs import topk_logprobs_torch

    seed = int(os.environ.get("DDTREE_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    print(f"DDTREE_TEST_SEED={seed}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # inherited by the spawned ranks at exec
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if os.path.isdir("/sys/class/net/lo"):
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    layouts = [_layout(case[1], P) for case in CASES[P]]
    results = _spawn(P, seed, layouts, tmp_path)
    print("head under test:", results[0]["head_file"])

    for r, res in enumerate(results):
        st = res["settings"]
        assert st["same"], (r, st)
        assert st["mismatch"] is not None and f"rank {P - 1}" in st["mismatch"], (r, st)
        assert "top-k" in st["mismatch"] and "SGLANG_DDTREE_TOPK" in st["mismatch"], st

    # regime=auto: every rank asks for rank 0's switch at the same launch, a sync point after rank 0
    # decided; alone, rank 0 asks when it decides and the others never
    shared = [res["regime"]["shared"] for res in results]
    assert shared[0]["controller"] == "RegimeController"
    assert all(x["controller"] == "FollowerRegime" for x in shared[1:])
    asks = [x["asked"] for x in shared]
    assert asks[0] is not None and asks == [asks[0]] * P and asks[0] % shared[0]["sync_every"] == 0, asks
    alone = [res["regime"]["alone"]["asked"] for res in results]
    assert alone[0] is not None and alone[0] < asks[0] and alone[1:] == [None] * (P - 1), (alone, asks)

    caught = {}
    for ci, case in enumerate(CASES[P]):
        name, V, H, K, bs, B, _ = case
        padded, lay = layouts[ci]
        assert padded > V or name == "v128_even"
        W, hs = _inputs(seed, ci, case, padded)
        logits = _drafted_rows(hs, B) @ W[:V].T          # one pass over the unsharded row
        ref = {"full": topk_logprobs_torch(logits, K),
               "small": topk_logprobs_torch(logits[: (bs - 1) * (B - 1)], K)}
        for r, res in enumerate(results):
            out = res[ci]
            _, start, num_org = lay[r]
            # the grid inputs make every logit exact: the shard's logits are the full row's columns
            assert torch.equal(out["shard_logits"], logits[:, start:start + num_org]), (name, r)
            for which in ("small", "full"):
                lp, ids = out[which]
                assert ((ids >= 0) & (ids < V)).all(), (name, r, which, "padding or bad id")
                assert torch.equal(ids, ref[which][1]), (name, r, which, ids, ref[which][1])
                torch.testing.assert_close(lp, ref[which][0], rtol=0, atol=1e-5)
                # every rank holds bit-identical results (they build the same tree)
                assert torch.equal(lp, results[0][ci][which][0]), (name, r, which)
            for mutant, got in out["mutants"].items():
                # a mutant can match by chance in one cell (K = 1 with the row's top in rank 0's
                # shard: dropping rank 1's vocab_start then changes no kept id); it must be caught
                # somewhere in the run
                caught[mutant] = caught.get(mutant, False) or not _matches(got, ref["full"])
    missed = [m for m in MUTANTS if not caught.get(m)]
    assert caught and not missed, f"mutants never caught in this run: {missed}"
