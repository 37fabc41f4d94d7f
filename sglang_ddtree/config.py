"""DDTree settings: what the tree looks like, where each number comes from, and what is rejected.

SGLang 0.5.16 has no hook for new CLI flags, so DDTree reuses existing ones:

* ``--speculative-num-draft-tokens N`` = the verify width = ``budget + 1`` tree slots (the root is the
  previous round's bonus token); unset: :func:`default_budget` of the drafter's block.
* the draft depth comes from the drafter: ``block_size - 1`` (its ``dflash_config.block_size``, or
  ``--speculative-dflash-block-size``).
* ``SGLANG_DDTREE_TOPK``: per-depth top-k.  Default ``min(budget, vocab)``: the exact DDTree
  semantics (a best-first tree of ``budget`` nodes can use rank ``budget - 1`` at depth 1), so the
  tree equals the reference heap's on the full distribution.  Lower it only to save top-k time.

Everything here is plain Python (no torch, no SGLang) so the checks run anywhere, in the launcher
process, before a GPU is touched.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

ENV_TOPK = "SGLANG_DDTREE_TOPK"

MIN_BUDGET = 1
MAX_BUDGET = 256          # the tree kernels are checked up to 256 nodes
MAX_TOPK = 256            # the top-k kernel is checked up to k = 256
MAX_KEY_WORDS = 4         # rank paths packed in <= 4 int64 words (kernels/tree_build.key_layout)
# Target attention backends whose TARGET_VERIFY path applies an arbitrary (tree) mask, eager and on
# CUDA-graph replay, and that the lossless matrix checked (bench/results/worker_h200.md).
SUPPORTED_TARGET_BACKENDS = ("triton",)


@dataclasses.dataclass(frozen=True)
class DDTreeSettings:
    """budget: tree nodes besides the root; block_size: drafter block (root + depth positions);
    topk: per-depth top-k; vocab_size: the target vocabulary (bounds topk)."""

    budget: int
    block_size: int
    topk: int

    @property
    def num_verify_tokens(self) -> int:
        """N = budget + 1: the target verify width (root included)."""
        return self.budget + 1

    @property
    def draft_depth(self) -> int:
        """D = block_size - 1: drafted positions per round (the tree's maximum depth)."""
        return self.block_size - 1


def default_budget(block_size: int) -> int:
    """4 candidates per drafted depth, at most 64: the verify width stays <= 65 tokens/request."""
    return max(MIN_BUDGET, min(64, 4 * (block_size - 1)))


def _key_words(depth: int, k: int) -> int:
    bits = max(1, int(k).bit_length())
    return max(1, -(-depth // (62 // bits)))


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def resolve_settings(*, algo: str, num_draft_tokens: Optional[int], block_size: Optional[int],
                     vocab_size: Optional[int] = None,
                     env: Optional[Mapping[str, str]] = None) -> DDTreeSettings:
    """Turn the server arguments + environment into checked settings, or raise ValueError.

    num_draft_tokens: ``--speculative-num-draft-tokens`` (None = not given); block_size: the
    drafter's block size (None = unknown); vocab_size: the target vocabulary, if known.
    """
    env = os.environ if env is None else env
    if block_size is None:
        raise ValueError(
            f"{algo}: the drafter's block size is unknown: the draft model's config.json has no "
            "dflash_config.block_size / block_size; pass --speculative-dflash-block-size")
    block_size = int(block_size)
    if block_size < 2:
        raise ValueError(f"{algo}: the drafter's block size must be >= 2 (root + at least one "
                         f"drafted position), got {block_size}")
    if num_draft_tokens is not None:
        n = int(num_draft_tokens)
        if n < MIN_BUDGET + 1:
            raise ValueError(
                f"{algo}: --speculative-num-draft-tokens is the verify width = tree budget + 1 "
                f"(root included) and must be >= {MIN_BUDGET + 1}, got {n}")
        budget = n - 1
    else:
        budget = default_budget(block_size)
    if not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise ValueError(f"{algo}: the tree budget must be in [{MIN_BUDGET}, {MAX_BUDGET}] nodes "
                         f"(verify width budget + 1), got {budget}")
    # any budget works with any drafter block: a round may touch max(2N, N + B) KV slots past the
    # committed length, and the hooks of sglang_ddtree/reservation.py make SGLang reserve that
    env_k = _env_int(env, ENV_TOPK)
    k = env_k if env_k is not None else budget
    if vocab_size is not None:
        k = min(k, int(vocab_size)) if env_k is None else k
        if k > int(vocab_size):
            raise ValueError(f"{algo}: {ENV_TOPK}={k} exceeds the vocabulary size {vocab_size}")
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(f"{algo}: {ENV_TOPK} must be in [1, {MAX_TOPK}], got {k}")
    words = _key_words(block_size - 1, k)
    if words > MAX_KEY_WORDS:
        raise ValueError(
            f"{algo}: draft depth {block_size - 1} with top-k {k} needs {words} rank-path key "
            f"words (the tree kernel packs at most {MAX_KEY_WORDS}); lower {ENV_TOPK}")
    return DDTreeSettings(budget=budget, block_size=block_size, topk=k)


# ------------------------------------------------------------------ settings that travel to every rank
# The launcher resolves the settings once (spec_algo.handle_server_args) and stores this record on
# server_args, which SGLang pickles into every scheduler process (one per TP rank).  Each rank
# resolves again from its own model config and must agree with it (settings_disagreement).
SETTINGS_ATTR = "_ddtree_settings"


def settings_record(settings: DDTreeSettings, vocab_size: Optional[int]) -> dict:
    """A plain, picklable record of resolved settings and the target vocabulary they saw."""
    return {"budget": settings.budget, "block_size": settings.block_size, "topk": settings.topk,
            "vocab_size": None if vocab_size is None else int(vocab_size)}


def settings_from_record(record: Mapping) -> DDTreeSettings:
    return DDTreeSettings(budget=int(record["budget"]), block_size=int(record["block_size"]),
                          topk=int(record["topk"]))


def _describe(settings: DDTreeSettings, vocab_size: Optional[int]) -> str:
    vocab = "unknown (its config could not be read)" if vocab_size is None else vocab_size
    return (f"budget={settings.budget}, drafter block={settings.block_size}, "
            f"top-k={settings.topk} (target vocabulary {vocab})")


def settings_disagreement(algo: str, launcher: Mapping, local: DDTreeSettings,
                          local_vocab: Optional[int], where: str = "this rank") -> Optional[str]:
    """None when ``local`` equals the launcher's record, else the error message."""
    theirs = settings_from_record(launcher)
    if theirs == local:
        return None
    fields = [f for f in ("budget", "block_size", "topk") if getattr(theirs, f) != getattr(local, f)]
    return (f"{algo}: {where} resolved {_describe(local, local_vocab)} but the launcher resolved "
            f"{_describe(theirs, launcher.get('vocab_size'))}; they differ in {', '.join(fields)}. "
            f"Every TP rank must build the same tree: pin the values with "
            f"--speculative-num-draft-tokens and {ENV_TOPK}")
