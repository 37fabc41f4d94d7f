"""How many KV slots a DDTree round needs past the committed length, for any budget and block size.

Per request and round (overlap scheduling): the host's committed length ``c`` lags the device's by
at most one round, which commits at most ``a = min(B, N)`` tokens (``B`` = drafter block, ``N`` =
budget + 1 verify slots).  From the device's length the drafter writes ``B`` slots and the verify
``N``, so the round touches ``req_to_token[c : c + a + max(B, N)]`` = ``c + N + B``.
SGLang 0.5.16 reserves ``c + 2 x speculative_num_draft_tokens`` = ``c + 2N``: enough when
``N >= B``; short by ``B - N`` slots when ``N < B`` (a small budget with a deep drafter, e.g. budget
8 with a block-16 drafter), and the drafter's last writes then land in ``req_to_token`` entries
that other requests or the radix cache own.  The hooks in ``patches/`` (``dflash_prepare_for_decode``,
``alloc_len_per_decode``, ``req_to_token_extra_context_len``) make SGLang reserve, account for and
size rows by :func:`reserve_len` for DDTREE servers; with ``N >= B`` nothing changes.
"""
from __future__ import annotations

from typing import Optional, Tuple


def reserve_len(num_verify: int, block_size: int) -> int:
    """KV slots reserved past the host's committed length: max(2N, N + B) (a round touches at most
    N + B; SGLang's own reservation is 2N, which this never goes below)."""
    return max(2 * num_verify, num_verify + block_size)


def per_decode_len(num_verify: int, block_size: int) -> int:
    """SGLang's 'alloc length per decode' L with 2L >= reserve_len (its double buffer)."""
    return -(-reserve_len(num_verify, block_size) // 2)


def ddtree_shape(server_args) -> Optional[Tuple[int, int]]:
    """(N, B) of a DDTREE server (from the settings resolved at argument handling), else None."""
    from .config import SETTINGS_ATTR
    from .spec_algo import is_ddtree

    rec = getattr(server_args, SETTINGS_ATTR, None)
    if not is_ddtree(getattr(server_args, "speculative_algorithm", None)) or rec is None:
        return None
    return int(rec["budget"]) + 1, int(rec["block_size"])


def short_reservation(server_args) -> Optional[Tuple[int, int]]:
    """(N, B) when SGLang's own 2N reservation is too short for this DDTREE server (N < B)."""
    shape = ddtree_shape(server_args)
    if shape is None or shape[0] >= shape[1]:
        return None
    return shape
