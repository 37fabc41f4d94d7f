"""Hook: ``Req.update_finish_state`` (AROUND) -- a stop inside a multi-token commit wins over the length limit.

Why: a speculative round commits several tokens at once.  SGLang 0.5.16 checks
``len(output_ids) >= max_new_tokens`` *before* the stop strings / stop tokens of the newly accepted
tokens, so when one round both reaches ``max_new_tokens`` and contains a stop string (or stop
token id, or EOS) before that limit, the request finishes by LENGTH with the stop and the tokens
after it kept.  Plain decoding appends one token per step and would have stopped at the stop: the
outputs differ (found by the soak, ``bench/results/soak_h200.md``: one greedy request, stop
strings, max_new_tokens 6).  For DDTREE algorithms this hook runs the stop checks on the accepted
block first, and keeps their verdict when the stop lies before ``max_new_tokens``; otherwise
SGLang's own order applies.  Other algorithms are untouched (stock DFLASH keeps SGLang's
behaviour).

Checked against: SGLang 0.5.16 (``sglang/srt/managers/schedule_batch.py``,
``Req.update_finish_state(self, new_accepted_len=1)``; called by
``scheduler_components/batch_result_processor.py`` with the round's committed token count).
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.schedule_batch.Req.update_finish_state"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)

_active = None


def _ddtree_server() -> bool:
    """Whether this process serves a DDTREE algorithm (cached after the first answer)."""
    global _active
    if _active is None:
        try:
            from sglang.srt.runtime_context import get_server_args
            algo = get_server_args().speculative_algorithm
        except Exception:  # noqa: BLE001 - no server args yet: leave SGLang's behaviour
            return False
        from sglang_ddtree.spec_algo import is_ddtree
        _active = is_ddtree(algo)
    return _active


def update_finish_state_stop_first(original, self, new_accepted_len: int = 1, *args, **kwargs):
    max_new = self.sampling_params.max_new_tokens
    if (new_accepted_len <= 1 or self.finished() or self.to_finish is not None
            or getattr(self, "grammar", None) is not None or max_new is None
            or len(self.output_ids) < max_new or not _ddtree_server()):
        return original(self, new_accepted_len, *args, **kwargs)
    new_tokens = self.output_ids[-new_accepted_len:]
    if self._check_str_based_finish(new_accepted_len) or self._check_token_based_finish(new_tokens):
        if self.finished_len is not None and self.finished_len < max_new:
            return None                  # stopped inside the block, as plain decoding would
        # the stop lies at or past the limit: plain decoding checks the length first there
        self.finished_reason, self.finished_len = None, None
    return original(self, new_accepted_len, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, update_finish_state_stop_first, HookType.AROUND)
