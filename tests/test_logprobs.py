"""Log-probabilities of a DDTree round's committed tokens (sglang_ddtree/logprobs.py) and the hook
that admits such requests (patches/validate_dflash_request.py), on the CPU with SGLang 0.5.16's
own spec-v2 routine and result processor.  Random rounds drawn fresh each run; the reference is a
plain log_softmax of the parent node's logits row."""
import os
import types

import pytest
import torch

pytest.importorskip("sglang")

from sglang_ddtree import logprobs as LP  # noqa: E402
from sglang_ddtree.patches import validate_dflash_request as VH  # noqa: E402


def _round(gen, bs, N, W, V):
    """Random verify logits, accepted paths (root first, distinct slots, -1 padded) and tokens."""
    logits = torch.randn(bs * N, V, generator=gen) * 3
    path = torch.full((bs, W), -1, dtype=torch.int32)
    tokens = torch.full((bs, W), -1, dtype=torch.int64)
    alen = torch.randint(0, W, (bs,), generator=gen)
    for b in range(bs):
        slots = [0] + (torch.randperm(N - 1, generator=gen)[: int(alen[b])] + 1).tolist()
        path[b, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        tokens[b, : len(slots)] = torch.randint(0, V, (len(slots),), generator=gen)
    return logits, path, tokens, alen


def _batch(bs, greedy, temps, top, ids=None):
    si = types.SimpleNamespace(is_all_greedy=greedy, temperatures=temps)
    return types.SimpleNamespace(seq_lens=torch.zeros(bs, dtype=torch.int64), sampling_info=si,
                                 top_logprobs_nums=top, token_ids_logprobs=ids)


@pytest.mark.parametrize("greedy", [True, False])
def test_round_logprobs_are_the_parent_rows_log_softmax(greedy):
    gen = torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    bs, N, W, V = 5, 9, 6, 50
    logits, path, tokens, alen = _round(gen, bs, N, W, V)
    temps = (0.3 + torch.rand(bs, 1, generator=gen)) if not greedy else torch.ones(bs, 1)
    top = [0, 3, 1, 5, 2]
    ids = [None, [1, 7], None, None, [0]]
    out = types.SimpleNamespace(next_token_logits=logits.clone(), next_token_logprobs=None,
                                next_token_top_logprobs_val=None, next_token_top_logprobs_idx=None,
                                next_token_token_ids_logprobs_val=None, next_token_token_ids_logprobs_idx=None)
    LP.fill_round_logprobs(_batch(bs, greedy, temps, top, ids), out, path, tokens, N)
    assert torch.equal(out.next_token_logits, logits)           # the accept's logits untouched
    assert out.next_token_logprobs.shape == (bs, W)
    for b in range(bs):
        for j in range(int(alen[b]) + 1):
            row = logits[b * N + int(path[b, j])]
            lp = torch.log_softmax(row / (1.0 if greedy else float(temps[b])), -1)
            tok = int(tokens[b, j])
            assert abs(float(out.next_token_logprobs[b, j]) - float(lp[tok])) < 1e-5
            flat = b * W + j
            if top[b]:
                v, i = lp.topk(top[b])
                assert torch.allclose(torch.as_tensor(out.next_token_top_logprobs_val[flat]), v, atol=1e-5)
                assert torch.equal(torch.as_tensor(out.next_token_top_logprobs_idx[flat]), i)
            if ids[b] is not None:
                got = torch.as_tensor(out.next_token_token_ids_logprobs_val[flat])
                assert torch.allclose(got, lp[ids[b]], atol=1e-5)


def test_sglang_result_processor_reads_them_per_request():
    """SGLang's spec-v2 decode output path (_apply_decode_logprobs) takes request i's j-th token
    from row i of next_token_logprobs and the top-n list at i * W + j."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    gen = torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    bs, N, W, V = 3, 7, 5, 40
    logits, path, tokens, alen = _round(gen, bs, N, W, V)
    out = types.SimpleNamespace(next_token_logits=logits, next_token_logprobs=None,
                                next_token_top_logprobs_val=None, next_token_top_logprobs_idx=None,
                                next_token_token_ids_logprobs_val=None, next_token_token_ids_logprobs_idx=None)
    LP.fill_round_logprobs(_batch(bs, True, None, [2, 2, 2]), out, path, tokens, N)
    # what _normalize_decode_outputs does before the per-request loop
    lps = out.next_token_logprobs.tolist()
    out.next_token_top_logprobs_val = [v.tolist() for v in out.next_token_top_logprobs_val]
    out.next_token_top_logprobs_idx = [x.tolist() for x in out.next_token_top_logprobs_idx]
    batch = types.SimpleNamespace(spec_algorithm=types.SimpleNamespace(is_none=lambda: False))
    for i in range(bs):
        n = int(alen[i]) + 1
        lg = types.SimpleNamespace(output_token_logprobs_val=[], output_token_logprobs_idx=[],
                                   output_top_logprobs_val=[], output_top_logprobs_idx=[],
                                   top_logprobs_num=2, token_ids_logprob=None)
        req = types.SimpleNamespace(logprob=lg)
        SchedulerBatchResultProcessor._apply_decode_logprobs(None, req=req, i=i, batch=batch,
                                                    next_token_id=tokens[i, :n].tolist(),
                                                    next_token_logprobs=lps, logits_output=out)
        assert lg.output_token_logprobs_idx == tokens[i, :n].tolist()
        for j in range(n):
            lp = torch.log_softmax(logits[i * N + int(path[i, j])], -1)
            assert abs(lg.output_token_logprobs_val[j] - float(lp[tokens[i, j]])) < 1e-5
            assert lg.output_top_logprobs_idx[j] == lp.topk(2).indices.tolist()


def test_prefill_sees_the_flag_only_inside_the_target_forward():
    seen = []

    class Target:
        model_runner = "runner"

        def forward_batch_generation(self, batch, **kw):
            seen.append(("target", batch.return_logprob, kw))
            return "out"

    class DFlashLike:  # DFlashWorkerV2's shape: refuses the flag first, then calls the target
        def __init__(self):
            self._target_worker = Target()

        @property
        def target_worker(self):
            return self._target_worker

        def forward(self, batch):
            if batch.return_logprob:
                raise ValueError("DFLASH speculative decoding does not support return_logprob yet.")
            seen.append(("runner", self.target_worker.model_runner))
            return self.target_worker.forward_batch_generation(batch, capture_hidden_mode="FULL")

    w, batch = DFlashLike(), types.SimpleNamespace(return_logprob=True)
    real = w._target_worker
    with LP.prefill_with_logprobs(w, batch):
        assert w.forward(batch) == "out"
    assert seen == [("runner", "runner"), ("target", True, {"capture_hidden_mode": "FULL"})]
    assert w._target_worker is real and batch.return_logprob is True
    with pytest.raises(RuntimeError):
        with LP.prefill_with_logprobs(w, batch):
            raise RuntimeError("boom")
    assert w._target_worker is real and batch.return_logprob is True


def _req(**kw):
    sp = types.SimpleNamespace(json_schema=None, regex=None, ebnf=None, structural_tag=None)
    return types.SimpleNamespace(return_logprob=True, return_hidden_states=False, sampling_params=sp, **kw)


@pytest.mark.parametrize("algo,env,admitted", [
    ("DDTREE-GPU", "1", True), ("DDTREE-CPU", "1", True), ("DDTREE-GPU", "0", False),
    ("DDTREE-GPU", None, True), ("DDTREE-CPU", "off", False), ("DFLASH", None, False),
    ("DFLASH", "1", False), (None, "1", False),
])
def test_admission_hook(monkeypatch, algo, env, admitted):
    """On by default for DDTREE servers (GPU-checked: bench/results/logprobs_h200.md); 0/off turns it off."""
    from sglang.srt import runtime_context
    from sglang.srt.speculative.dflash_utils import validate_dflash_request
    if env is None:
        monkeypatch.delenv(LP.ENV, raising=False)
    else:
        monkeypatch.setenv(LP.ENV, env)
    monkeypatch.setattr(runtime_context, "get_server_args",
                        lambda: types.SimpleNamespace(speculative_algorithm=algo))
    req = _req()
    msg = VH.validate_with_logprobs(validate_dflash_request, req, False)
    assert (msg is None) == admitted, msg
    assert req.return_logprob is True
    if not admitted:
        assert "return_logprob" in msg
        return
    # the other refusals still apply to admitted log-probability requests
    bad = _req()
    bad.sampling_params.regex = "a+"
    assert "grammar" in VH.validate_with_logprobs(validate_dflash_request, bad, False)
    assert bad.return_logprob is True


def test_the_hook_wraps_the_schedulers_name_after_load_plugins():
    import subprocess
    import sys
    from helpers import env_without_checkout
    code = (
        "import types\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "import sglang.srt.managers.scheduler as S\n"
        "from sglang.srt import runtime_context\n"
        f"assert {VH.TARGET!r} in HookRegistry._patched, sorted(HookRegistry._patched)\n"
        "runtime_context.get_server_args = lambda: types.SimpleNamespace(speculative_algorithm='DDTREE-GPU')\n"
        "sp = types.SimpleNamespace(json_schema=None, regex=None, ebnf=None, structural_tag=None)\n"
        "req = types.SimpleNamespace(return_logprob=True, return_hidden_states=False, sampling_params=sp)\n"
        "print('RESULT', S.validate_dflash_request(req, False))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=env_without_checkout(**{LP.ENV: "1"}), cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT None" in r.stdout


def test_admission_hook_refuses_a_budget_the_server_does_not_run(monkeypatch):
    """custom_params["ddtree_budget"] is checked against the DDTREE worker of this process
    (adaptive_config.register_served); SGLang's own refusals still apply to the others."""
    from sglang.srt import runtime_context
    from sglang.srt.speculative.dflash_utils import validate_dflash_request
    from sglang_ddtree.policy import adaptive_config
    monkeypatch.setattr(runtime_context, "get_server_args",
                        lambda: types.SimpleNamespace(speculative_algorithm="DDTREE-GPU"))
    monkeypatch.setattr(adaptive_config, "_SERVED", None)
    req = _req()
    req.sampling_params.custom_params = {adaptive_config.REQUEST_BUDGET_KEY: 9}
    assert VH.validate_with_logprobs(validate_dflash_request, req, False) is None   # no worker: unchecked
    cfg = adaptive_config.parse_config({"SGLANG_DDTREE_BUDGETS": "0,7,15"}, budget=15, algo="DDTREE-GPU")
    adaptive_config.register_served("DDTREE-GPU", 15, cfg)
    msg = VH.validate_with_logprobs(validate_dflash_request, req, False)
    assert msg and "ddtree_budget=9" in msg and "allowed [0, 7, 15]" in msg
    req.sampling_params.custom_params = {adaptive_config.REQUEST_BUDGET_KEY: 7}
    assert VH.validate_with_logprobs(validate_dflash_request, req, False) is None
    req.sampling_params.regex = "a+"
    assert "grammar" in VH.validate_with_logprobs(validate_dflash_request, req, False)
