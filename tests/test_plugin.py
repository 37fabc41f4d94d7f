"""Registration through the ``sglang.srt.plugins`` entry point (fresh processes, real SGLang 0.5.16
classes, no GPU), the graph-mask hook, and server-argument handling: settings, defaults, every
rejected value with its message, and a rejected launch of ``python -m sglang.launch_server``."""
import json
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("sglang.srt.plugins")

from sglang_ddtree import config as C  # noqa: E402
from helpers import env_without_checkout  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _py(code, env=None, timeout=300):
    """Run code in a fresh interpreter outside the repo root (it must import the installed package)."""
    e = env_without_checkout(**(env or {}))
    r = subprocess.run([sys.executable, "-c", code], cwd="/", env=e, capture_output=True, text=True,
                       timeout=timeout)
    return r


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "device", "mk_models.py"), str(d),
                    "--configs-only"], check=True, capture_output=True)
    return str(d)


REGISTRATION = r'''
import json
from importlib.metadata import entry_points
eps = [(e.name, e.value) for e in entry_points(group="sglang.srt.plugins")]
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
import sglang_ddtree.plugin as plugin
plugin.register()  # a second call is a no-op
out = {"eps": eps, "patched": sorted(HookRegistry._patched)}
for name in ("DDTREE-GPU", "ddtree-cpu"):
    a = SpeculativeAlgorithm.from_string(name)
    out[name] = dict(cls=type(a).__name__, name=a.name, backend=a.tree_backend,
                     overlap=a.supports_overlap, dflash=a.is_dflash(), family=a.is_dflash_family(),
                     tv_draft=a.supports_target_verify_for_draft(), eagle=a.is_eagle(),
                     carries=a.carries_draft_hidden_states(), need_topk=a.need_topk(),
                     fm=callable(a.create_future_map), worker=a.factory(None).__name__,
                     width_target=a.get_num_tokens_per_req_for_target_verify(17, False))
print("RESULT" + json.dumps(out))
'''


def test_entry_point_registers_both_algorithms_in_a_fresh_process():
    r = _py(REGISTRATION)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert ("ddtree", "sglang_ddtree.plugin:register") in [tuple(e) for e in out["eps"]]
    assert "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info" \
        in out["patched"]
    assert "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_cuda_graph_state" in out["patched"]
    g, c = out["DDTREE-GPU"], out["ddtree-cpu"]
    assert g["cls"] == "DDTreeGPUSpecAlgo" and g["backend"] == "triton" and g["name"] == "DDTREE-GPU"
    assert c["cls"] == "DDTreeCPUSpecAlgo" and c["backend"] == "reference" and c["name"] == "DDTREE-CPU"
    for a in (g, c):
        assert a["overlap"] and a["dflash"] and a["family"] and a["tv_draft"] and a["fm"]
        assert not a["eagle"] and not a["carries"] and not a["need_topk"]
        assert a["worker"] == "DDTreeWorker" and a["width_target"] == 17


def test_without_the_plugin_the_name_is_unknown():
    r = _py("from sglang.srt.plugins import load_plugins; load_plugins()\n"
            "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n"
            "SpeculativeAlgorithm.from_string('DDTREE-GPU')", env={"SGLANG_PLUGINS": "not_ddtree"})
    assert r.returncode != 0 and "Unknown speculative algorithm" in r.stderr


def test_graph_mask_hook_only_touches_the_ddtree_target_runner():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ddtree.patches.decode_graph_spec_info import get_spec_info_with_tree_mask
    from sglang_ddtree.spec_algo import DDTreeGPUSpecAlgo

    ddtree_algo = DDTreeGPUSpecAlgo("DDTREE-GPU", lambda sa: None, supports_overlap=True)
    mask = object()

    def runner(algo, draft):
        return types.SimpleNamespace(model_runner=types.SimpleNamespace(spec_algorithm=algo,
                                                                        is_draft_worker=draft),
                                     buffers=types.SimpleNamespace(custom_mask=mask))

    def original(self, num_tokens):
        return types.SimpleNamespace(custom_mask=None)

    assert get_spec_info_with_tree_mask(original, runner(ddtree_algo, False), 8).custom_mask is mask
    assert get_spec_info_with_tree_mask(original, runner(ddtree_algo, True), 8).custom_mask is None
    assert get_spec_info_with_tree_mask(original, runner(SpeculativeAlgorithm.DFLASH, False),
                                        8).custom_mask is None
    assert get_spec_info_with_tree_mask(lambda s, n: None, runner(ddtree_algo, False), 8) is None


# ---------------------------------------------------------------- settings (pure)
def test_small_budgets_with_deep_drafters_resolve():
    """Every budget 1..256 works with any block size (the reservation hooks cover N < B)."""
    for block in (2, 4, 8, 16, 32):
        for budget in (1, 2, 7, 8, 15) + ((64, 256) if block <= 16 else ()):  # (rank-path key limit)
            s = C.resolve_settings(algo="X", num_draft_tokens=budget + 1, block_size=block, env={})
            assert (s.budget, s.block_size) == (budget, block)


def test_settings_defaults_and_sources():
    s = C.resolve_settings(algo="X", num_draft_tokens=None, block_size=8, env={})
    assert (s.budget, s.num_verify_tokens, s.draft_depth, s.topk) == (28, 29, 7, 28)
    s = C.resolve_settings(algo="X", num_draft_tokens=None, block_size=16, vocab_size=32, env={})
    assert (s.budget, s.topk) == (60, 32)  # top-k bounded by the vocabulary
    s = C.resolve_settings(algo="X", num_draft_tokens=33, block_size=16, env={})
    assert (s.budget, s.topk) == (32, 32)
    s = C.resolve_settings(algo="X", num_draft_tokens=13, block_size=16, env={C.ENV_TOPK: "4"})
    assert (s.budget, s.topk) == (12, 4)
    # the budget has one source, the flag: the removed variable is not read here (env_vars.check
    # refuses it in the launcher, naming the flag)
    s = C.resolve_settings(algo="X", num_draft_tokens=13, block_size=16, env={"SGLANG_DDTREE_BUDGET": "20"})
    assert s.budget == 12


@pytest.mark.parametrize("kw,msg", [
    (dict(num_draft_tokens=1, block_size=8), "must be >= 2"),
    (dict(num_draft_tokens=258, block_size=8), "must be in [1, 256]"),
    (dict(num_draft_tokens=17, block_size=None), "block size is unknown"),
    (dict(num_draft_tokens=17, block_size=1), "block size must be >= 2"),
    (dict(num_draft_tokens=17, block_size=8, env={C.ENV_TOPK: "abc"}), "must be an integer"),
    (dict(num_draft_tokens=17, block_size=8, env={C.ENV_TOPK: "0"}), "must be in [1, 256]"),
    (dict(num_draft_tokens=17, block_size=8, env={C.ENV_TOPK: "300"}), "must be in [1, 256]"),
    (dict(num_draft_tokens=17, block_size=8, vocab_size=10, env={C.ENV_TOPK: "11"}), "exceeds the vocabulary"),
    (dict(num_draft_tokens=65, block_size=40, env={C.ENV_TOPK: "256"}), "key words"),
])
def test_settings_rejections(kw, msg):
    kw.setdefault("env", {})
    with pytest.raises(ValueError) as ei:
        C.resolve_settings(algo="DDTREE-GPU", **kw)
    assert msg in str(ei.value)


# ---------------------------------------------------------------- server args (real ServerArgs)
SERVER_ARGS = r'''
import json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
models = sys.argv[1]
base = ["--model-path", f"{models}/gqa_target", "--speculative-draft-model-path", f"{models}/drafter",
        "--device", "cuda"]
cases = json.loads(sys.argv[2])
out = []
for algo, extra, env in cases:
    os.environ.update(env)
    try:
        sa = prepare_server_args(base + ["--speculative-algorithm", algo] + extra)
        out.append({"ok": True, "n": sa.speculative_num_draft_tokens, "attn": sa.attention_backend,
                    "draft_attn": sa.speculative_draft_attention_backend, "steps": sa.speculative_num_steps,
                    "topk": sa.speculative_eagle_topk, "mrr": sa.max_running_requests,
                    "algo": sa.speculative_algorithm, "graph_bs": list(sa.cuda_graph_config.decode.bs or []),
                    "graph_max_bs": sa.cuda_graph_config.decode.max_bs,
                    "plain_bs": getattr(sa, "_ddtree_plain_graph_bs", None)})
    except Exception as e:
        out.append({"ok": False, "type": type(e).__name__, "msg": str(e)})
    for k in env:
        os.environ.pop(k)
print("RESULT" + json.dumps(out))
'''

CASES = [
    ("DDTREE-GPU", [], {}),
    ("ddtree-cpu", ["--speculative-num-draft-tokens", "65"], {}),
    ("DDTREE-GPU", ["--speculative-num-draft-tokens", "9"], {}),
    ("DDTREE-GPU", ["--speculative-num-draft-tokens", "1"], {}),
    ("DDTREE-GPU", ["--speculative-num-draft-tokens", "400"], {}),
    ("DDTREE-GPU", ["--attention-backend", "flashmla"], {}),
    ("DDTREE-GPU", ["--page-size", "16"], {}),
    ("DDTREE-GPU", ["--speculative-draft-window-size", "64"], {}),
    ("DDTREE-GPU", [], {"SGLANG_DDTREE_TOPK": "nope"}),
    ("DDTREE-GPU", ["--speculative-num-draft-tokens", "17"], {"SGLANG_DDTREE_BUDGET": "32"}),   # removed
    # the running-request cap: lifted for the adaptive default only (plain decoding's floor)
    ("DDTREE-GPU", [], {"SGLANG_DDTREE_ADAPTIVE": "0"}),
    ("DDTREE-GPU", [], {"SGLANG_DDTREE_BUDGETS": "7,15,28"}),   # no 0: no round skips speculation
    ("DDTREE-GPU", ["--max-running-requests", "32"], {}),
    ("DDTREE-GPU", ["--disable-cuda-graph"], {}),
    ("DFLASH", [], {}),
    ("DDTREE-GPU", [], {"SGLANG_DDTREE_NO_SPEC": "1"}),         # removed: refused, saying where it went
    ("DDTREE-GPU", ["--max-running-requests", "32"], {"SGLANG_DDTREE_BUDGETS": "0,28,300"}),
    ("DDTREE-GPU", [], {"SGLANG_DDTREE_BUGDETS": "8"}),         # a typo: refused, not ignored
    ("DDTREE-GPU", [], {"SGLANG_DDTREE_KV_COMMIT": "move"}),    # a switch now (switches.py): refused, with where it went
]


def test_server_args_resolution_and_rejections(tiny_models):
    r = _py(SERVER_ARGS.replace("sys.argv[1]", repr(tiny_models)).replace("sys.argv[2]", repr(json.dumps(CASES))))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    ok = out[0]
    assert ok["ok"] and ok["n"] == 29 and ok["attn"] == "triton" and ok["draft_attn"] == "triton"
    assert ok["steps"] == 1 and ok["topk"] == 1 and ok["algo"] == "DDTREE-GPU"
    # the adaptive default runs as many requests as plain decoding (SGLang sizes it: None here); the
    # tree widths' graphs stop at 64 requests, the no-speculation state keeps SGLang's whole list
    assert ok["mrr"] is None and ok["plain_bs"] and max(ok["plain_bs"]) > 64
    assert ok["graph_bs"] == [b for b in ok["plain_bs"] if b <= 64] and ok["graph_max_bs"] == 64
    fixed, no_ns, given, eager, dflash, bad, bad_given, typo, bad_commit = out[10:]
    for res in (fixed, no_ns, eager, dflash):        # no plain-decoding floor: SGLang's speculative cap
        assert res["ok"] and res["mrr"] == 48 and res["plain_bs"] is None, res
    assert dflash["graph_max_bs"] == max(ok["plain_bs"])   # DFLASH's own graphs untouched
    assert given["ok"] and given["mrr"] == 32 and given["plain_bs"] is None
    assert not bad["ok"] and bad["type"] == "ValueError" and "budget 0 in SGLANG_DDTREE_BUDGETS" in bad["msg"]
    # checked at argument resolution whether or not the running requests are given
    assert not bad_given["ok"] and "must be 0 (no speculation) or in [1, 256], got 300" in bad_given["msg"]
    assert not typo["ok"] and "did you mean SGLANG_DDTREE_BUDGETS?" in typo["msg"]
    assert not bad_commit["ok"] and "SGLANG_DDTREE_KV_COMMIT is now an A/B / test-bed switch" in bad_commit["msg"]
    assert out[1]["ok"] and out[1]["n"] == 65 and out[1]["algo"] == "DDTREE-CPU"
    assert out[2]["ok"] and out[2]["n"] == 9
    expect = ["must be >= 2", "must be in [1, 256]",
              "'flashmla' is not one whose TARGET_VERIFY", "--page-size 1 only",
              "--speculative-draft-window-size", "SGLANG_DDTREE_TOPK must be an integer",
              "SGLANG_DDTREE_BUDGET is no longer read: the tree budget is --speculative-num-draft-tokens"]
    for res, msg in zip(out[3:10], expect):
        assert not res["ok"] and res["type"] == "ValueError", res
        assert msg in res["msg"], (msg, res["msg"])


def test_launch_server_rejects_bad_budget_before_starting(tiny_models):
    """The CLI exits with the message (argument resolution), before any scheduler process exists."""
    e = env_without_checkout()
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path",
                        f"{tiny_models}/gqa_target", "--speculative-algorithm", "DDTREE-GPU",
                        "--speculative-draft-model-path", f"{tiny_models}/drafter", "--device", "cuda",
                        "--speculative-num-draft-tokens", "300"], cwd="/", env=e, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    assert "the tree budget must be in [1, 256] nodes (verify width budget + 1), got 299" in r.stderr


MEM_FRACTION = r'''
import json, logging, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt import server_args as SA
SA.get_device_memory_capacity = lambda *a, **k: 81559.0     # an H100 80GB (MB), as SGLang reads it
models = sys.argv[1]
base = ["--model-path", f"{models}/gqa_target", "--speculative-draft-model-path", f"{models}/drafter",
        "--device", "cuda"]
msgs = []
logging.getLogger("sglang_ddtree").addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: msgs.append(r.getMessage())})())
logging.getLogger("sglang_ddtree").setLevel(logging.INFO)
out = {}
for name, extra, env in [("default", [], {}), ("fixed", [], {"SGLANG_DDTREE_ADAPTIVE": "0"}),
                         ("given", ["--mem-fraction-static", "0.7"], {}),
                         ("flashinfer", ["--attention-backend", "flashinfer"], {}),
                         ("flashinfer_fixed", ["--attention-backend", "flashinfer"], {"SGLANG_DDTREE_ADAPTIVE": "0"}),
                         ("no_graphs", ["--disable-cuda-graph"], {}), ("no_graphs_fixed", ["--disable-cuda-graph"],
                                                                       {"SGLANG_DDTREE_ADAPTIVE": "0"}),
                         ("dflash", [], {})]:
    os.environ.update(env)
    algo = "DFLASH" if name == "dflash" else "DDTREE-GPU"
    del msgs[:]
    sa = SA.prepare_server_args(base + ["--speculative-algorithm", algo] + extra)
    out[name] = [sa.mem_fraction_static, [m for m in msgs if "mem-fraction-static" in m]]
    for k in env:
        os.environ.pop(k)
print("RESULT" + json.dumps(out))
'''


def test_default_takes_its_states_memory_out_of_the_heuristic_kv_pool(tiny_models):
    """SGLang sizes the KV pool before the adaptive default builds its extra target states; when the
    user gave no --mem-fraction-static, SGLang's heuristic value is lowered by their estimate (the
    log says from what to what); a value the user gave, a fixed budget and DFLASH keep SGLang's.
    (Simulated 80 GB GPU; the tiny pair's vocab makes the estimate mostly the states' fixed parts:
    0.1 GB per tree width on triton, 0.63 GB for a flashinfer no-speculation state.)"""
    r = _py(MEM_FRACTION.replace("sys.argv[1]", repr(tiny_models)))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    gpu_gb = 81559.0 * (1 << 20) / 1e9
    assert out["given"][0] == 0.7 and not out["given"][1]
    assert not out["fixed"][1] and not out["dflash"][1]
    # without CUDA graphs the default runs the fixed budget (no states): SGLang's value stands
    assert not out["no_graphs"][1] and out["no_graphs"][0] == out["no_graphs_fixed"][0]
    for name, fixed in (("default", "fixed"), ("flashinfer", "flashinfer_fixed")):
        taken = (out[fixed][0] - out[name][0]) * gpu_gb
        assert len(out[name][1]) == 1 and f"{out[fixed][0]:.3f} -> {out[name][0]:.3f}" in out[name][1][0], out
        # the tiny pair (budget 28): extra states 1, 8, 16; the value is rounded to 3 decimals (~0.09 GB)
        want = 0.1 * 3 if name == "default" else 0.1 * 2 + 0.63
        assert "widths [1, 8, 16]" in out[name][1][0] and abs(taken - want) <= 0.1, (name, taken, out)


def test_state_memory_estimate_against_the_logged_states():
    """verify_states.state_memory_gb against what the worker logged for the Qwen3-8B shape (vocab 151,936):
    widths 8 / 16 / 32 with graphs up to bs 64 (H200, s23; H100, s32), the flashinfer no-speculation
    state with graphs up to bs 256 sharing the server's workspace (H100, s32), the triton one up to
    bs 64 (H200, s16): within 12 %."""
    from sglang_ddtree.verify_states import state_memory_gb
    V = 151936
    for widths, kw, logged in (([8], dict(plain_backend="flashinfer"), 0.473), ([16], {}, 0.861), ([32], {}, 1.662),
                               ([8], {}, 0.510), ([16], {}, 0.904), ([32], {}, 1.699),
                               ([1], dict(plain_max_bs=256, plain_backend="flashinfer"), 0.816),
                               ([1], dict(plain_max_bs=64, plain_backend="triton"), 0.121)):
        args = dict(vocab=V, tree_max_bs=64, plain_max_bs=64, plain_backend=None)
        args.update(kw)
        got = state_memory_gb(widths, **args)
        assert abs(got - logged) <= 0.12 * logged + 0.03, (widths, kw, got, logged)


HOPPER_DEFAULT = r'''
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt import server_args as SA
# What SGLang 0.5.16 picks on an H100/H200 (is_hopper_with_cuda_12_3): fa3, declared during argument
# resolution and written over the fields at the end of __post_init__ (materialize_declarations).
SA.ServerArgs._get_default_attn_backend = lambda self, use_mla_backend, model_config: "fa3"
models = sys.argv[1]
base = ["--model-path", f"{models}/gqa_target", "--speculative-draft-model-path", f"{models}/drafter",
        "--device", "cuda"]
out = {}
for name, extra in [("ddtree", ["--speculative-algorithm", "DDTREE-GPU"]),
                    ("dflash", ["--speculative-algorithm", "DFLASH"]),
                    ("ddtree_fa3", ["--speculative-algorithm", "DDTREE-GPU", "--attention-backend", "fa3"]),
                    ("ddtree_flashinfer", ["--speculative-algorithm", "DDTREE-GPU", "--attention-backend", "flashinfer"]),
                    ("ddtree_flashmla", ["--speculative-algorithm", "DDTREE-GPU", "--attention-backend", "flashmla"]),
                    ("ddtree_split", ["--speculative-algorithm", "DDTREE-GPU",
                                      "--prefill-attention-backend", "fa3",
                                      "--decode-attention-backend", "triton"]),
                    ("ddtree_split_decode", ["--speculative-algorithm", "DDTREE-GPU",
                                             "--prefill-attention-backend", "fa3",
                                             "--decode-attention-backend", "triton",
                                             "--speculative-attention-mode", "decode"])]:
    try:
        sa = SA.prepare_server_args(base + extra)
        out[name] = [sa.attention_backend, sa.prefill_attention_backend,
                     sa.decode_attention_backend, sa.speculative_draft_attention_backend,
                     sa.speculative_attention_mode]
    except ValueError as e:
        out[name] = "ValueError: " + str(e)
print("RESULT" + json.dumps(out))
'''


def test_default_backend_on_hopper_is_the_tree_mask_one(tiny_models):
    """On a Hopper GPU SGLang's default target backend is fa3, whose TARGET_VERIFY ignores our tree
    mask: a DDTREE-GPU launch without --attention-backend must still end with triton after the whole
    resolution (SGLang writes its declared default over the fields last).  An explicit fa3 or
    flashinfer alone keeps the prefill and moves the verify to triton (SGLang's hybrid split,
    speculative_attention_mode decode); a split whose verify side is fa3 is refused, one whose verify
    side is triton accepted; flashmla is refused.  The H200 host found the first case (the default
    ended as fa3); here SGLang's Hopper choice is simulated."""
    r = _py(HOPPER_DEFAULT.replace("sys.argv[1]", repr(tiny_models)))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert out["dflash"][0] == "fa3", out      # the simulation is what SGLang picks
    assert out["ddtree"][0] == "triton" and out["ddtree"][3] == "triton", out
    assert out["ddtree"][1] in (None, "triton") and out["ddtree"][2] in (None, "triton"), out
    for k, user in (("ddtree_fa3", "fa3"), ("ddtree_flashinfer", "flashinfer")):
        assert out[k][1:3] == [user, "triton"] and out[k][4] == "decode", out
    assert out["ddtree_split_decode"][1:3] == ["fa3", "triton"] and out["ddtree_split_decode"][4] == "decode", out
    for k, user in (("ddtree_split", "fa3"), ("ddtree_flashmla", "flashmla")):
        assert out[k].startswith("ValueError: DDTREE-GPU verifies a tree with a custom attention mask"), out
        assert f"'{user}'" in out[k] and "--attention-backend triton" in out[k]


def test_worker_refuses_a_target_that_verifies_without_the_tree_mask():
    """The worker's own guard (a resolution that was bypassed): only SGLang's TritonAttnBackend, also
    behind HybridAttnBackend's verify side, passes (torch_native stands in for fa3, whose module needs
    sgl-kernel's CUDA ops to import)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang_ddtree.verify_backend import check_tree_verify_backend

    triton_be, fa3_be = object.__new__(TritonAttnBackend), object.__new__(TorchNativeAttnBackend)
    check_tree_verify_backend(triton_be, "DDTREE-GPU")
    with pytest.raises(ValueError, match="TorchNativeAttnBackend, which does not apply the tree"):
        check_tree_verify_backend(fa3_be, "DDTREE-GPU")
    for verify_on_decode, ok in ((False, False), (True, True)):
        hybrid = object.__new__(HybridAttnBackend)
        hybrid.prefill_backend, hybrid.decode_backend = fa3_be, triton_be
        hybrid.spec_attn_is_decode = verify_on_decode
        if ok:
            check_tree_verify_backend(hybrid, "DDTREE-GPU")
        else:
            with pytest.raises(ValueError, match="launch with --attention-backend triton"):
                check_tree_verify_backend(hybrid, "DDTREE-GPU")
    wrapped = types.SimpleNamespace(full_attn_backend=fa3_be)
    with pytest.raises(ValueError):
        check_tree_verify_backend(wrapped, "DDTREE-GPU")


def test_worker_checks_the_backend_once_the_scheduler_made_it(monkeypatch):
    """The target's attn_backend does not exist while the worker is constructed (SGLang's scheduler
    makes the target's backend, then calls the draft worker's init_attention_backends): the check
    runs there, at startup, after DFlash's own initialisation."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang_ddtree.worker import DDTreeWorker

    calls = []
    monkeypatch.setattr(DFlashWorkerV2, "init_attention_backends", lambda self: calls.append("dflash"))
    w = object.__new__(DDTreeWorker)
    w.algo_name = "DDTREE-GPU"
    import torch
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.zeros(4, 2))
    runner = types.SimpleNamespace(model=types.SimpleNamespace(lm_head=head))
    w._target_worker = types.SimpleNamespace(model_runner=runner)
    runner.attn_backend = object.__new__(TritonAttnBackend)
    w.init_attention_backends()
    # SGLang's causal-only split-KV verify (gfx95, on by default at topk 1) must end up off
    runner.attn_backend.use_verify_splitkv = True
    w.init_attention_backends()
    assert runner.attn_backend.use_verify_splitkv is False
    # a quantized lm_head is refused here too, at startup (not at the first eager round)
    runner.model = types.SimpleNamespace(lm_head=types.SimpleNamespace(weight_packed=torch.zeros(4, 1)))
    with pytest.raises(ValueError, match="quantized lm_head is not supported"):
        w.init_attention_backends()
    runner.model = types.SimpleNamespace(lm_head=head)
    runner.attn_backend = object.__new__(TorchNativeAttnBackend)
    with pytest.raises(ValueError, match="launch with --attention-backend triton"):
        w.init_attention_backends()
    assert calls == ["dflash", "dflash", "dflash", "dflash"]


# ---------------------------------------------------------------- settings travel to every TP rank
def test_settings_record_roundtrip_and_disagreement():
    s = C.resolve_settings(algo="X", num_draft_tokens=17, block_size=8, vocab_size=1000, env={})
    rec = C.settings_record(s, 1000)
    assert C.settings_from_record(rec) == s and C.settings_disagreement("X", rec, s, 1000) is None
    other = C.resolve_settings(algo="X", num_draft_tokens=17, block_size=8, vocab_size=10, env={})
    msg = C.settings_disagreement("X", rec, other, 10)
    assert "top-k=10 (target vocabulary 10)" in msg and "top-k=16 (target vocabulary 1000)" in msg
    assert "differ in topk" in msg and C.ENV_TOPK in msg
    unknown = C.settings_disagreement("X", C.settings_record(other, None), s, 1000)
    assert "vocabulary unknown" in unknown


TP_SETTINGS = r'''
import copy, dataclasses, json, pickle, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang_ddtree import config as C, spec_algo
models, small = sys.argv[1], sys.argv[2]

def args(target, *extra):
    return ["--model-path", target, "--speculative-draft-model-path", f"{models}/drafter",
            "--device", "cuda", "--speculative-algorithm", "DDTREE-GPU", "--tp", "2", *extra]

def rank_copy(sa):  # what SGLang's spawned scheduler process receives (mp.Process pickles it)
    return pickle.loads(pickle.dumps(sa))

def worker(sa, vocab):
    try:
        return dataclasses.asdict(spec_algo.settings_for_worker(rank_copy(sa), algo="DDTREE-GPU",
                                                                vocab_size=vocab))
    except ValueError as e:
        return "ValueError: " + str(e)

out = {}
sa = prepare_server_args(args(f"{models}/gqa_target"))
out["tp"], out["n"], out["attn"] = sa.tp_size, sa.speculative_num_draft_tokens, sa.attention_backend
out["rec"] = getattr(sa, C.SETTINGS_ATTR)
out["deepcopy"] = getattr(copy.deepcopy(sa), C.SETTINGS_ATTR)   # the worker's drafter copy
out["ranks"] = [worker(sa, 1024), worker(sa, 1024)]
small_sa = prepare_server_args(args(small))                     # vocabulary 24 < budget 28
out["small_rec"] = getattr(small_sa, C.SETTINGS_ATTR)
out["small_ok"] = worker(small_sa, 24)
out["small_rank_differs"] = worker(small_sa, 16)
spec_algo._target_vocab_size = lambda server_args: None         # the launcher's lookup fails
failed_sa = prepare_server_args(args(small))
out["failed_rec"] = getattr(failed_sa, C.SETTINGS_ATTR)
out["failed_rank"] = worker(failed_sa, 24)
import os
os.environ[C.ENV_TOPK] = "8"                                    # the remedy: pin the top-k
pinned_sa = prepare_server_args(args(small))
out["pinned"] = worker(pinned_sa, 24)
print("RESULT" + json.dumps(out))
'''


def test_tp2_server_args_settings_travel_to_every_rank(tiny_models, tmp_path):
    """ServerArgs --tp 2 with DDTREE-GPU resolves on the CPU; the launcher's settings reach every
    (simulated) rank through pickling; a rank whose target vocabulary differs from the launcher's
    lookup raises instead of running another top-k."""
    small = tmp_path / "small_vocab_target"
    import shutil
    shutil.copytree(os.path.join(tiny_models, "gqa_target"), small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 24
    (small / "config.json").write_text(json.dumps(cfg))
    r = _py(TP_SETTINGS.replace("sys.argv[1], sys.argv[2]", f"{tiny_models!r}, {str(small)!r}"),
            env={C.ENV_TOPK: ""})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert out["tp"] == 2 and out["n"] == 29 and out["attn"] == "triton"
    want = {"budget": 28, "block_size": 8, "topk": 28}
    assert out["rec"] == dict(want, vocab_size=1024) and out["deepcopy"] == out["rec"]
    assert out["ranks"] == [want, want]
    assert out["small_rec"] == {"budget": 28, "block_size": 8, "topk": 24, "vocab_size": 24}
    assert out["small_ok"] == dict(want, topk=24)
    msg = out["small_rank_differs"]
    assert msg.startswith("ValueError: DDTREE-GPU: this rank resolved") and "top-k=16" in msg
    assert "the launcher resolved budget=28, drafter block=8, top-k=24 (target vocabulary 24)" in msg
    assert out["failed_rec"] == {"budget": 28, "block_size": 8, "topk": 28, "vocab_size": None}
    msg = out["failed_rank"]
    assert msg.startswith("ValueError:") and "top-k=24 (target vocabulary 24)" in msg
    assert "top-k=28 (target vocabulary unknown" in msg and C.ENV_TOPK in msg
    assert out["pinned"] == dict(want, topk=8)


def test_a_quantized_target_lm_head_is_refused_at_startup():
    """The drafter's top-k head multiplies with the target's lm_head.weight: a plain float head
    passes; an INT4-packed head (weight_packed + scales, no float weight), an integer weight or no
    lm_head at all is refused with a message that says so (issue 14 item 4)."""
    import torch
    from sglang_ddtree.worker import check_target_lm_head

    def model_with(head):
        m = torch.nn.Module()
        if head is not None:
            m.lm_head = head
        return m

    ok = torch.nn.Module()
    ok.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert check_target_lm_head(model_with(ok), "DDTREE-GPU") is ok
    packed = torch.nn.Module()
    packed.weight_packed = torch.nn.Parameter(torch.zeros(8, 1, dtype=torch.int32), requires_grad=False)
    packed.weight_scale = torch.nn.Parameter(torch.zeros(8, 1, dtype=torch.bfloat16))
    integer = torch.nn.Module()
    integer.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.int8), requires_grad=False)
    for head, what in ((packed, "without one"), (integer, "torch.int8"), (None, "no lm_head")):
        with pytest.raises(ValueError, match="quantized lm_head is not supported") as e:
            check_target_lm_head(model_with(head), "DDTREE-GPU")
        assert what in str(e.value)


def test_graph_mask_buffer_is_the_verify_sides():
    """Behind SGLang's prefill / decode split the graph mask buffer is the one of the side the verify
    runs on (speculative_attention_mode), not the first found: flashinfer's backend has a
    ``cuda_graph_custom_mask`` of its own."""
    from sglang_ddtree.worker import _find_graph_mask_buffer

    tri, fi = types.SimpleNamespace(cuda_graph_custom_mask="triton-buf"), types.SimpleNamespace(cuda_graph_custom_mask="fi-buf")
    decode_side = types.SimpleNamespace(prefill_backend=fi, decode_backend=tri, spec_attn_is_decode=True)
    prefill_side = types.SimpleNamespace(prefill_backend=tri, decode_backend=fi, spec_attn_is_decode=False)
    assert _find_graph_mask_buffer(decode_side) == "triton-buf"
    assert _find_graph_mask_buffer(prefill_side) == "triton-buf"
    assert _find_graph_mask_buffer(types.SimpleNamespace(full_attn_backend=decode_side)) == "triton-buf"
    assert _find_graph_mask_buffer(tri) == "triton-buf"
    assert _find_graph_mask_buffer(types.SimpleNamespace()) is None
