"""The command line: ``sglang-ddtree-ab`` (console entry point) and ``python bench/ab_serve.py`` (a
wrapper around this) parse the same arguments and run the same ``main``.  ``--help`` needs no GPU,
no torch, no SGLang and no checkout."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile

import sglang_ddtree.ab as _pkg

from . import checkout
from .environment import env_info
from .merge import merge
from .report import render_markdown, render_summary, write_outputs
from .runner import requests_per_level, run
from .sweep import SWEEP_BS, SWEEP_BUDGETS, SWEEP_DEPTHS, kernel_sweep_child, run_kernel_sweep
from .servers import DEFAULT_ARMS
from .serving_client import DEFAULT_ARM_ATTENTION, SERVING_DEFAULT_ARMS, parse_workloads
from .trace import parse_spec as parse_trace_spec

DEFAULT_OUT = "ab_serve"  # OUT.json / OUT.md / OUT.png in the current folder (bench/ab_serve.py: bench/results/ab_h200)


DEFAULT_PREFILL_GRAPH_TOKENS = 512   # the A/B's prefill-graph cap (SGLang's default graph, fewer sizes)


def _workloads(spec: str) -> str:
    """argparse type of --workload: the names checked (serving_client.parse_workloads), comma-joined."""
    try:
        return ",".join(parse_workloads(spec))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(default_out: str = DEFAULT_OUT):
    ap = argparse.ArgumentParser(description=_pkg.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--draft-model-path")
    ap.add_argument("--pair", choices=("text", "gqa", "mla"),
                    help="a test-bed pair: text (the stdlib-trained pair, the default when no model is "
                         "given: MODELS_DIR/text_target + text_drafter from bench/textpair/materialize.py), "
                         "or the toy gqa / mla pairs (MODELS_DIR/<pair>_target + drafter); token ids")
    ap.add_argument("--models-dir", default="/tmp/models")
    ap.add_argument("--config", help="an SGLang YAML config (configs/*.yaml): its speculative/host/port keys are dropped")
    ap.add_argument("--arms", default=DEFAULT_ARMS,
                    help="comma list of base, dflash, ddtree_b<B>, ddtreecpu_b<B>, ddtree_auto[_b<B1>-<B2>-...] "
                         "(the adaptive budget: experimental), a DDTree arm + _vattn (our verify attention required, "
                         "e.g. ddtree_b16_vattn) or + _sglattn (SGLang's masked verify kernel; default: auto)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--prompts", help="JSON list / JSON lines: strings, {text|prompt} or {input_ids}")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--long-prompts", type=int, default=None, metavar="CHARS",
                    help="long-context prompts: each joins standard-library texts to >= CHARS characters "
                         "(raise --max-input-tokens and the servers' --context-length to match)")
    ap.add_argument("--requests-per-level", default="auto", help="auto = min(N, max(16, 4c)), auto:M = min(N, max(M, 4c)), all = N, a number, "
                    "or C:n,C:n,... (a count per concurrency, e.g. 1:32,4:96,16:128,64:256)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--new-tokens-spread", type=float, default=0.0, metavar="F",
                    help="0 <= F < 1: prompt i asks round(max_new_tokens * (1 - F + 2 F u_i)) tokens, u_i = "
                         "frac((i + 1) * 0.618...), the same in every arm (mean ~max_new_tokens): requests "
                         "then finish and are admitted at staggered times as in serving, not in lockstep waves")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each level (radix cache flushed before each); "
                                                           "the one with the median output tok/s is reported")
    ap.add_argument("--max-input-tokens", type=int, default=512, help="token-id prompts are cut to this (tail kept)")
    ap.add_argument("--vocab-size", type=int, default=None, help="fold token ids into the vocabulary (ids mode)")
    ap.add_argument("--token-ids", action="store_true", help="send input_ids (tokenized here) + --skip-tokenizer-init")
    ap.add_argument("--prompt-template", default="{prompt}", help='e.g. a chat format around "{prompt}"')
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--server-args", default="", help="extra flags for every server (appended last: they win)")
    ap.add_argument("--python", default=None, help="interpreter that runs launch_server (default: this one)")
    ap.add_argument("--port", type=int, default=31000, help="arm i listens on port + 10 i")
    ap.add_argument("--mem-fraction-static", type=float, default=0.6)
    ap.add_argument("--cuda-graph-bs", default=None, help="decode CUDA-graph batch sizes, e.g. 1,2,4,8,16,32,64 "
                                                          "(default: SGLang's list up to max concurrency)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run; arms that no longer fit are skipped")
    ap.add_argument("--min-arm-s", type=float, default=75.0, help="do not start an arm with less time than this left")
    ap.add_argument("--reserve-s", type=float, default=10.0, help="kept free at the end of the deadline")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--warmup", type=int, default=2, help="full-length requests at c=1 after a short "
                                                          "max-concurrency batch (0: no warm-up)")
    ap.add_argument("--prefill-cuda-graph", type=int, nargs="?", const=0, default=DEFAULT_PREFILL_GRAPH_TOKENS,
                    metavar="MAX_TOKENS",
                    help="SGLang's prefill CUDA graph (breakable) in every arm, its token sizes capped at MAX_TOKENS "
                         f"(--cuda-graph-max-bs-prefill; default {DEFAULT_PREFILL_GRAPH_TOKENS}: 30 sizes, 52.8 s of "
                         "capture at the Qwen3-8B shape on the H200; the flag alone or 0: SGLang's list up to 8192 "
                         "tokens, 58 sizes, 51.5 s). Measured "
                         "on the H200 (bench/results/raw/scalechain_ab_qwen3-8b_h200_s18_run1.md): with it no level "
                         "had a pause of more than 100 ms between rounds; with --no-prefill-cuda-graph every admission "
                         "was a ~40 ms eager prefill and c=16 moved +-10 %% between runs of equal arms")
    ap.add_argument("--no-prefill-cuda-graph", dest="prefill_cuda_graph", action="store_const", const=None,
                    help="every server gets --disable-prefill-cuda-graph (the A/B's default before session 18)")
    ap.add_argument("--freeze-gc", action="store_true",
                    help="every arm: SGLang's /freeze_gc after the warm-up (as if every arm ended in _freezegc)")
    ap.add_argument("--profile-every", type=int, default=16, help="SGLANG_DDTREE_PROFILE_EVERY for DDTREE arms")
    ap.add_argument("--no-stage-profile", action="store_true")
    ap.add_argument("--torch-profile", default=None, metavar="C[:STEPS][:cpu]",
                    help="after level C's repeats, one uncounted pass with SGLang's torch profiler on for STEPS "
                         "scheduler steps (default 30; :cpu also records the host's torch ops); the trace's "
                         "summary goes into the level and the report")
    ap.add_argument("--reference-arm", default="base")
    ap.add_argument("--kernel-sweep", action="store_true", help="also time GPU build_tree vs the CPU heap (bs 1..256)")
    ap.add_argument("--sweep-s", type=float, default=120.0, help="time reserved for --kernel-sweep under --deadline")
    ap.add_argument("--kernel-sweep-only", action="store_true", help="only the kernel sweep (no servers)")
    ap.add_argument("--workdir", default=None, help="server logs and profile files (default: a temp dir)")
    ap.add_argument("--save-prompts", default=None, help="write the prompts used as JSON lines")
    ap.add_argument("--save-output-ids", action="store_true", help="keep every output id list in the JSON")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the server command lines and the prompt summary")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--no-env-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report-only", metavar="JSON", help="rewrite JSON's markdown (and nothing else)")
    ap.add_argument("--merge", nargs="+", metavar=("OUT", "JSON"), help="OUT a.json b.json ...: one report")
    ap.add_argument("--invalid", nargs=4, action="append", metavar=("FILE", "ARM", "C", "REASON"),
                    help="with --merge: mark one measured level of FILE (a merged file's name) as broken")
    ap.add_argument("--summary", metavar="JSON", help="print the summary tables of a result (the README's table)")
    ap.add_argument("--kernel-sweep-child", metavar="JSONL", help=argparse.SUPPRESS)
    g = ap.add_argument_group("--client bench_serving (sglang_ddtree/ab/serving_client.py: SGLang's own load "
                              "generator drives the levels, the identity check on top)")
    g.add_argument("--client", choices=("ab", "bench_serving"), default="ab",
                   help="ab: this package's client (the default); bench_serving: `python -m sglang.bench_serving "
                        "--backend sglang` per level (default arms then " + SERVING_DEFAULT_ARMS + ")")
    g.add_argument("--workload", type=_workloads, default="random",
                   help="bench_serving: random (random-ids 512 in / 256 out), long (8192 / 256), mix (input 256-4096, "
                        "output 16-256), varied (input 256-512, output 128-256), natural (the pair's natural prompts "
                        "as a ShareGPT file, 256 out), ids (the pair's own prompts as token ids, output 64-256: "
                        "through sglang_ddtree.ab.bs_ids); several "
                        "comma-separated (random,natural): each arm's server serves them in turn, one report each "
                        "(--out + _<workload>)")
    g.add_argument("--serving-input-len", type=int, default=None, help="bench_serving: override the workload's input length")
    g.add_argument("--serving-output-len", type=int, default=None, help="bench_serving: override the workload's output length")
    g.add_argument("--serving-range-ratio", type=float, default=None, help="bench_serving: override the workload's range ratio")
    g.add_argument("--serving-seed", type=int, default=42, help="bench_serving's --seed (the same requests in every arm)")
    g.add_argument("--level-warmup-waves", type=int, default=0, metavar="W",
                   help="bench_serving: before each level, every arm runs one uncounted pass of W x c requests "
                        "of the workload (0: none): a server that learns online (the regime controller of "
                        "DDTREE-GPU's regime=auto, the adaptive widths' estimates) is measured in its steady "
                        "state, not in its first seconds at that load")
    g.add_argument("--min-level-seconds", type=float, default=20.0,
                   help="bench_serving: the first arm scales a level's request count until it lasts >= this x "
                        "--level-seconds-margin (0: --requests-per-level as given)")
    g.add_argument("--level-seconds-margin", type=float, default=1.15,
                   help="bench_serving: the sizing arm aims its levels at --min-level-seconds x this (head room "
                        "for run-to-run noise: a level shorter than --min-level-seconds is flagged 'short'); an "
                        "arm faster than the sizer runs several passes a repeat instead (1.5 until s40, when "
                        "every arm's levels lasted >= 1.5 x 20 s)")
    g.add_argument("--bench-serving-per-pass", action="store_true",
                   help="bench_serving: a `python -m sglang.bench_serving` process per pass (each pays `import "
                        "sglang`), instead of one persistent client process per arm that runs every pass in-process")
    g.add_argument("--arm-attention", default=DEFAULT_ARM_ATTENTION,
                   help="bench_serving: ARM=BACKEND,... the --attention-backend of those arms ('*': every other "
                        "arm; arms not named: no flag); 'none'")
    g.add_argument("--serving-profile", action="store_true",
                   help="bench_serving: DDTREE and DFLASH servers record their rounds (SGLANG_DDTREE_PROFILE_FILE, "
                        "every --profile-every rounds) and the report adds each level's round split (GPU round, "
                        "host, per verify width): a diagnostic (off: the servers run as users run them)")
    g.add_argument("--resume", action="store_true",
                   help="bench_serving: keep the arms an earlier run in the same --workdir measured completely on "
                        "this machine (same GPU UUIDs) with the same settings (its serving_state.json), also those "
                        "--arms does not name, and run only the others: one cell's arms over several device calls "
                        "on one warm machine (--arms base, then --arms dflash, then --arms ddtree)")
    g.add_argument("--arm-shares", action="store_true",
                   help="bench_serving, with --deadline: each arm's levels stop at its equal share of the time "
                        "left when it starts (time left / arms still to measure; what an arm leaves unused "
                        "goes to the next), so every arm gets its first levels and identity requests instead of "
                        "the last arm getting nothing: for a call the lease will not follow (one arm per call "
                        "costs fewer server starts when calls on one warm machine follow, --resume)")
    g.add_argument("--identity-prompts", type=int, default=16, help="bench_serving: greedy identity requests per arm")
    g.add_argument("--identity-new-tokens", type=int, default=256)
    g.add_argument("--identity-concurrency", type=int, default=1)
    g.add_argument("--identity-reserve-s", type=float, default=15.0,
                   help="bench_serving: an arm's levels stop this many seconds before --deadline, so its identity "
                        "requests (after them) still run")
    return ap


def main(argv=None, default_out: str = DEFAULT_OUT):
    args = build_parser(default_out).parse_args(argv)
    try:
        parse_trace_spec(args.torch_profile)
        for c in args.concurrency or []:      # a bad count spec fails here, before any server starts
            requests_per_level(args.requests_per_level, c, 1 << 30)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.kernel_sweep_child:
        return kernel_sweep_child(args.kernel_sweep_child, SWEEP_BS, SWEEP_BUDGETS, SWEEP_DEPTHS)
    if args.report_only:
        doc = json.load(open(args.report_only))
        out = args.report_only[:-5] if args.report_only.endswith(".json") else args.report_only
        with open(out + ".md", "w") as f:
            f.write(render_markdown(doc))
        print(f"wrote {out}.md")
        return 0
    if args.summary:
        print("\n".join(render_summary(json.load(open(args.summary)), h="####")).rstrip())
        return 0
    if args.merge:
        if len(args.merge) < 2:
            raise SystemExit("--merge OUT a.json [b.json ...]")
        merge(args.merge[0], args.merge[1:], args.invalid)
        return 0
    if args.kernel_sweep_only:
        tmp = args.workdir or tempfile.mkdtemp(prefix="ab_sweep_")
        os.makedirs(tmp, exist_ok=True)
        doc = dict(kind="ab_serve", meta=env_info(args.python or sys.executable),
                   settings=dict(model_path=None, draft_model_path=None, pair=None, concurrency=[], arms=[],
                                 max_new_tokens=None, requests_per_level={}, greedy="-"),
                   prompts=dict(source="-", count=0, kind="-", mean_input_len=0, sha256_16="-"),
                   arms=[], identity=None,
                   kernel_sweep=run_kernel_sweep(args.python or sys.executable, args.deadline or 1800, tmp))
        write_outputs(doc, args.out, plot=not args.no_plot)
        return 0
    def _term(signum, frame):  # `timeout` / a job killer: stop the running server, write the results
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _term)
    try:
        run(args)
    except checkout.CheckoutMissing as e:  # e.g. --pair text (the default without --model-path), installed
        raise SystemExit(f"error: {e}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
