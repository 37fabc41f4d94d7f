"""Hook: ``TritonAttnBackend.init_cuda_graph_state`` (AROUND) -- a DDTREE target's verify graphs do not
allocate the decode kernel's split-KV scratch for every tree node.

Why: SGLang 0.5.16 sizes ``cuda_graph_attn_logits`` ``[max_num_tokens, H, max_kv_splits, Dv]`` fp32
(and ``cuda_graph_attn_lse``) by the graph's token rows, ``max_num_tokens = max_bs * N`` for a verify
graph, although only DECODE / IDLE forwards read them; a TARGET_VERIFY forward runs
``extend_attention_fwd``, which takes no split-KV scratch.  For absorbed MLA the split count is raised
to ``min(next_pow2(SMs), next_pow2(context / 32))`` (128 on an H200 at a 4k context), so at Kimi K2's
widths (64 heads, Dv = kv_lora_rank 512) each row costs 16.8 MB: a budget-16 tree at max bs 64 holds
18 GB of scratch no kernel reads, budget 31 holds 34 GB, and the adaptive budget, which builds one
backend per width (``sglang_ddtree/policy/adaptive.py``), holds their sum -- its A/B arm did not start on the
Kimi-cost pair (``bench/results/raw/ab_h200_kimicost_auto_oom.md``: CUDA OOM at graph capture,
stock DFLASH and fixed budget 16 at the same settings started).

What it does, for the DDTREE target's backends only (not the drafter's, not other algorithms, not
sliding-window models): SGLang's own ``init_cuda_graph_state`` runs with the split count at 1 for
those two buffers, then they are replaced by buffers of the size the backend can use:
``max_bs`` decode rows at the real split count, or, with our verify attention on
(``SGLANG_DDTREE_VERIFY_ATTN=ddtree``, which takes its fp32 workspace from them:
``sglang_ddtree/verify_attn_hook.py``), ``max_num_tokens`` rows x its own split count + 1, whichever
is larger.  The per-width backends of the adaptive budget share one such buffer (the largest asked
for; verify graphs replay one at a time on one stream).  ``cuda_graph_num_kv_splits`` is refilled
with the real split count.  Everything else (KV indices, the FULL_MASK buffer) is SGLang's.

Checked against: SGLang 0.5.16 (``sglang/srt/layers/attention/triton_backend.py``:
``init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf=None,
cuda_graph_num_kv_splits_buf=None)`` at line 928; ``cuda_graph_attn_logits`` / ``_lse`` read only
by the DECODE / IDLE branches of ``_build_cuda_graph_forward_metadata`` and
``init_forward_metadata_out_graph``; ``_mla_decode_kv_splits_cap``).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_cuda_graph_state"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)

# device -> (logits flat, lse flat): the largest scratch handed out so far, shared by later backends
_SHARED: Dict[str, Tuple[object, object]] = {}


def _server_args():
    from sglang.srt.runtime_context import get_server_args

    return get_server_args()


def applies(backend, max_bs: int, max_num_tokens: int) -> bool:
    """True for a DDTREE target backend's verify graph state (rows > max_bs) that this hook shrinks."""
    from sglang_ddtree.reservation import ddtree_shape

    if max_num_tokens <= max_bs or getattr(backend, "is_draft_runner", True):
        return False
    if getattr(backend, "skip_prefill", False) or getattr(backend, "swa_v_head_dim", None) is not None:
        return False
    if (getattr(backend, "sliding_window_size", None) or 0) > 0:
        return False
    try:
        sa = _server_args()
    except Exception:  # no runtime context: leave SGLang's sizing alone
        return False
    return ddtree_shape(sa) is not None


def scratch_rows(backend, max_bs: int, max_num_tokens: int) -> Tuple[int, int]:
    """(numel of attn_logits, numel of attn_lse) this backend can use: decode rows at its split count,
    or our verify attention's workspace (all verify rows, its split count + 1) when that is on."""
    from sglang_ddtree.verify_attn_hook import state_of

    H, DV, S = int(backend.num_head), int(backend.v_head_dim), int(backend.max_kv_splits)
    n_o, n_l = max_bs * H * S * DV, max_bs * H * S
    state = state_of(backend)
    if state is not None:
        ns = int(state.num_splits) + 1
        n_o, n_l = max(n_o, max_num_tokens * H * ns * DV), max(n_l, max_num_tokens * H * ns)
    return n_o, n_l


def _shared_flat(device, n_o: int, n_l: int):
    import torch

    key = str(device)
    have = _SHARED.get(key)
    if have is not None and have[0].numel() >= n_o and have[1].numel() >= n_l:
        return have
    n_o = max(n_o, 0 if have is None else have[0].numel())
    n_l = max(n_l, 0 if have is None else have[1].numel())
    got = (torch.zeros(n_o, dtype=torch.float32, device=device),
           torch.zeros(n_l, dtype=torch.float32, device=device))
    _SHARED[key] = got
    return got


def init_cuda_graph_state_ddtree(original, self, max_bs, max_num_tokens, *args, **kwargs):
    if not applies(self, int(max_bs), int(max_num_tokens)):
        return original(self, max_bs, max_num_tokens, *args, **kwargs)
    splits = self.max_kv_splits
    self.max_kv_splits = 1     # SGLang's per-row scratch at one split: [rows, H, 1, Dv]
    try:
        out = original(self, max_bs, max_num_tokens, *args, **kwargs)
    finally:
        self.max_kv_splits = splits
    H, DV = int(self.num_head), int(self.v_head_dim)
    n_o, n_l = scratch_rows(self, int(max_bs), int(max_num_tokens))
    row_o, row_l = H * splits * DV, H * splits    # whole decode rows, so the view holds all of n_o
    n_o, n_l = -(-n_o // row_o) * row_o, -(-n_l // row_l) * row_l
    flat_o, flat_l = _shared_flat(self.device, n_o, n_l)
    rows_o, rows_l = flat_o.numel() // row_o, flat_l.numel() // row_l
    self.cuda_graph_attn_logits = flat_o[: rows_o * row_o].view(rows_o, H, splits, DV)
    self.cuda_graph_attn_lse = flat_l[: rows_l * row_l].view(rows_l, H, splits)
    passed = kwargs.get("cuda_graph_num_kv_splits_buf", args[1] if len(args) > 1 else None)
    if passed is None:  # SGLang's own buffer, filled with the split count of the call (1): refill
        self.cuda_graph_num_kv_splits.fill_(splits)
    return out


def saved_bytes(num_head: int, v_head_dim: int, splits: int, max_bs: int, width: int,
                vattn_splits: Optional[int] = None) -> int:
    """Bytes of fp32 scratch SGLang would allocate minus what this hook allocates, one backend."""
    rows = max_bs * width
    sglang = rows * num_head * splits * (v_head_dim + 1) * 4
    ours_rows = max(max_bs * splits, 0 if vattn_splits is None else rows * (vattn_splits + 1))
    return sglang - ours_rows * num_head * (v_head_dim + 1) * 4


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, init_cuda_graph_state_ddtree, HookType.AROUND)
