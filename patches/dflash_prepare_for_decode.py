"""Hook: ``DFlashDraftInputV2.prepare_for_decode`` (AROUND) -- reserve max(2N, N + B) KV slots, not 2N.

Why: the spec-v2 DFlash family pre-allocates, each round, ``req_to_token`` entries up to
``committed + 2 x speculative_num_draft_tokens``.  For DDTREE that field is the verify width N,
while the drafter writes its block B from a prefix up to one round ahead of the host's view
(``sglang_ddtree/reservation.py`` derives it): with N < B (a small budget with a deep drafter) the
drafter's last writes land past the reservation, in entries other requests or the radix cache own.
For DDTREE servers with N < B this hook runs SGLang's own function with a server-args view whose
``speculative_num_draft_tokens`` is ``ceil(max(2N, N + B) / 2)``, so it reserves
``committed + max(2N, N + B)`` (and records that bound in ``reserved_seq_lens_cpu``).  N >= B and
every other algorithm: untouched.

Checked against: SGLang 0.5.16 (``sglang/srt/speculative/dflash_info_v2.py``: ``prepare_for_decode``
reads the block width only as ``get_server_args().speculative_num_draft_tokens``).
"""
from __future__ import annotations

TARGET = "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2.prepare_for_decode"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


class _WidthView:
    """server_args with speculative_num_draft_tokens replaced (everything else delegated)."""

    def __init__(self, server_args, width: int):
        object.__setattr__(self, "_sa", server_args)
        object.__setattr__(self, "speculative_num_draft_tokens", int(width))

    def __getattr__(self, name):
        return getattr(self._sa, name)


def prepare_for_decode_with_block_reservation(original, self, batch, *args, **kwargs):
    import sglang.srt.speculative.dflash_info_v2 as mod

    from sglang_ddtree.reservation import per_decode_len, short_reservation

    real_get = mod.get_server_args
    server_args = real_get()
    shape = short_reservation(server_args)
    if shape is None:
        return original(self, batch, *args, **kwargs)
    view = _WidthView(server_args, per_decode_len(*shape))
    mod.get_server_args = lambda: view
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        mod.get_server_args = real_get


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, prepare_for_decode_with_block_reservation, HookType.AROUND)
