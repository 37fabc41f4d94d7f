"""KV reservation for any budget and drafter block (issue 12 item 4).

What the reservation must cover is built here from a simulation of the rounds, not from
``sglang_ddtree/reservation.py``'s formula: per request, overlap scheduling prepares round r (SGLang's
``prepare_for_decode`` reserves ``req_to_token`` entries past the host's committed length) while
round r-1 still runs, so the host's length is the device's after round r-2.  A round writes its
drafter block at ``prefix + 0..B-1`` and its verify slots at ``prefix + 0..N-1``
(``worker._forward_tree_round``: ``_prepare_dflash_draft_block_unchecked``, ``_verify``), and commits
the accepted path plus the bonus: at most ``min(B, N)`` tokens (a tree of N - 1 nodes no deeper
than the drafter's B - 1 positions).  The simulation enumerates every commit sequence of a few
rounds and records, as sets of slot indices, what each round touches and what was reserved.

Checked against that: the patched SGLang 0.5.16 functions themselves, i.e. the real
``DFlashDraftInputV2.prepare_for_decode`` (CPU, a recording allocator) through the hook at budgets
1..20 and 64 with a block-16 drafter, and the memory-accounting and row-width hooks on real
``ServerArgs`` of a block-16 drafter config."""
import inspect
import itertools
import json
import os
import random
import subprocess
import sys
import types

import pytest

pytest.importorskip("sglang.srt.speculative.dflash_info_v2")

from helpers import env_without_checkout  # noqa: E402
from sglang_ddtree.config import SETTINGS_ATTR  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _touched(prefix, N, B):
    """req_to_token entries one round writes from the device's length ``prefix``."""
    return set(range(prefix, prefix + B)) | set(range(prefix, prefix + N))


def needed_past_host(N, B, rounds=4, start=100):
    """The fewest entries past the host's committed length that cover every slot any round touches,
    over every commit sequence of ``rounds`` rounds (each round commits 1..min(B, N) tokens)."""
    worst = 0
    for commits in itertools.product(range(1, min(B, N) + 1), repeat=rounds):
        device = [start]                         # device length before each round
        for k in commits:
            device.append(device[-1] + k)
        for r in range(rounds):
            host = device[r - 1] if r >= 1 else device[0]    # the host has seen rounds up to r-2
            worst = max(worst, max(_touched(device[r], N, B)) + 1 - host)
    return worst


def test_simulated_need_on_hand_worked_shapes():
    """The simulation itself on shapes worked by hand: budget 8 with a block-16 drafter (N = 9): the
    host may lag a round that committed 9, the drafter then writes 16 from there: 25 = N + B past the
    host, where SGLang's own 2N = 18 falls 7 short; a chain-like N = B = 4: 4 + 4 = 8 = 2N."""
    assert needed_past_host(9, 16, rounds=3) == 25
    assert needed_past_host(4, 4) == 8
    assert needed_past_host(2, 16) == 18       # budget 1: commits at most 2, the drafter writes 16
    assert needed_past_host(33, 16, rounds=2) == 49


# (N, B) pairs small enough for an exhaustive simulation, both sides of N = B
SHAPES = [(N, B) for B in (2, 3, 4, 6, 8, 16) for N in range(2, 20) if min(B, N) ** 3 <= 600]


def test_reserve_len_covers_every_simulated_round_and_no_more():
    """reserve_len: every slot a simulated round touches lies inside the reservation; it is never
    below SGLang's own 2N (with N >= B nothing changes) and never above what a round can touch when
    that is more."""
    from sglang_ddtree import reservation as R

    for N, B in SHAPES:
        need = needed_past_host(N, B, rounds=3)
        got = R.reserve_len(N, B)
        assert got >= need, (N, B, got, need)
        assert got >= 2 * N, (N, B)
        if need > 2 * N:
            assert got == need, (N, B, got, need)      # N < B: exactly what a round can reach
        else:
            assert got == 2 * N, (N, B, got)           # SGLang's own value


def test_per_decode_len_is_the_smallest_double_buffer_half():
    """SGLang reserves 2 x its per-decode length (``get_alloc_reserve_per_decode``): per_decode_len is
    the smallest length whose double covers the simulated need, and never below the verify width."""
    from sglang_ddtree import reservation as R

    for N, B in SHAPES:
        need = max(2 * N, needed_past_host(N, B, rounds=3))
        L = R.per_decode_len(N, B)
        assert 2 * L >= need and 2 * (L - 1) < need and L >= N, (N, B, L, need)


def test_short_reservation_only_for_ddtree_servers_short_of_their_need():
    """The hooks act (short_reservation / ddtree_shape not None) on DDTREE servers only, and change
    SGLang's 2N only where the simulated need exceeds it."""
    from sglang_ddtree import reservation as R

    for algo in ("DDTREE-GPU", "DDTREE-CPU", "DFLASH", "EAGLE", None):
        for N, B in SHAPES:
            sa = _sa(algo, N - 1, B)
            short = needed_past_host(N, B, rounds=3) > 2 * N
            if algo and algo.startswith("DDTREE"):
                assert R.ddtree_shape(sa) == (N, B)
                assert (R.short_reservation(sa) == (N, B)) if short else R.short_reservation(sa) is None
            else:
                assert R.ddtree_shape(sa) is None and R.short_reservation(sa) is None, algo
    assert R.ddtree_shape(types.SimpleNamespace(speculative_algorithm="DDTREE-GPU")) is None  # unresolved


def _sa(algo, budget, block):
    sa = types.SimpleNamespace(speculative_algorithm=algo, speculative_num_draft_tokens=budget + 1)
    setattr(sa, SETTINGS_ATTR, {"budget": budget, "block_size": block, "topk": budget, "vocab_size": 1000})
    return sa


def test_prepare_for_decode_reserves_the_block(monkeypatch):
    """SGLang's real prepare_for_decode through the hook, alloc_for_spec_decode recorded: per request
    the entries reserved past the committed length cover the simulated need (block 16) and exceed it
    by at most the double buffer's rounding; DFLASH, and DDTREE with N >= B, keep SGLang's 2N."""
    import torch

    import sglang.srt.speculative.dflash_info_v2 as mod
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    from sglang_ddtree.patches.dflash_prepare_for_decode import prepare_for_decode_with_block_reservation

    seen = {}

    def record(tree_cache, req_to_token_pool, *, reqs, req_pool_indices, cur_kv_lens, cur_kv_lens_cpu,
               nxt_kv_lens, nxt_kv_lens_cpu, num_needed_tokens, batch=None):
        seen["nxt"] = nxt_kv_lens_cpu.tolist()
    monkeypatch.setattr(mod, "alloc_for_spec_decode", record)
    rng = random.Random()
    B = 16
    for budget in list(range(1, 21)) + [64]:
        N = budget + 1
        need = needed_past_host(N, B, rounds=2)
        for algo in ("DDTREE-GPU", "DFLASH"):
            sa = _sa(algo, budget, B)
            monkeypatch.setattr(mod, "get_server_args", lambda sa=sa: sa)
            committed = [rng.randint(1, 3000) for _ in range(5)]
            reqs = [types.SimpleNamespace(kv_committed_len=c, kv=types.SimpleNamespace(kv_allocated_len=c),
                                          sampling_params=types.SimpleNamespace(top_k=1)) for c in committed]
            batch = types.SimpleNamespace(
                reqs=reqs, batch_size=lambda r=reqs: len(r), device=torch.device("cpu"),
                token_to_kv_pool_allocator=types.SimpleNamespace(page_size=1), tree_cache=None,
                req_to_token_pool=None, req_pool_indices=torch.arange(5), seq_lens_cpu=None, seq_lens_sum=None)
            di = DFlashDraftInputV2.create_idle_input(device=torch.device("cpu"))
            prepare_for_decode_with_block_reservation(inspect.unwrap(DFlashDraftInputV2.prepare_for_decode), di, batch)
            past = [n - c for n, c in zip(seen["nxt"], committed)]
            if algo == "DDTREE-GPU" and need > 2 * N:
                assert all(need <= p <= need + 1 for p in past), (algo, budget, past, need)
            else:
                assert all(p == 2 * N for p in past), (algo, budget, past)
                assert algo == "DFLASH" or need <= 2 * N
            assert mod.get_server_args() is sa                                          # restored


BLOCK16 = r'''
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang.srt.runtime_context import get_context
import sglang.srt.mem_cache.allocation_sizing as S
import sglang.srt.mem_cache.kv_cache_configurator as K
models, drafter = sys.argv[1], sys.argv[2]
out = {}
for n in (2, 9, 17, 33):
    sa = prepare_server_args(["--model-path", f"{models}/gqa_target", "--speculative-algorithm", "DDTREE-GPU",
                              "--speculative-draft-model-path", drafter, "--device", "cuda",
                              "--speculative-num-draft-tokens", str(n)])
    get_context().set_server_args(sa)
    out[n] = {"reserve": S.get_alloc_reserve_per_decode(sa), "alloc": S.get_alloc_len_per_decode(sa),
              "extra": K.get_req_to_token_extra_context_len(sa), "width": sa.speculative_num_draft_tokens}
print("RESULT" + json.dumps(out))
'''


def test_block16_drafter_server_args_account_for_the_block(tmp_path):
    """A block-16 drafter config through SGLang's own argument handling and sizing functions (hooks
    loaded as a server loads them): the scheduler's per-request reserve covers the simulated need,
    a request holding the whole context still has its reservation inside its req_to_token row
    (``context_len + extra`` wide), and at N >= B SGLang's own per-decode length N stands."""
    models = tmp_path / "models"
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "device", "mk_models.py"), str(models),
                    "--configs-only"], check=True, capture_output=True)
    cfg = json.load(open(models / "drafter" / "config.json"))
    for key in ("block_size",):
        if key in cfg:
            cfg[key] = 16
    cfg.setdefault("dflash_config", {})["block_size"] = 16
    d16 = tmp_path / "drafter16"
    d16.mkdir()
    for f in os.listdir(models / "drafter"):
        if f != "config.json":
            os.symlink(models / "drafter" / f, d16 / f)
    json.dump(cfg, open(d16 / "config.json", "w"))
    e = env_without_checkout()
    r = subprocess.run([sys.executable, "-c", BLOCK16, str(models), str(d16)], cwd="/", env=e,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {int(k): v for k, v in json.loads(r.stdout.split("RESULT", 1)[1]).items()}
    assert sorted(out) == [2, 9, 17, 33]
    for n, v in out.items():
        need = needed_past_host(n, 16, rounds=2)
        assert v["width"] == n
        assert v["reserve"] == 2 * v["alloc"]                    # SGLang's double buffer
        assert v["reserve"] >= max(need, 2 * n), (n, v, need)
        assert v["extra"] >= v["reserve"], (n, v)                # committed == context_len still fits
    assert out[33]["alloc"] == 33 and out[17]["alloc"] == 17     # N >= B: SGLang's own value
    assert out[2]["alloc"] == 9 and out[9]["alloc"] == 13        # ceil((N + 16) / 2)
