"""Hook: ``TokenizerManager._validate_one_request`` (AROUND) -- reject token ids outside the vocabulary.

Why: a request whose ``input_ids`` holds an id ``< 0`` or ``>= vocab_size`` reaches the target's
embedding lookup in prefill, where the GPU index check asserts (``vectorized gather kernel index
out of bounds``): the CUDA context is lost, the scheduler dies, and every later request is refused.
SGLang 0.5.16 has a ``TokenizerManager._validate_input_ids_in_vocab`` but never calls it (and it
would not catch negative ids).  This hook runs where SGLang validates every generate request
(after tokenisation, before the request is sent to the scheduler, for ``/generate``,
``/v1/completions`` with token-id prompts and ``Engine.generate``), so a bad id is answered with
SGLang's own ``ValueError`` path: an HTTP 400 with the message, or a ValueError from
``Engine.generate``; no forward ever sees it.

It guards every generation request of a server that has the plugin installed, whatever the
speculative algorithm (plain decoding dies the same way; see ``bench/results/soak_h200.md``), and
costs one ``min`` / ``max`` over the ids.

Checked against: SGLang 0.5.16 (``sglang/srt/managers/tokenizer_manager.py``:
``_validate_one_request(self, obj, input_ids)``, called from ``_tokenize_one_request`` and
``_batch_tokenize_and_process``).
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def check_input_ids(input_ids, vocab_size: int) -> None:
    """Raise ValueError unless every element of ``input_ids`` (a flat sequence) is an int (not a
    bool) in ``[0, vocab_size)``.  ``None`` (embedding inputs) and empty lists pass."""
    if input_ids is None or vocab_size is None or len(input_ids) == 0:
        return
    if not all(type(x) is int for x in input_ids):
        bad = next(x for x in input_ids if type(x) is not int)
        raise ValueError(f"input_ids must be integers; got {bad!r} ({type(bad).__name__})")
    lo, hi = min(input_ids), max(input_ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        pos = list(input_ids).index(bad)
        raise ValueError(f"input_ids[{pos}] = {bad} is outside the vocabulary: token ids must be in "
                         f"[0, {vocab_size})")


def validate_one_request_with_vocab(original, self, obj, input_ids, *args, **kwargs):
    model_config = getattr(self, "model_config", None)
    vocab_size = getattr(model_config, "vocab_size", None)
    if getattr(self, "is_generation", True) and input_ids is not None:
        check_input_ids(input_ids, vocab_size)
    return original(self, obj, input_ids, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, validate_one_request_with_vocab, HookType.AROUND)
