"""KV reservation for any budget and drafter block (issue 12 item 4): a DDTREE round may touch
max(2N, N + B) ``req_to_token`` entries past the host's committed length; the hooks make SGLang
reserve, account for and size rows by that.  Checked: the bound against a brute-force worst case;
SGLang 0.5.16's real ``DFlashDraftInputV2.prepare_for_decode`` (CPU, a recording allocator) through
the hook with a block-16 drafter at budgets 1..20; the memory-accounting and row-width hooks on real
``ServerArgs`` of a block-16 drafter config."""
import inspect
import json
import os
import random
import subprocess
import sys
import types

import pytest

pytest.importorskip("sglang.srt.speculative.dflash_info_v2")

from sglang_ddtree import reservation as R  # noqa: E402
from helpers import env_without_checkout  # noqa: E402
from sglang_ddtree.config import SETTINGS_ATTR  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bound_is_the_worst_case():
    """Worst case over lags (0..one round's commit) of the furthest entry the drafter (B slots) or
    the verify (N slots) writes, relative to the host's committed length."""
    for B in range(2, 33):
        for N in range(2, 80):
            worst = max(lag + max(B, N) for lag in range(0, min(B, N) + 1))      # = N + B
            assert R.reserve_len(N, B) >= worst
            assert R.reserve_len(N, B) == max(2 * N, worst)   # never below SGLang's own 2N
            assert 2 * R.per_decode_len(N, B) >= worst


def _sa(algo, budget, block):
    sa = types.SimpleNamespace(speculative_algorithm=algo, speculative_num_draft_tokens=budget + 1)
    setattr(sa, SETTINGS_ATTR, {"budget": budget, "block_size": block, "topk": budget, "vocab_size": 1000})
    return sa


def test_prepare_for_decode_reserves_the_block(monkeypatch):
    """The real prepare_for_decode, with alloc_for_spec_decode recorded: reserved length per request."""
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
            want = R.reserve_len(N, B) if algo.startswith("DDTREE") else 2 * N
            assert all(n - c >= want for n, c in zip(seen["nxt"], committed)), (algo, budget)
            if algo.startswith("DDTREE") and N < B:
                assert all(n - c < 2 * N + B for n, c in zip(seen["nxt"], committed))  # no more than needed + 1
            else:
                assert all(n - c == 2 * N for n, c in zip(seen["nxt"], committed))     # SGLang's own
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
    for n, v in out.items():
        assert v["width"] == n
        assert v["reserve"] >= R.reserve_len(n, 16), (n, v)
        assert v["extra"] >= R.reserve_len(n, 16) + 1, (n, v)
    assert out[33]["alloc"] == 33          # N >= B: SGLang's own value
