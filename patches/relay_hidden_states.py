"""Hook: ``spec_utils.spec_need_hidden_states`` (AROUND) -- a DDTREE server relays no hidden states.

Why: SGLang 0.5.16's FutureMap relays each round's draft input to the next (overlap scheduling)
and sizes a hidden-state buffer when ``spec_need_hidden_states()`` says the algorithm consumes
them; DFLASH, whose draft input DDTree uses, is listed as not consuming them, but the check names
algorithms by string and knows nothing of DDTREE, so a DDTREE server relayed DFlash's empty
``[bs, 0]`` hidden states every round, and a plain-regime step (``sglang_ddtree/regime_state.py``:
SGLang relays its sampled ids with no hidden states) then failed in ``FutureMap.stash``
(``payload.hidden_states.to``: None; GPU test bed, s36, every ``_regimecycle`` stage).  This hook
answers False for DDTREE servers, as SGLang answers for DFLASH; any other server keeps SGLang's
answer.  The DDTree worker never reads its draft input's hidden states.

Checked against: SGLang 0.5.16 (``sglang/srt/speculative/spec_utils.py``
``spec_need_hidden_states(server_args=None)``; its one caller, ``FutureMap._lazy_init_forward_buf``
in ``managers/overlap_utils.py``, imports it inside the function, so the patched name is the one
called).
"""
from __future__ import annotations

TARGET = "sglang.srt.speculative.spec_utils.spec_need_hidden_states"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def need_hidden_states_unless_ddtree(original, server_args=None, *args, **kwargs):
    sa = server_args
    if sa is None:
        from sglang.srt.runtime_context import get_server_args

        sa = get_server_args()
    from sglang_ddtree.spec_algo import is_ddtree

    if is_ddtree(getattr(sa, "speculative_algorithm", None)):
        return False
    return original(server_args, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, need_hidden_states_unless_ddtree, HookType.AROUND)
