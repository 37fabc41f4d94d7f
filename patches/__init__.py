"""Hooks into SGLang internals, one module per hooked function.

Each module says why the hook is needed and which SGLang versions it was checked against; each
exposes ``install()``, which registers it with SGLang's ``HookRegistry`` (applied by SGLang's
``load_plugins()`` right after the plugins ran).

* ``decode_graph_spec_info``: capture the target's verify CUDA graph with a tree mask.
* ``validate_input_ids``: reject request token ids outside ``[0, vocab)`` with a 400 before any
  forward sees them (a bad id otherwise kills the scheduler).
* ``req_update_finish_state``: a stop string / token inside a round's accepted tokens wins over
  ``max_new_tokens`` reached in the same round (plain decoding's order).
* ``validate_dflash_request``: a DDTREE server (unless ``SGLANG_DDTREE_LOGPROBS=0``) admits requests
  that ask for log-probabilities (``sglang_ddtree/logprobs.py`` fills them from the verify logits)
  and refuses a pinned tree budget (``custom_params["ddtree_budget"]``) the server does not run.
* ``dflash_round_profile``: with ``SGLANG_DDTREE_PROFILE_FILE`` set, stock DFLASH rounds are
  profiled with DDTree's stages and events (the A/B shows both splits side by side).
* ``dflash_prepare_for_decode``, ``alloc_len_per_decode``, ``req_to_token_extra_context_len``: a
  DDTREE round may touch ``max(2N, N + B)`` KV slots past the committed length
  (``sglang_ddtree/reservation.py``): reserve, account for and size rows by that, not ``2N``.
* ``triton_verify_attention``: unless ``SGLANG_DDTREE_VERIFY_ATTN=sglang``, the target's
  TARGET_VERIFY attention on the triton backend runs our tree-verify kernel with the round's
  bitmask instead of ``extend_attention_fwd`` with a FULL_MASK (where it covers the target:
  ``auto``, the default); with the A/B switch ``draft_attn=auto|ddtree`` also the drafter's block
  forward, with an all-set bitmask.  Every call on a backend without our state goes to SGLang's.
* ``triton_cuda_graph_state``: a DDTREE target's verify graphs do not allocate the decode kernel's
  split-KV scratch for each of their ``max_bs * N`` rows (16.8 MB a row at Kimi K2's MLA widths).
* ``flashinfer_draft_fast_plan``: with the A/B switch ``draft_fast_plan``, the drafter's flashinfer
  TARGET_VERIFY graphs re-plan without flashinfer's blocking host copy (SGLang's ``fast_prefill_plan``).
* ``regime_batch_algo``, ``regime_forward_inputs``: while a DDTREE server's regime is plain
  (``sglang_ddtree/regime_state.py``), new batches take SGLang's plain path (``spec_algorithm``
  NONE) and a plain decode batch gathers its input token from the FutureMap as base does.
* ``regime_decode_stats``, ``relay_hidden_states``: SGLang's decode log line divides by the
  interval's speculative rounds, and its FutureMap relays hidden states DDTree never reads (a plain
  step has none): both as for a plain server / for DFLASH.
* ``regime_transition``: a pending regime switch converts the running batch at a safe point of
  ``Scheduler.get_next_batch_to_run`` (wait after a prefill, drain once under overlap, convert).
* ``mem_fraction_default``: remember whether ``--mem-fraction-static`` was given, so the adaptive
  default's extra target states are taken out of SGLang's heuristic KV pool only when it was not.
"""
from . import (alloc_len_per_decode, decode_graph_spec_info, dflash_prepare_for_decode, dflash_round_profile,
               flashinfer_draft_fast_plan, mem_fraction_default, regime_batch_algo, regime_forward_inputs,
               regime_decode_stats, regime_transition, relay_hidden_states,
               req_to_token_extra_context_len, req_update_finish_state, triton_cuda_graph_state,
               triton_verify_attention, validate_dflash_request, validate_input_ids)

ALL = (decode_graph_spec_info, validate_input_ids, req_update_finish_state, dflash_prepare_for_decode,
       alloc_len_per_decode, req_to_token_extra_context_len, validate_dflash_request, dflash_round_profile,
       triton_verify_attention, triton_cuda_graph_state, mem_fraction_default, flashinfer_draft_fast_plan,
       regime_batch_algo, regime_forward_inputs, regime_transition, regime_decode_stats, relay_hidden_states)


def install_all() -> None:
    for mod in ALL:
        mod.install()
