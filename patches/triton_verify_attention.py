"""Hook: ``TritonAttnBackend.forward_extend`` (AROUND) -- the target's TARGET_VERIFY attention runs our
tree-verify kernel with the round's bitmask (issue 13 item 2; the default where it covers the target:
``SGLANG_DDTREE_VERIFY_ATTN=auto``, ``ddtree`` to require it, ``sglang`` for SGLang's own path).

Why: SGLang 0.5.16's triton backend verifies a tree with ``extend_attention_fwd`` and a FULL_MASK
custom mask (``N x (prefix + N)`` bytes per request, written each round), one program per (request,
q head, query block), every q head re-reading the prefix.  ``kernels/tree_verify_attention.py``
reads each prefix KV block once per KV head (split-KV, no prefix mask) and the N x N tail from
``Tree.mask_words``.  With the switch on the worker attaches a state (persistent bitmask buffer
``[max_bs, N, ceil(N/32)] int32``) to the backend the *target's* verify runs on
(``sglang_ddtree.verify_attn_hook.enable``, start-up, ValueError when not covered), writes the
round's mask words into it before the verify and builds no FULL_MASK.  This hook runs
``verify_attn_hook.forward_tree_verify`` for a TARGET_VERIFY batch on a backend with that state: it
writes the tree's K/V into the cache with the same ``_set_kv_buffer`` call SGLang makes (so the
accept / commit after it is unchanged), then ``tree_verify_attention`` (GQA / MHA) or
``tree_verify_attention_mla`` (absorbed MLA: q = cat(q_nope W_kc, q_pe), one latent cache
``[S, 1, kv_lora_rank + rope]``) from the cache.  Every other call -- the drafter's backend (it runs
TARGET_VERIFY too, on its own backend object, which never carries the state), prefill, decode,
other algorithms -- goes to SGLang's ``forward_extend`` unchanged (with ``sglang`` no backend
carries a state, so every call does).

The drafter's block (the A/B switch ``draft_attn=auto|ddtree``, off by default; not yet served on
the GPU): the worker may also attach a state to the drafter's backend, with every bit of its
``[max_bs, block, ceil(block/32)]`` bitmask set once at start-up.  The drafter's block forward is a
TARGET_VERIFY on that backend whose layers are ENCODER_ONLY (SGLang runs ``extend_attention_fwd``
with causal off and no mask: each block query sees the whole context and the whole block), so this
same hook serves it with that bitmask.  At 32k-token prompts that forward costs 11.5 ms a round in
SGLang's kernel (``bench/results/scale_h200.md`` run 14).

CUDA graphs: the target's verify graphs are captured after ``enable`` (SGLang initialises every
backend, then captures), so the captured kernel reads the state's bitmask rows ``[:graph bs]``,
the graph's static ``seq_lens`` / ``req_pool_indices``, ``req_to_token``, the KV cache; its split
count is a host int fixed at start-up; its fp32 workspace is a view of the backend's
``cuda_graph_attn_logits`` / ``cuda_graph_attn_lse`` (decode-only buffers, idle in a verify).

Covered (else ValueError at start-up): SGLang's TritonAttnBackend (also behind HybridAttnBackend's
verify side), page size 1, bf16 / fp16 / fp32 KV cache, no KV scales, no logit cap, no sliding
window / SWA pool, no unified virtual-slot pool, no DCP, not deterministic mode, decoder-only
layers.  Not covered: flashinfer / fa3 / flashmla / trtllm_mla (lifting the triton-only refusal
needs this hook on their ``forward_extend`` / verify entry, with their KV layouts and graph
metadata: issue 13 item 2, next step).

Tested: on the CPU (``tests/test_verify_attn_hook*.py``: SGLang's real forward_extend, the kernel
under the Triton interpreter, against SGLang's own masked path and the torch reference) and served
on the H200 under CUDA graphs (``_vattn`` stages, ``bench/results/worker_h200_run10.md``: GQA b16,
MLA b16 / b64 exact; the text pair's divergences all near ties, also with the tree-mask patch off;
``bench/results/kimicost_h200.md``: Kimi K2 widths, INT4 Marlin experts, exact).  Not yet served
eagerly on the GPU.  Its fp32 workspace comes from the backend's decode scratch, which
``patches/triton_cuda_graph_state.py`` sizes for it.

Checked against: SGLang 0.5.16 (``sglang/srt/layers/attention/triton_backend.py``:
``TritonAttnBackend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None,
score_mod=None, aux_tensors=None)`` at line 1207, its KV write through ``_set_kv_buffer`` /
``KVWriteLoc``; ``init_forward_metadata`` / ``_update_target_verify_buffers`` for TARGET_VERIFY;
``models/deepseek_common/attention_forward_methods/forward_mla.py``: the triton MLA verify calls
``attn_mqa(cat(q_nope_out, q_pe), cat(k_nope, k_pe), k_nope)``).
"""
from __future__ import annotations

TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def tree_verify_forward_extend(original, self, *args, **kwargs):
    from sglang_ddtree.verify_attn_hook import forward_tree_verify, state_of

    state = state_of(self)
    if state is None:
        return original(self, *args, **kwargs)
    fb = args[4] if len(args) > 4 else kwargs["forward_batch"]
    if not fb.forward_mode.is_target_verify():
        return original(self, *args, **kwargs)
    return forward_tree_verify(state, self, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # Installed in every process (also with SGLANG_DDTREE_VERIFY_ATTN=sglang: the A/B's draft_attn
    # switch may be applied by a plugin that runs after this one); a backend without our state -- the
    # only kind there is then -- goes to SGLang's forward_extend unchanged.
    HookRegistry.register(TARGET, tree_verify_forward_extend, HookType.AROUND)
