"""bench/soak.py's plan and verdicts (CPU): the load has the mix the issue asks for, is deterministic
for a seed, and ``evaluate`` fails a document for each kind of breakage it must catch."""
import copy
import json
import os
import random

import pytest

from helpers import load_bench

soak = load_bench("soak")

V, CTX = 2048, 4096


def _stream(n=20000, seed=0):
    r = random.Random(seed)
    return [r.randrange(5, V) for _ in range(n)]


def test_plan_mix_and_determinism():
    seed = int.from_bytes(os.urandom(2), "little")
    ids = _stream()
    plan = soak.make_plan(1000, ids, V, CTX, seed=seed)
    assert plan == soak.make_plan(1000, ids, V, CTX, seed=seed)
    kinds = [p["kind"] for p in plan]
    assert kinds.count("bad") == 50 and kinds.count("abort") == 50
    assert {p["bad"] for p in plan if p["kind"] == "bad"} == set(soak.BAD_KINDS)
    ok = [p for p in plan if p["kind"] == "ok"]
    lens = [p["prompt_len"] for p in ok]
    assert min(lens) >= 1 and max(lens) <= 3500 and max(lens) > 3000 and min(lens) < 5
    mnt = [p["sampling_params"]["max_new_tokens"] for p in ok]
    assert min(mnt) >= 1 and max(mnt) <= 512 and max(mnt) > 450 and min(mnt) < 3
    assert all(p["prompt_len"] + p["sampling_params"]["max_new_tokens"] < CTX for p in ok)
    g = sum(p["greedy"] for p in ok) / len(ok)
    assert 0.5 < g < 0.7
    assert any("top_p" in p["sampling_params"] for p in ok) and any("top_k" in p["sampling_params"] for p in ok)
    assert 0.3 < sum(p["stream"] for p in ok) / len(ok) < 0.7
    assert sum("stop" in p["sampling_params"] for p in ok) > 60
    assert sum("stop_token_ids" in p["sampling_params"] for p in ok) > 60
    starts = [p["start"] for p in ok]
    assert len(set(starts)) < len(starts) - 100          # repeated prefixes (radix hits)
    ab = [p for p in plan if p["kind"] == "abort"]
    assert all(p["stream"] for p in ab) and {p["abort_how"] for p in ab} == {"disconnect", "abort_request"}


@pytest.mark.parametrize("kind", soak.BAD_KINDS)
def test_every_bad_payload_is_bad(kind):
    body, stream = soak.bad_payload(kind, V, CTX, _stream(100))
    if kind == "malformed":
        with pytest.raises(json.JSONDecodeError):
            json.loads(body)
        return
    p = json.loads(body)
    ids, sp = p["input_ids"], p["sampling_params"]
    bad = (any(not isinstance(t, int) or t < 0 or t >= V for t in ids) or sp.get("temperature", 0) < 0
           or sp.get("top_p", 1) > 1 or sp["max_new_tokens"] < 0 or len(ids) > CTX or p.get("return_logprob"))
    assert bad and stream == (kind == "id_vocab_stream")


def _passing_doc():
    ids = _stream()
    plan = soak.make_plan(200, ids, V, CTX, seed=3)
    recs, ref = [], []
    for s in plan:
        if s["kind"] == "bad":
            recs.append(dict(i=s["i"], kind="bad", bad=s["bad"], status=400, rejected=True, error="bad"))
        elif s["kind"] == "abort":
            recs.append(dict(i=s["i"], kind="abort", status=200, aborted_by="disconnect"))
        else:
            out = [7] * min(3, s["sampling_params"]["max_new_tokens"])
            recs.append(dict(i=s["i"], kind="ok", status=200, output_ids=out, finish="length"))
            if s["greedy"]:
                ref.append(dict(i=s["i"], kind="ok", status=200, output_ids=list(out), finish="length"))
    samples = [dict(t=i, gpu_mib=50000 + (300 if i > 2 else 0), running=1, used_tokens=5) for i in range(20)]
    doc = dict(plan=plan, settings=dict(vocab=V, concurrency=64),
               soak=dict(records=recs, samples=samples, server_alive=True, load_s=1.0,
                         idle=dict(running=0, waiting=0, used_tokens=0)),
               reference=dict(records=ref))
    return doc


def test_evaluate_passes_a_clean_run_and_fails_each_breakage():
    cls = dict(compared=1, diverged=0, near_tie=0, error=0, length=0, noise=0.2)
    doc = _passing_doc()
    assert soak.evaluate(doc, cls)["ok"]
    assert not soak.evaluate(doc, None)["ok"]                       # no classification yet
    assert not soak.evaluate(doc, dict(cls, error=1))["ok"]         # a greedy error

    def broken(edit):
        d = copy.deepcopy(doc)
        edit(d)
        return soak.evaluate(d, cls)

    first = lambda d, kind: next(r for r in d["soak"]["records"] if r["kind"] == kind)  # noqa: E731
    assert broken(lambda d: first(d, "ok").update(status=500, output_ids=None))["status_5xx"] == 1
    assert not broken(lambda d: first(d, "ok").update(status=500, output_ids=None))["ok"]
    assert not broken(lambda d: first(d, "bad").update(status=200, rejected=False))["ok"]
    assert not broken(lambda d: first(d, "abort").update(aborted_by="abort_request", error="boom"))["ok"]
    assert not broken(lambda d: first(d, "ok").update(output_ids=[V]))["ok"]
    assert not broken(lambda d: d["soak"].update(server_alive=False))["ok"]
    assert not broken(lambda d: d["soak"]["idle"].update(used_tokens=12))["ok"]
    assert not broken(lambda d: d["soak"]["samples"][-1].update(gpu_mib=60000))["ok"]
    assert not broken(lambda d: d["reference"]["records"].pop())["ok"]     # a greedy output not compared
    warm = dict(requests=69, s=3.0, first_s=[0.1] * 5, errors=[])
    assert broken(lambda d: d["soak"].update(warmup=warm))["ok"]
    assert not broken(lambda d: d["soak"].update(warmup=dict(warm, errors=["HTTP 500"])))["ok"]


def test_warmup_plan_covers_every_sampling_mode_then_a_full_batch():
    ids = _stream()
    wp = soak.warmup_plan(ids, CTX, concurrency=8)
    modes = {tuple(sorted(k for k in w["sampling_params"] if k in ("top_p", "top_k"))) + (w["greedy"],)
             for w in wp}
    assert modes == {(True,), (False,), ("top_p", False), ("top_k", False), ("top_k", "top_p", False)}
    assert len(wp) == 5 + 8 and all(w["kind"] == "ok" and not w["stream"] for w in wp)
    assert all(w["start"] + w["prompt_len"] <= len(ids) for w in wp)
    assert all(w["prompt_len"] + w["sampling_params"]["max_new_tokens"] < CTX for w in wp)
    assert min(w["prompt_len"] for w in wp[5:]) > 1000            # the batch is long prompts
    assert len({w["rid"] for w in wp}) == len(wp) and all(w["i"] < 0 for w in wp)  # never a plan index


def test_the_soak_runs_the_default_or_a_fixed_budget_with_the_switches_it_is_given(monkeypatch):
    """--budget 0: the server a user launches (no --speculative-num-draft-tokens); --switches: the soak
    server (not the plain reference) gets them as DDTREE_SWITCHES, refused when not a JSON object of
    known switches."""
    import argparse
    from sglang_ddtree import switches
    monkeypatch.delenv(switches.ENV, raising=False)
    a = argparse.Namespace(model_path="/m", draft_model_path="/d", mem_fraction=0.3, context_len=4096,
                           max_total_tokens=1000, concurrency=64, server_args="", budget=0, switches="")
    cmd = soak.server_cmd(a, "DDTREE-GPU", 31000)
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "DDTREE-GPU"
    assert "--speculative-num-draft-tokens" not in cmd and "--speculative-draft-model-path" in cmd
    assert "--speculative-algorithm" not in soak.server_cmd(a, None, 31050)
    a.budget = 16
    cmd = soak.server_cmd(a, "DDTREE-GPU", 31000)
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "17"
    assert switches.ENV not in soak.soak_env(a)
    a.switches = '{"regime": "auto"}'
    env = soak.soak_env(a)
    assert switches.fields_of(env[switches.ENV]) == {"regime": "auto"}
    for bad in ('{"regime": ', '["auto"]', '{}', '{"no_such_switch": 1}'):
        a.switches = bad
        with pytest.raises((SystemExit, TypeError)):
            soak.soak_env(a)
