"""Hook: ``validate_dflash_request`` as the scheduler calls it (AROUND) -- admit log-probability
requests on DDTREE servers that serve them; refuse a tree budget a request pins that the server
does not run.

Why: SGLang 0.5.16's scheduler refuses, for every DFLASH-family algorithm (DDTREE-GPU / DDTREE-CPU
are registered as that family), a request with ``return_logprob`` ("DFLASH speculative decoding
does not support return_logprob yet."). A DDTREE round has the target's logits at every tree node
and fills the committed tokens' log-probabilities from them (``sglang_ddtree/logprobs.py``). On a
DDTREE server (unless ``SGLANG_DDTREE_LOGPROBS=0``), this hook runs SGLang's own check with
``return_logprob`` hidden, so every other refusal (grammar-constrained requests, hidden states
under overlap scheduling) still applies; DFLASH servers and DDTREE servers with the switch off are
untouched.

A request may pin its rounds' tree budget (``custom_params["ddtree_budget"]``,
``sglang_ddtree/policy/adaptive.py``); a value the server does not run (not an integer, not its fixed budget,
not in ``SGLANG_DDTREE_BUDGETS``) is refused here with a one-line reason, which the scheduler turns
into an aborted request (status 400), before any round sees it.  The budgets come from this process's
DDTREE worker (``adaptive_config.register_served``); without one (DFLASH servers) nothing is checked.

Checked against: SGLang 0.5.16 (``sglang/srt/managers/scheduler.py``: ``from
sglang.srt.speculative.dflash_utils import validate_dflash_request``, called in
``handle_generate_request`` when ``spec_algorithm.is_dflash_family()``).
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.scheduler.validate_dflash_request"
CHECKED_SGLANG_VERSIONS = ("0.5.16",)


def _serves_logprobs() -> bool:
    from sglang_ddtree import logprobs
    from sglang_ddtree.spec_algo import is_ddtree

    if not logprobs.enabled():
        return False
    try:
        from sglang.srt.runtime_context import get_server_args
        algo = get_server_args().speculative_algorithm
    except Exception:  # no server args registered in this process: not a DDTREE server
        return False
    return is_ddtree(algo)


def validate_with_logprobs(original, req, *args, **kwargs):
    from sglang_ddtree.policy import adaptive_config

    err = adaptive_config.request_budget_error(getattr(getattr(req, "sampling_params", None), "custom_params", None))
    if err is not None:
        return err
    if not getattr(req, "return_logprob", False) or not _serves_logprobs():
        return original(req, *args, **kwargs)
    req.return_logprob = False
    try:
        return original(req, *args, **kwargs)
    finally:
        req.return_logprob = True


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, validate_with_logprobs, HookType.AROUND)
