"""A/B serving benchmark: one SGLang server per arm, the same greedy prompts at each concurrency.

    sglang-ddtree-ab --model-path T --draft-model-path D [options]            # measure (installed command)
    python bench/ab_serve.py --model-path T --draft-model-path D [options]     # the same, from a checkout
    python bench/ab_serve.py [--pair text|gqa|mla] [options]    # a test-bed pair (/tmp/models); default text
    python bench/ab_serve.py --report-only OUT.json              # rewrite OUT.md from a results JSON
    python bench/ab_serve.py --merge OUT a.json b.json           # one report (JSON + MD) from several runs

Arms (``--arms``, comma-separated, run one after another, never two servers at once):
  base              the target alone (no --speculative-algorithm)
  dflash            stock DFLASH (--speculative-num-draft-tokens left to SGLang: the drafter's block)
  ddtree_b<B>       DDTREE-GPU with tree budget B (--speculative-num-draft-tokens B+1)
  ddtreecpu_b<B>    DDTREE-CPU (the exact CPU heap builds the tree), same budget flag
Every server: ``python -m sglang.launch_server --model-path T --attention-backend triton --host
127.0.0.1 --port P --mem-fraction-static 0.6 --cuda-graph-max-bs-decode MAXC
--cuda-graph-max-bs-prefill 512 --max-running-requests MAXC --skip-server-warmup --random-seed 0``
(``--prefill-cuda-graph N`` / ``--no-prefill-cuda-graph``: another prefill-graph cap, or
``--disable-prefill-cuda-graph``)
(+ ``--skip-tokenizer-init`` when prompts are token ids, + the arm's speculative flags, + the
``--server-args`` string last, so it overrides).  With ``--config F.yaml`` the YAML (minus its
speculative and host/port keys) is the base and only the flags it does not set are added.
Each server is started in its own process group, waited for on ``/health_generate``, warmed up,
measured, then killed (group SIGTERM, then SIGKILL) before the next one starts.

Measurement, per concurrency c (``--concurrency``): the first n_c prompts of one fixed prompt list
(``--requests-per-level``; auto = min(N, max(16, 4c)) so the high-c levels reach a steady batch,
``all`` = N) go to ``/generate`` with ``stream: true``, temperature 0, ``ignore_eos``, a fixed
``max_new_tokens``, at most c in flight (threads; a new request starts when one finishes).  The
radix cache is flushed before each level.  Per request: TTFT (first chunk with a token), ITL
(time between chunks / tokens in the chunk, repeated once per token: a speculative round streams
several tokens in one chunk; this is ``sglang.bench_serving``'s definition), end-to-end latency,
output ids and meta_info (completion_tokens, spec_verify_ct).  Per level (field names of
``sglang.bench_serving``'s result JSON): output_throughput = total output tokens / wall time of
the level; TTFT / ITL / TPOT / e2e mean, median, p99 (each level is run ``--repeats`` times,
radix cache flushed before each, and the run with the median output_throughput is reported, with
every run's throughput beside it); accept_length = sum(completion_tokens) /
sum(spec_verify_ct) (SGLang's spec_accept_length, bonus and prefill token included);
ms_per_step = (e2e - TTFT) / steps, averaged over requests (steps = spec_verify_ct, or
completion_tokens - 1 without speculation): the client-side time of one decode round.

Identity: every arm's output ids per (concurrency, prompt) are compared with the reference arm's
(``base``) at the same concurrency; mismatching requests and their first differing index are
reported (bf16 near-ties may flip a token legitimately on a real model; nothing is hidden).

Per-stage round time (DDTREE and DFLASH arms): the server runs with ``SGLANG_DDTREE_PROFILE_FILE``
(see sglang_ddtree/profiling.py: CUDA events at the stage boundaries of every round, flushed as JSON
lines of per-stage medians every ``--profile-every`` rounds; stock DFLASH rounds through
patches/dflash_round_profile.py, with tree = 0).  Records are attributed to the level
during which they were written (a record can hold up to profile-every rounds of the previous
level) and aggregated as the rounds-weighted mean of the per-record medians.  ``draft`` includes
the top-K (folded into the drafter's CUDA graph); ``--kernel-sweep`` times the tree build alone.
``outside_ms`` = client ms_per_step - GPU round_ms: scheduler, host and HTTP time outside the
worker's round.

``--kernel-sweep``: in a subprocess (no server), for bs 1..256, budget 8..64, depth 7 and 15,
drafter-like bf16 logits -> top-k log-probs (bench/tree_kernels.py's inputs and timers): GPU
``build_tree(backend="triton")`` (CUDA-graph replays, median) against the CPU heap
``backend="reference"`` (wall clock median, device->host copy included), trees checked identical.

Outputs: ``OUT.json`` (every number, per-request columns, identity, stage times, kernel sweep,
GPU, versions, git commit, date, the exact server command lines), ``OUT.md`` and, when matplotlib
is importable, ``OUT.png`` (:mod:`sglang_ddtree.ab.plot`; run it later on the JSON otherwise).  JSON + MD are
rewritten after every arm, so a killed run keeps what it measured; ``--deadline`` skips what no
longer fits and still writes both.

Modules: ``servers`` (arms, the launch_server command line, the server process, health), ``prompts``
(built-in prompt sets, prompt files, tokenizing), ``client`` (HTTP, one streaming /generate, one
concurrency level), ``stats`` (per-level aggregation, percentiles, stage profile, identity check,
repeat choice), ``environment`` (GPU, versions, git commit), ``sweep`` (the kernel sweep), ``runner``
(one server per arm, the levels, the result document), ``report`` (markdown, summary, plot hook,
writing the outputs), ``merge`` (one report from several runs), ``cli`` (arguments, ``main``: the
``sglang-ddtree-ab`` entry point), ``checkout`` (where checkout-only files are found).  Nothing here
imports torch or SGLang at import time.
"""
