"""The plugin's Prometheus metrics (issue 17 item 4, ``docs/metrics.md``) on the CPU.

* Registration and values in multiprocess mode: a fresh Python process with a temp
  PROMETHEUS_MULTIPROC_DIR (set before prometheus_client is imported, as SGLang's launcher does) runs
  a few fake rounds through ``make_round_observers`` (the worker's wiring) with fake CUDA events, and
  this process reads the directory through SGLang's own ``/metrics`` route
  (``add_prometheus_middleware``: ``MultiProcessCollector``), against numbers recomputed by brute force.
* ``--enable-metrics`` off: nothing created, no files, no profiler event, no device work.
* The worker's real round (the fake SGLang world of ``test_adaptive_round``), fixed budget and a
  forced width cycle: chosen-budget histogram, depth, stage histograms per chosen budget; the
  metric code reads no device value on the host (a torch function mode that refuses every
  host-reading op except on the pinned snapshot copies) and never waits on an event.
"""
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from sglang_ddtree import profiling, switches
from sglang_ddtree.policy import round_stats
from sglang_ddtree.policy.round_stats import AcceptanceStats, make_round_observers

prometheus_client = pytest.importorskip("prometheus_client")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE_MS = (1.5, 0.25, 0.125, 8.0, 0.375, 0.625)        # fake GPU time of each stage (exact floats)


# ------------------------------------------------------------------ fakes shared with the subprocess
FAKES = '''
import torch
STAGE_MS = %r


class FakeEvent:
    """torch.cuda.Event stand-in: the c-th record of the process is event c %% 7 of round c // 7, at
    100 ms per round + the stage times before it; ``ready`` False: query() says not complete."""
    made = 0
    records = 0
    ready = True

    def __init__(self, enable_timing=False):
        FakeEvent.made += 1
        self.t = None

    def record(self, stream=None):
        c = FakeEvent.records
        FakeEvent.records += 1
        self.t = 100.0 * (c // 7) + sum(STAGE_MS[: c %% 7])

    def query(self):
        return FakeEvent.ready

    def elapsed_time(self, other):
        return other.t - self.t

    def synchronize(self):
        raise AssertionError("a metric waited on an event")


def fake_round(bs, D, K, V, budget, gen):
    """(tree of ``budget`` (0 = root only), target argmax [bs, N], its greedy accept, lp, ids)."""
    from sglang_ddtree import ddtree
    lp = torch.randn(bs, D, K, generator=gen).log_softmax(-1).sort(-1, descending=True).values
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(bs * D)]).view(bs, D, K)
    root = torch.randint(0, V, (bs,), generator=gen)
    if budget == 0:
        tree = ddtree.root_only_tree(root, D)
    else:
        tree = ddtree.build_tree(lp, ids, budget, root_tokens=root, backend="reference")
    N = budget + 1
    follow = tree.tokens.clamp(min=0).gather(1, torch.randint(0, N, (bs, N), generator=gen))
    target = torch.where(torch.rand(bs, N, generator=gen) < 0.85, follow,
                         torch.randint(0, V, (bs, N), generator=gen))
    acc = ddtree.accept_greedy(tree, target, backend="reference")
    return tree, target, acc, lp, ids, root
''' % (STAGE_MS,)
exec(FAKES)   # FakeEvent, fake_round here too

# ------------------------------------------------------------------ the multiprocess-mode run
SCRIPT = FAKES + '''
import json, os, sys, types
assert "prometheus_client" not in sys.modules
torch.cuda.Event = FakeEvent
from sglang_ddtree import ddtree
from sglang_ddtree.policy import adaptive_config, round_stats
from sglang_ddtree.policy.round_stats import make_round_observers

out = {}
mp_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"]
bs, D, K, V, budget = 3, 6, 8, 300, 15
kw = dict(algo="DDTREE-GPU", budget=budget, block_size=D + 1, topk=K, device="cpu")
cfg = adaptive_config.AdaptiveConfig(budgets=(3, 7, 15), no_spec=True, probe_every=16)

# --enable-metrics off: no metric, no file, no event
st, prof = make_round_observers(types.SimpleNamespace(enable_metrics=False), tp_rank=0,
                                adaptive_cfg=cfg, **kw)
for _ in range(3):
    prof.begin(); [prof.mark() for _ in range(6)]; prof.end(bs, 16)
out["off"] = dict(stats=st is None, prof=prof.enabled, events=FakeEvent.made, files=os.listdir(mp_dir),
                  made=round_stats._Prometheus._made is None)
# another TP rank with metrics on: nothing either
st1, prof1 = make_round_observers(types.SimpleNamespace(enable_metrics=True), tp_rank=1, **kw)
out["rank1"] = dict(stats=st1 is None, prof=prof1.enabled, files=os.listdir(mp_dir))

# on: rounds at forced budgets, expected values by brute force
st, prof = make_round_observers(types.SimpleNamespace(enable_metrics=True), tp_rank=0,
                                adaptive_cfg=cfg, **kw)
gen = torch.Generator().manual_seed(int(os.environ["SEED"]))
want = dict(request_rounds=0, accepted=0, length={}, cf={}, cf_rounds={}, depth={}, depth_sum=0,
            chosen={}, stage={}, budgets=st.budgets)
cycle = [15, 3, 0, 7, 15, 15, 3, 7]
for rb in cycle:
    tree, target, acc, lp, ids, root = fake_round(bs, D, K, V, rb, gen)
    prof.begin()
    for _ in range(5):
        prof.mark()
    st.record(acc.path, acc.accept_len, tree_depth=tree.depth, width=rb + 1)
    prof.mark()
    prof.end(bs, rb + 1)
    lens = acc.accept_len.tolist()
    want["request_rounds"] += bs
    want["accepted"] += sum(lens)
    for n in lens:
        want["length"][n] = want["length"].get(n, 0) + 1
    for row in tree.depth.tolist():
        want["depth"][max(row)] = want["depth"].get(max(row), 0) + 1
        want["depth_sum"] += max(row)
    want["chosen"][rb] = want["chosen"].get(rb, 0) + 1
    for b in st.budgets:
        if b > rb:
            continue
        small = ddtree.build_tree(lp[..., :b].contiguous(), ids[..., :b].contiguous(), b,
                                  root_tokens=root, backend="reference")
        n = int(ddtree.accept_greedy(small, target[:, :b + 1], backend="reference").accept_len.sum())
        want["cf"][b] = want["cf"].get(b, 0) + n
        want["cf_rounds"][b] = want["cf_rounds"].get(b, 0) + bs
    want["stage"][rb] = want["stage"].get(rb, 0) + 1
st.flush()
out["want"] = want
json.dump(out, open(os.environ["OUT"], "w"))
'''


def _scrape_like_sglang(monkeypatch, mp_dir):
    """GET /metrics of an app with SGLang's own metrics route (MultiProcessCollector over mp_dir)."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    common = pytest.importorskip("sglang.srt.utils.common")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp_dir))
    app = FastAPI()
    common.add_prometheus_middleware(app)
    text = TestClient(app).get("/metrics").text
    samples = {}
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("sglang:ddtree_"):
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_multiprocess_registration_and_values(tmp_path, monkeypatch):
    mp_dir, out = tmp_path / "prom", tmp_path / "out.json"
    mp_dir.mkdir()
    seed = int.from_bytes(os.urandom(4), "little")
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), OUT=str(out), SEED=str(seed),
               SGLANG_DDTREE_STATS_EVERY="3", SGLANG_DDTREE_PROFILE_EVERY="4",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("SGLANG_DDTREE_STATS_FILE", None)
    env.pop("SGLANG_DDTREE_PROFILE_FILE", None)
    script = tmp_path / "rounds.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"seed {seed}\n{r.stderr[-4000:]}"
    res = json.loads(out.read_text())
    assert res["off"] == dict(stats=True, prof=False, events=0, files=[], made=True)
    assert res["rank1"] == dict(stats=True, prof=False, files=[])
    assert os.listdir(mp_dir)                                            # the metrics' mmap files
    got = _scrape_like_sglang(monkeypatch, mp_dir)
    want = res["want"]
    lab = (("algo", "DDTREE-GPU"), ("budget", "15"), ("tp_rank", "0"))

    def g(name, **extra):
        return got.get((name, tuple(sorted(dict(lab, **extra).items()))))

    P = "sglang:ddtree_"
    assert g(P + "request_rounds_total") == want["request_rounds"] == 24
    assert g(P + "accepted_tokens_total") == want["accepted"]
    for n, c in want["length"].items():
        assert g(P + "accept_length_total", length=n) == c
    assert sum(v for (k, _), v in got.items() if k == P + "accept_length_total") == 24
    assert want["budgets"] == [3, 7, 15]
    for b in want["budgets"]:
        assert g(P + "counterfactual_accepted_tokens_total", at_budget=str(b)) == want["cf"][str(b)]
        assert g(P + "counterfactual_request_rounds_total", at_budget=str(b)) == want["cf_rounds"][str(b)]
    assert want["cf_rounds"] == {"3": 21, "7": 15, "15": 9}              # rounds at >= that budget
    for d, c in want["depth"].items():
        assert g(P + "tree_depth_total", depth=d) == c
    assert g(P + "tree_depth_sum_total") == want["depth_sum"]
    # chosen budget: a histogram with one bucket per budget the rounds may use
    chosen = {int(b): c for b, c in want["chosen"].items()}
    assert chosen == {15: 3, 3: 2, 0: 1, 7: 2}
    cum = 0
    for b in (0, 3, 7, 15):
        cum += chosen[b]
        assert g(P + "chosen_budget_bucket", le=f"{float(b)}") == cum
    assert g(P + "chosen_budget_bucket", le="+Inf") == g(P + "chosen_budget_count") == 8
    assert g(P + "chosen_budget_sum") == sum(b * c for b, c in chosen.items())
    # stage times: 8 rounds, profiler windows of 4, per chosen budget
    for b, c in chosen.items():
        for stage, ms in zip(profiling.STAGES, STAGE_MS):
            assert g(P + "stage_ms_count", stage=stage, chosen_budget=str(b)) == c
            assert g(P + "stage_ms_sum", stage=stage, chosen_budget=str(b)) == pytest.approx(c * ms)
        assert g(P + "round_ms_sum", chosen_budget=str(b)) == pytest.approx(c * sum(STAGE_MS))
        assert g(P + "round_host_ms_count", chosen_budget=str(b)) == c
    assert g(P + "stage_ms_bucket", stage="verify", chosen_budget="15", le="7.5") == 0
    assert g(P + "stage_ms_bucket", stage="verify", chosen_budget="15", le="10.0") == 3


# ------------------------------------------------------------------ in-process: no sync, off = no work
from test_adaptive_round import make_worker, run_round, world  # noqa: E402,F401  (the fake SGLang world)

HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
              "nonzero", "unique", "masked_select", "__repr__", "__format__", "argwhere"}


class NoHostRead(TorchFunctionMode):
    """Refuses every op that reads a tensor's values on the host (a device->host sync on CUDA), but
    on the snapshot copies ``_async_host_copy`` hands out (pinned, read once their event is done)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is not None and not getattr(t, "_ddtree_host_copy", False):
            if name in HOST_READS:
                raise AssertionError(f"host read of a device tensor: {name}")
            if name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())):
                raise AssertionError("copy of a device tensor to the host")
            if name == "__getitem__" and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
                raise AssertionError("boolean-mask indexing (a sync on CUDA)")
        return func(*args, **kwargs)


@pytest.fixture
def guarded(monkeypatch):
    """Fresh metrics in a private registry, fake events, tagged host copies."""
    monkeypatch.setattr(round_stats._Prometheus, "_made", None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "made", 0)
    monkeypatch.setattr(FakeEvent, "ready", True)
    real = round_stats._async_host_copy

    def tagged(t):
        ev, host = real(t)
        host._ddtree_host_copy = True
        return ev, host

    monkeypatch.setattr(round_stats, "_async_host_copy", tagged)
    for k in ("SGLANG_DDTREE_STATS_FILE", "SGLANG_DDTREE_PROFILE_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SGLANG_DDTREE_PROFILE_EVERY", "2")
    return prometheus_client.CollectorRegistry()


def test_no_host_read_guard_works():
    with NoHostRead():
        with pytest.raises(AssertionError):
            torch.ones(2).sum().item()
        with pytest.raises(AssertionError):
            bool(torch.ones(1))


def test_records_read_nothing_on_the_host(guarded):
    gen = torch.Generator().manual_seed(1)
    st, prof = make_round_observers(types.SimpleNamespace(enable_metrics=True), algo="DDTREE-GPU",
                                    budget=15, block_size=7, topk=8, tp_rank=0, device="cpu",
                                    registry=guarded)
    st.every = 2
    rounds = [fake_round(2, 6, 8, 300, 15, gen) for _ in range(5)]
    FakeEvent.ready = False                       # the GPU is behind: nothing may wait for it
    for i, (tree, target, acc, *_) in enumerate(rounds):
        if i == 3:
            FakeEvent.ready = True
        with NoHostRead():
            prof.begin()
            for _ in range(5):
                prof.mark()
            st.record(acc.path, acc.accept_len, tree_depth=tree.depth, width=16)
            prof.mark()
            prof.end(2, 16)
        if i < 3:
            assert guarded.get_sample_value("sglang:ddtree_stage_ms_count", dict(
                algo="DDTREE-GPU", budget="15", tp_rank="0", stage="verify", chosen_budget="15")) is None
    lab = dict(algo="DDTREE-GPU", budget="15", tp_rank="0")
    assert guarded.get_sample_value("sglang:ddtree_request_rounds_total", lab) == 8   # 2 windows of 2
    assert guarded.get_sample_value("sglang:ddtree_stage_ms_count", dict(
        lab, stage="verify", chosen_budget="15")) == 4                 # rounds 0-3 read at round 3
    assert FakeEvent.made == 28                   # rounds 0-3 in flight; round 4 reuses their events


def _worker_rounds(world, env, monkeypatch, registry, metrics: bool, n=8, cycle=None):
    wd = make_worker(world, env, sw=switches.Switches(budget_cycle=cycle))
    w = wd.w
    stats, w._prof = make_round_observers(
        types.SimpleNamespace(enable_metrics=metrics), algo="DDTREE-GPU", budget=15, block_size=6,
        topk=12, tp_rank=0, device="cpu", adaptive_cfg=w._adaptive_cfg, registry=registry)
    w._policy.report_to(stats=stats, profiler=w._prof)
    calls = []
    if stats is not None:
        real_record = stats.record

        def guarded_record(*a, **k):
            calls.append(k.get("width"))
            with NoHostRead():
                return real_record(*a, **k)

        stats.record = guarded_record
    for name in ("begin", "mark", "end"):
        real = getattr(w._prof, name)

        def guarded_call(*a, _real=real, **k):
            with NoHostRead():
                return _real(*a, **k)

        setattr(w._prof, name, guarded_call)
    widths = [run_round(wd)["N"] for _ in range(n)]
    return wd, widths, calls


def test_worker_round_fixed_budget(guarded, world, monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_STATS_EVERY", "2")
    wd, widths, calls = _worker_rounds(world, {"SGLANG_DDTREE_ADAPTIVE": "0"}, monkeypatch, guarded, True)
    assert widths == [16] * 8 and calls == [16] * 8
    lab = dict(algo="DDTREE-GPU", budget="15", tp_rank="0")
    get = guarded.get_sample_value
    assert get("sglang:ddtree_chosen_budget_count", lab) == 8          # every round at its width
    assert get("sglang:ddtree_chosen_budget_bucket", dict(lab, le="0.0")) == 0
    assert get("sglang:ddtree_chosen_budget_bucket", dict(lab, le="15.0")) == 8
    assert get("sglang:ddtree_chosen_budget_sum", lab) == 8 * 15
    assert get("sglang:ddtree_request_rounds_total", lab) == 8 * wd.bs
    committed = sum(len(o) for o in wd.out)                             # accepted + one bonus each
    assert get("sglang:ddtree_accepted_tokens_total", lab) == committed - 8 * wd.bs
    depth_n = sum(get("sglang:ddtree_tree_depth_total", dict(lab, depth=str(d))) or 0 for d in range(6))
    assert depth_n == 8 * wd.bs and get("sglang:ddtree_tree_depth_sum_total", lab) > 0
    for stage, ms in zip(profiling.STAGES, STAGE_MS):
        s = dict(lab, stage=stage, chosen_budget="15")
        assert get("sglang:ddtree_stage_ms_count", s) == 8
        assert get("sglang:ddtree_stage_ms_sum", s) == pytest.approx(8 * ms)


def test_worker_round_adaptive_cycle(guarded, world, monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_STATS_EVERY", "2")
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,7,15"}
    wd, widths, calls = _worker_rounds(world, env, monkeypatch, guarded, True, cycle=(15, 3, 0, 7))
    assert widths == [16, 4, 1, 8] * 2 and calls == widths
    lab = dict(algo="DDTREE-GPU", budget="15", tp_rank="0")
    get = guarded.get_sample_value
    for b, cum in ((0, 2), (3, 4), (7, 6), (15, 8)):
        assert get("sglang:ddtree_chosen_budget_bucket", dict(lab, le=f"{float(b)}")) == cum
    assert get("sglang:ddtree_tree_depth_total", dict(lab, depth="0")) >= 2 * wd.bs   # no-spec rounds
    for b, n in ((3, 6), (7, 4), (15, 2)):
        assert get("sglang:ddtree_counterfactual_request_rounds_total", dict(lab, at_budget=str(b))) == n * wd.bs
    for b in (0, 3, 7, 15):
        assert get("sglang:ddtree_stage_ms_count", dict(lab, stage="verify", chosen_budget=str(b))) == 2


def test_worker_round_metrics_off_does_nothing(guarded, world, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("metrics work with --enable-metrics off")

    monkeypatch.setattr(AcceptanceStats, "__init__", boom)
    monkeypatch.setattr(round_stats._Prometheus, "__init__", boom)
    env = {"SGLANG_DDTREE_BUDGETS": "0,3,15"}
    wd, widths, calls = _worker_rounds(world, env, monkeypatch, guarded, False, n=4, cycle=(15, 3))
    assert wd.w._policy.stats is None and not wd.w._prof.enabled and calls == []
    assert FakeEvent.made == 0 and round_stats._Prometheus._made is None
    assert list(guarded.collect()) == []


def test_stats_file_carries_each_budgets_predicted_acceptance(guarded, world, monkeypatch, tmp_path):
    """With the stats file on, every tree round hands the tree's own acceptance estimate
    (accept_estimate.expected_accept, for each reported budget the tree holds) to the stats; a
    window's ``predicted`` is their sum over request-rounds, next to the exact ``counterfactual``.
    The fake drafter's log-probs are random, so only the bookkeeping is checked here (the estimate
    itself: tests/test_accept_estimate.py)."""
    from sglang_ddtree.policy import accept_estimate as AE

    out = tmp_path / "stats.jsonl"
    monkeypatch.setenv(round_stats.ENV_FILE, str(out))
    monkeypatch.setenv("SGLANG_DDTREE_STATS_EVERY", "4")
    seen, real = [], AE.expected_accept

    def spy(*a, **k):
        r = real(*a, **k)
        seen.append((r.clone(), list(a[3])))
        return r

    monkeypatch.setattr(AE, "expected_accept", spy)
    wd, widths, calls = _worker_rounds(world, {"SGLANG_DDTREE_ADAPTIVE": "0"}, monkeypatch, guarded, False, n=8)
    wd.w._policy.stats.flush()
    recs = [json.loads(line) for line in open(out)]
    assert [r["rounds"] for r in recs] == [4, 4] and recs[0]["budgets"] == [7, 15]
    assert all(ws == [8, 16] for _, ws in seen) and len(seen) == 8          # both budgets, every round
    for k, rec in enumerate(recs):
        want = torch.stack([p for p, _ in seen[4 * k:4 * k + 4]]).sum((0, 1)).tolist()
        assert rec["predicted"] == pytest.approx(want, abs=2e-3 * 4 * wd.bs)
        assert all(0 < x <= 5 * rec["request_rounds"] for x in rec["predicted"])   # depth 5 at most
