"""Every configs/*.yaml parses into sglang ServerArgs on a CPU-only machine (no GPU, no weights).

The YAML goes through SGLang's own path (`prepare_server_args(["--config", f, ...])`: its
ConfigArgumentMerger turns keys into CLI flags, argparse rejects unknown ones, and
ServerArgs.__post_init__ runs its checks, including the DFLASH hook that reads the drafter's
config.json for the block size).  Model weights are never loaded.  For DDTREE-* configs, the
settings resolved at argument handling are re-checked on each of the tp_size (simulated) ranks.
Model paths that do not exist here are replaced, on the command line (CLI beats config), by local
config-only stand-ins:
  * /tmp/models/* (the test bed's tiny pairs): bench/device/mk_models.py --configs-only;
  * Hugging Face ids / absent local paths: config.json files with the real architecture's
    shapes (Qwen3-8B; Kimi K2.6 as its DeepSeek-V3 text model) and DFlash drafter configs.
`--device cuda` is passed because ServerArgs otherwise probes for an accelerator.
Skips only when sglang is not importable.
"""
import glob
import json
import os
import pickle
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml")
server_args_mod = pytest.importorskip("sglang.srt.server_args")
# DDTREE-* configs need the project's plugin registered in this process, as SGLang's launcher does
pytest.importorskip("sglang.srt.plugins").load_plugins()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))

QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=151643,
    eos_token_id=151645,
)
QWEN3_8B_DFLASH = dict(
    QWEN3_8B, architectures=["DFlashDraftModel"], num_hidden_layers=5, num_target_layers=36,
    block_size=16, dflash_config={"block_size": 16, "target_layer_ids": [1, 9, 17, 25, 33],
                                  "mask_token_id": 151669},
)
KIMI_TEXT = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=163840,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
    num_experts_per_tok=8, routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="noaux_tc", n_group=1,
    topk_group=1, first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=True,
    scoring_func="sigmoid", hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-5,
    rope_theta=50000.0, tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=163584,
    eos_token_id=163585,
)
KIMI_DFLASH = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=163840, hidden_size=7168,
    intermediate_size=18432, num_hidden_layers=5, num_attention_heads=64, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-5, rope_theta=50000.0,
    hidden_act="silu", torch_dtype="bfloat16", num_target_layers=61, block_size=16,
    dflash_config={"block_size": 16, "target_layer_ids": [1, 15, 30, 45, 59], "mask_token_id": 163838},
)


def _write(d, cfg):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("standins")
    tiny = root / "tiny"
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "device", "mk_models.py"), str(tiny),
                    "--configs-only"], check=True, capture_output=True)
    m = {
        "/tmp/models/gqa_target": str(tiny / "gqa_target"),
        "/tmp/models/mla_target": str(tiny / "mla_target"),
        "/tmp/models/drafter": str(tiny / "drafter"),
        "Qwen/Qwen3-8B": _write(str(root / "qwen3_8b"), QWEN3_8B),
        "z-lab/Qwen3-8B-DFlash-b16": _write(str(root / "qwen3_8b_dflash"), QWEN3_8B_DFLASH),
        "moonshotai/Kimi-K2.6": _write(str(root / "kimi_k26"), KIMI_TEXT),
        "/models/Kimi-K2.6-DFlash": _write(str(root / "kimi_k26_dflash"), KIMI_DFLASH),
    }
    return m


def _local(path, standins):
    if path in standins:
        return standins[path]
    assert os.path.isdir(path), f"no stand-in for model path {path!r}: add one to tests/test_configs.py"
    return path


def test_configs_exist():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {"tiny_gqa_dflash.yaml", "tiny_mla_dflash.yaml", "qwen3_8b_dflash.yaml",
            "kimi_k26_tp8_dflash.yaml", "tiny_gqa_ddtree.yaml", "tiny_mla_ddtree.yaml",
            "qwen3_8b_ddtree.yaml", "kimi_k26_tp8_ddtree.yaml"} <= names


@pytest.mark.parametrize("cfg", CONFIGS, ids=[os.path.basename(c) for c in CONFIGS])
def test_config_parses_into_server_args(cfg, standins):
    raw = yaml.safe_load(open(cfg))
    assert isinstance(raw, dict) and raw
    argv = ["--config", cfg, "--device", "cuda", "--model-path", _local(raw["model-path"], standins)]
    if raw.get("speculative-draft-model-path"):
        argv += ["--speculative-draft-model-path", _local(raw["speculative-draft-model-path"], standins)]
    sa = server_args_mod.prepare_server_args(argv)
    assert isinstance(sa, server_args_mod.ServerArgs)
    # every scalar key of the file reached ServerArgs unchanged (paths were replaced above)
    skip = {"model-path", "speculative-draft-model-path", "cuda-graph-config"}
    for k, v in raw.items():
        if k in skip:
            continue
        attr = k.replace("-", "_")
        assert hasattr(sa, attr), f"{k}: ServerArgs has no field {attr}"
        got = getattr(sa, attr)
        assert str(got).lower() == str(v).lower(), f"{k}: config {v!r} -> ServerArgs {got!r}"
    # 0.5.16 folds the CUDA-graph settings into cuda_graph_config (one PhaseConfig per phase)
    cg = raw.get("cuda-graph-config") or {}
    for phase, settings in cg.items():
        for key, val in settings.items():
            got = getattr(getattr(sa.cuda_graph_config, phase), key)
            assert str(getattr(got, "value", got)).lower() == str(val).lower(), (phase, key, got)
    if raw.get("speculative-algorithm") == "DFLASH":
        assert sa.speculative_num_steps == 1 and sa.speculative_eagle_topk == 1
        assert sa.speculative_num_draft_tokens == raw.get("speculative-num-draft-tokens",
                                                          sa.speculative_num_draft_tokens)
    if raw.get("speculative-algorithm", "").startswith("DDTREE"):
        # verify width = budget + 1 as written (else the drafter's default widest); the drafter sets
        # the depth; the tree verify is on triton (with flashinfer given: SGLang's prefill / decode split)
        if "speculative-num-draft-tokens" in raw:
            assert sa.speculative_num_draft_tokens == raw["speculative-num-draft-tokens"]
        assert sa.speculative_num_steps == 1 and sa.speculative_eagle_topk == 1
        assert (sa.decode_attention_backend or sa.attention_backend) == "triton"   # the verify's side
        if raw.get("attention-backend") not in (None, "triton"):   # the user's backend keeps the prefill
            from sglang_ddtree.spec_algo import SPLIT_ATTR
            assert sa.prefill_attention_backend == raw["attention-backend"] and getattr(sa, SPLIT_ATTR)
        # the settings resolved here travel to every TP rank on server_args (pickled into each
        # scheduler process); each rank re-resolves from its model's vocabulary and must agree
        from sglang_ddtree import config as C
        from sglang_ddtree.spec_algo import settings_for_worker

        rec = getattr(sa, C.SETTINGS_ATTR)
        with open(os.path.join(sa.model_path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        assert rec["budget"] + 1 == sa.speculative_num_draft_tokens and rec["vocab_size"] == vocab
        for _ in range(sa.tp_size):
            rank_args = pickle.loads(pickle.dumps(sa))
            assert settings_for_worker(rank_args, algo=sa.speculative_algorithm,
                                       vocab_size=vocab) == C.settings_from_record(rec)
