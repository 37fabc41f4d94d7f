"""DDTree GPU kernels (Triton), one op per file; each module documents its reference."""
from . import _interpreter_compat

_interpreter_compat.apply()  # before any kernel runs under TRITON_INTERPRET (see the module)

from .accept_greedy import accept_greedy_triton
from .accept_sampled import accept_sampled_ref, accept_sampled_triton
from .commit_round import commit_round_reference, commit_round_triton
from .topk_logprobs import (topk_logprobs_torch, topk_logprobs_triton, topk_merge_triton,
                            topk_partial_triton)
from .tree_build import build_tree_triton, key_layout
from .tree_mask import tree_mask_torch, tree_mask_triton
from .verify_mask import verify_mask_size, verify_mask_torch, verify_mask_triton

__all__ = [
    "accept_greedy_triton",
    "accept_sampled_ref",
    "accept_sampled_triton",
    "build_tree_triton",
    "commit_round_reference",
    "commit_round_triton",
    "key_layout",
    "topk_logprobs_torch",
    "topk_logprobs_triton",
    "topk_merge_triton",
    "topk_partial_triton",
    "tree_mask_torch",
    "tree_mask_triton",
    "verify_mask_size",
    "verify_mask_torch",
    "verify_mask_triton",
]
