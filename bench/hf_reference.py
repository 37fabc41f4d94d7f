"""An fp32 reference forward of the test bed's DeepSeek-V3-layout checkpoints: Hugging Face
transformers' ``DeepseekV3ForCausalLM`` (eager attention) holding a bf16 checkpoint's weights.

The checkpoints store experts per expert (``...mlp.experts.E.{gate,up,down}_proj.weight``, as SGLang
reads them); transformers 5 keeps them fused (``experts.gate_up_proj`` ``[E, 2I, H]``,
``experts.down_proj`` ``[E, H, I]``), so :func:`build_deepseek_v3` stacks them.  Used by
``tests/test_kimi_cost.py`` (a reduced Kimi-cost copy on the CPU) and ``bench/int4_logits_check.py``
(the INT4 server's logits against the dequantized twin's fp32 function).
"""
import glob
import json
import os

import torch


def build_deepseek_v3(cfg: dict, sd: dict, device="cpu"):
    """cfg: config.json as a dict; sd: state dict with per-expert names (any float dtype, no INT4
    tensors) -> an fp32 ``DeepseekV3ForCausalLM`` in eval mode on ``device``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    conf = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    conf._attn_implementation = "eager"
    with torch.device("meta"):
        m = DeepseekV3ForCausalLM(conf)
    hf = {k: v.float().to(device) for k, v in sd.items() if ".mlp.experts." not in k}
    for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        ne = cfg["n_routed_experts"]
        hf[p + "gate_up_proj"] = torch.stack([torch.cat([sd[p + f"{e}.gate_proj.weight"], sd[p + f"{e}.up_proj.weight"]])
                                              for e in range(ne)]).float().to(device)
        hf[p + "down_proj"] = torch.stack([sd[p + f"{e}.down_proj.weight"] for e in range(ne)]).float().to(device)
    m.load_state_dict(hf, strict=True, assign=True)
    with torch.device(device):
        m.model.rotary_emb = DeepseekV3RotaryEmbedding(conf)  # its buffers were built on meta
    assert not [n for n, t in list(m.named_parameters()) + list(m.named_buffers()) if t.is_meta]
    return m.eval()


def load_deepseek_v3(model_dir: str, device="cpu"):
    """An fp32 reference model from a bf16 checkpoint folder (config.json + *.safetensors)."""
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    if "quantization_config" in cfg:
        raise ValueError(f"{model_dir}: a quantized checkpoint; pass its dequantized (bf16) twin")
    sd = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        sd.update(load_file(f))
    return build_deepseek_v3(cfg, sd, device)


@torch.no_grad()
def output_logprobs(model, prompt, tokens, device="cpu"):
    """fp32 log-softmax rows ``[len(tokens), vocab]``: row j is the distribution the model gives for
    ``tokens[j]`` after ``prompt + tokens[:j]``."""
    ids = torch.tensor([list(prompt) + list(tokens)], device=device)
    logits = model(input_ids=ids).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start:start + len(tokens)], dim=-1)
