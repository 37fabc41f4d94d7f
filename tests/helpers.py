"""Input generators shared by the tests and the benchmarks: peaked, tie-heavy drafter-like data;
and a loader for the bench/ scripts (they are scripts, not a package)."""
import importlib.util
import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Clock:
    """A host clock the test advances (``ms``); called, it returns seconds."""

    def __init__(self):
        self.ms = 0.0

    def __call__(self):
        return self.ms / 1e3


def load_bench(name):
    """bench/<name>.py as a fresh module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def env_without_checkout(**extra):
    """os.environ (+ extra) for a fresh interpreter: its PYTHONPATH keeps what installs SGLang and the
    package (the GPU host's kit) but never the checkout root, whose kernels/ would shadow Hugging
    Face's ``kernels`` that SGLang imports."""
    e = dict(os.environ, **extra)
    e["PYTHONPATH"] = os.pathsep.join(p for p in e.get("PYTHONPATH", "").split(os.pathsep)
                                      if p and os.path.abspath(p) != REPO)
    return e


def drafter_logits(bs, D, V, generator, dtype=torch.bfloat16, peak=8.0, scale=2.0, neg_inf_frac=0.0):
    """Logits shaped like a drafter's: N(0, scale^2) plus a few boosted tokens per row, rounded to
    ``dtype`` (bf16 makes exact ties common).  ``neg_inf_frac`` of the vocabulary is set to -inf."""
    x = torch.randn(bs, D, V, generator=generator) * scale
    n_hot = min(4, V)
    hot = torch.randint(0, V, (bs, D, n_hot), generator=generator)
    boost = torch.rand(bs, D, n_hot, generator=generator) * peak
    x.scatter_add_(2, hot, boost)
    if neg_inf_frac > 0:
        dead = torch.rand(bs, D, V, generator=generator) < neg_inf_frac
        dead[..., 0] = False  # keep every row a distribution
        x = x.masked_fill(dead, float("-inf"))
    return x.to(dtype)


def logprobs_from_logits(logits, k):
    """Exact top-k log-probs via the torch reference (stable sort: ties by smaller id)."""
    from sglang_ddtree.kernels.topk_logprobs import topk_logprobs_torch
    lp, ids = topk_logprobs_torch(logits, k)
    return lp.contiguous(), ids.contiguous()


def tie_heavy_logprobs(bs, D, K, generator, levels=6, neg_inf_frac=0.0):
    """Sorted log-prob rows drawn from a few distinct values (many exact ties), random ids."""
    vals = -torch.randint(0, levels, (bs, D, K), generator=generator).float() * 0.5
    vals = vals - torch.rand(bs, D, 1, generator=generator).round(decimals=1)
    if neg_inf_frac > 0:
        vals = vals.masked_fill(torch.rand(bs, D, K, generator=generator) < neg_inf_frac, float("-inf"))
    vals, _ = torch.sort(vals, dim=-1, descending=True)
    ids = torch.stack([torch.stack([torch.randperm(max(K, 50), generator=generator)[:K]
                                    for _ in range(D)]) for _ in range(bs)])
    return vals.contiguous(), ids.to(torch.int64).contiguous()


def assert_sglang_reads_int4(model_dir, *, attn_layer, dense_layer, shared_layer, moe_layers):
    """SGLang 0.5.16 (CPU) reads ``model_dir`` as compressed-tensors W4A16: every non-expert linear of its
    DeepseekV2 module names (attention of ``attn_layer``, the dense MLP of ``dense_layer``, the shared
    experts of ``shared_layer``, lm_head) stays unquantized, and the experts of ``moe_layers`` (two
    layer ids) get the Marlin scheme under --moe-runner-backend auto and the Triton one under triton."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    mc = ModelConfig(model_dir)
    assert mc.quantization == "compressed-tensors"
    cfg = CompressedTensorsConfig.from_config(mc.hf_config.quantization_config)
    lin = torch.nn.Linear(2, 2)
    a, d, s = (f"model.layers.{i}." for i in (attn_layer, dense_layer, shared_layer))
    for name in [a + "self_attn.fused_qkv_a_proj_with_mqa", a + "self_attn.q_b_proj", a + "self_attn.kv_b_proj",
                 a + "self_attn.o_proj", d + "mlp.gate_up_proj", d + "mlp.down_proj",
                 s + "mlp.shared_experts.gate_up_proj", s + "mlp.shared_experts.down_proj", "lm_head"]:
        assert cfg.get_scheme_dict(lin, name) is None, name
    fused_moe = type("FusedMoE", (torch.nn.Module,), {})
    flags = moe_utils.get_flags().moe
    saved = flags.runner_backend
    try:
        flags.runner_backend = moe_utils.MoeRunnerBackend.AUTO
        got = type(cfg.get_moe_scheme(fused_moe(), f"model.layers.{moe_layers[0]}.mlp.experts")).__name__
        assert got == "CompressedTensorsWNA16MoE", got
        flags.runner_backend = moe_utils.MoeRunnerBackend.TRITON
        got = type(cfg.get_moe_scheme(fused_moe(), f"model.layers.{moe_layers[1]}.mlp.experts")).__name__
        assert got == "CompressedTensorsWNA16TritonMoE", got
    finally:
        flags.runner_backend = saved
