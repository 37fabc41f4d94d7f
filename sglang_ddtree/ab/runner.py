"""The measurement loop: inputs from the arguments, one server per arm (started, warmed up, measured
level by level, stopped), the result document, written after every arm."""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

from . import client  # client.run_level is looked up at call time (the tests replace it)
from .client import http_json
from .environment import env_info
from .prompts import (load_prompts_file, make_long_prompts, make_prompts, prompt_digest, spread_new_tokens,
                      textpair_prompts, tokenize_prompts)
from .report import write_outputs
from .servers import (CONFIG_DROP, build_server_cmd, load_yaml_config, log_tail, parse_arms, popen_launcher,
                      wait_healthy)
from .stats import aggregate_level, aggregate_profile, identity_check, mean, pick_repeat, read_profile
from .sweep import run_kernel_sweep
from .trace import LevelProfiler
from .trace import parse_spec as parse_trace_spec


# ------------------------------------------------------------------------------------------ main loop
def _profiles_by_window(levels, profile_path, base_url, prompts, deadline_at) -> None:
    """Re-assign the round-profile records to levels by wall clock: a record carries the time of its
    first and last round (``t_first`` / ``t_last``; sglang_ddtree.profiling closes a record at an idle
    gap), so a level's stage split holds only its own rounds.  Reading by file position, as each
    level does right after it ends, gave a level the previous level's tail and lost its own tail
    (the record still open; session-10 audit of ab_h200_kimicost_chain: the c=64 'outside' time of
    13 ms came from a record holding the c=16 tail).  One short request after the last level closes
    the last record.  Records without timestamps (older plugin versions) keep the per-level reading."""
    if deadline_at is None or time.time() < deadline_at - 5:
        try:
            time.sleep(IDLE_FLUSH_S)
            client.run_level(base_url, prompts[:1], 1, 2, deadline_at, progress=False, timeout=60)
            time.sleep(0.3)
        except Exception:  # noqa: BLE001 - the flush request is best effort
            pass
    recs = [r for r in read_profile(profile_path) if "t_first" in r and "t_last" in r]
    if not recs:
        return
    for lv in levels:
        w = lv.get("_window")
        if not w:
            continue
        _set_stage_profile(lv, [r for r in recs if w[0] - 0.05 <= r["t_first"] and r["t_last"] <= w[1] + 0.05])


VERIFY_ATTN_LINE = "target verify attention = "
DRAFT_ATTN_LINE = "drafter block attention = "


def verify_attention_of(log_path: str, marker: str = VERIFY_ATTN_LINE) -> Optional[str]:
    """What the DDTREE worker logged at start-up as its target verify attention (ours, or SGLang's
    masked kernel and why: ``SGLANG_DDTREE_VERIFY_ATTN=auto`` decides per server), else None;
    ``marker=DRAFT_ATTN_LINE``: its drafter block attention (logged only when
    switch ``draft_attn`` is on)."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                i = line.find(marker)
                if i >= 0:
                    return line[i + len(marker):].strip()[:300]
    except OSError:
        return None
    return None


def _set_stage_profile(lv: dict, recs: List[dict]) -> None:
    """A level's stage split from its profile records, with the client time outside the GPU round."""
    sp = lv["stage_profile"] = aggregate_profile(recs)
    if sp and lv.get("ms_per_step") is not None and sp.get("round_ms") is not None:
        sp["outside_ms"] = round(lv["ms_per_step"] - sp["round_ms"], 4)


IDLE_FLUSH_S = 0.3   # > sglang_ddtree.profiling.IDLE_GAP_S: the flush request's round closes the last record


def profile_env(arm: dict, env: dict, tmpdir: str, every: int) -> Optional[str]:
    """A DDTREE arm profiles its rounds, stock DFLASH through the plugin's hook
    (patches/dflash_round_profile.py): the same stages, side by side in the report.  Sets the
    server's ``SGLANG_DDTREE_PROFILE_FILE`` / ``_EVERY`` in ``env`` and returns the (emptied) file,
    or None for an arm without rounds to profile."""
    if arm["kind"] not in ("ddtree", "ddtreecpu", "dflash"):
        return None
    prof = os.path.join(tmpdir, f"profile_{arm['name']}.jsonl")
    if os.path.exists(prof):
        os.remove(prof)
    env["SGLANG_DDTREE_PROFILE_FILE"] = prof
    env["SGLANG_DDTREE_PROFILE_EVERY"] = str(every)
    return prof


def verify_width(arm: dict, draft_model_path: Optional[str]) -> Optional[int]:
    """Target verify tokens per request per round: budget + 1 for DDTREE arms; the drafter's
    ``dflash_config.block_size`` for DFLASH (read from its config.json when it is a local folder)."""
    if arm.get("num_draft_tokens"):
        return int(arm["num_draft_tokens"])
    if arm.get("kind") != "dflash" or not draft_model_path:
        return None
    try:
        with open(os.path.join(draft_model_path, "config.json")) as f:
            cfg = json.load(f)
        b = (cfg.get("dflash_config") or {}).get("block_size") or cfg.get("block_size")
        return int(b) if b else None
    except (OSError, ValueError):
        return None


def _arm_record(arm: dict, cmd: List[str], env: dict) -> dict:
    rec = dict(name=arm["name"], kind=arm["kind"], algo=arm["algo"], budget=arm["budget"],
               num_draft_tokens=arm["num_draft_tokens"], command=cmd, command_str=shlex.join(cmd),
               env={k: v for k, v in env.items() if k.startswith("SGLANG_DDTREE")}, status="failed", levels=[])
    flag = "--speculative-draft-model-path"
    rec["verify_width"] = verify_width(arm, cmd[cmd.index(flag) + 1] if flag in cmd[:-1] else None)
    if arm.get("pin") is not None:
        rec["pin"] = arm["pin"]
        rec["verify_width"] = arm["pin"] + 1
    return rec


def pinned_prompts(prompts: List[dict], arm: dict) -> List[dict]:
    """The prompts as a pinned arm sends them: every request carries ``custom_params.ddtree_budget``
    (sglang_ddtree/policy/adaptive.py: the server runs that budget for its rounds)."""
    if arm.get("pin") is None:
        return prompts
    return [dict(p, custom_params={PIN_KEY: int(arm["pin"])}) for p in prompts]


PIN_KEY = "ddtree_budget"   # == sglang_ddtree.policy.adaptive_config.REQUEST_BUDGET_KEY (this package runs alone)


def measure_arm(arm: dict, cmd: List[str], env: dict, base_url: str, prompts: List[dict], levels: List[int],
                per_level, args, deadline_at: Optional[float], launcher, tmpdir: str, profile_path: Optional[str],
                also: Optional[List[dict]] = None):
    """Start ``arm``'s server, warm it up, measure every level, stop it: ``(record, outputs)``.  ``also``:
    more arms served by the same server (arms pinned to one budget of an adaptive server,
    ``servers.parse_arm``'s ``_pin<B>``), measured after ``arm`` in order with one start and one
    warm-up: then ``[(record, outputs), ...]``, ``arm``'s first."""
    group = [arm] + list(also or [])
    recs = [_arm_record(a, cmd, env) for a in group]
    outs: List[dict] = [{} for _ in group]
    rec = recs[0]
    log_path = os.path.join(tmpdir, f"server_{arm['name']}.log")
    for r in recs:
        r["log"] = log_path
        if r is not rec:
            r["server_of"] = arm["name"]   # one server, started and warmed up once (in the first record)
    t0 = time.time()
    server = None
    current = rec
    try:
        server = launcher(cmd, env, log_path)
        limit = args.start_timeout
        if deadline_at is not None:
            limit = min(limit, max(5.0, deadline_at - time.time()))
        why = wait_healthy(base_url, server, limit)
        rec["start_s"] = round(time.time() - t0, 1)
        if why:
            for r in recs:
                r["error"] = why
                r["log_tail"] = log_tail(log_path)
            print(f"[{arm['name']}] FAILED to start: {why}", flush=True)
            return (rec, outs[0]) if also is None else list(zip(recs, outs))
        va = verify_attention_of(log_path)
        da = verify_attention_of(log_path, DRAFT_ATTN_LINE)
        for r in recs:
            if va:
                r["verify_attention"] = va
            if da:
                r["draft_attention"] = da
        print(f"[{arm['name']}] up after {rec['start_s']} s{f'; verify attention: {va}' if va else ''}", flush=True)
        # warm-up: the widest batch once (short), then one full-length request
        tw = time.time()
        wn = min(len(prompts), max(levels))
        if args.warmup:
            # kept: how the first batch after start-up went (session 17: ~1 token per round in every
            # speculative arm, where the measured levels accept ~3.5 on the same prompts)
            warm = {}
            for key, ps, c, m in (("burst", prompts[:wn], max(levels), min(16, args.max_new_tokens)),
                                  ("single", prompts[:args.warmup], 1, args.max_new_tokens)):
                res, dur, partial = client.run_level(base_url, ps, c, m, None, progress=False)
                w = aggregate_level(c, res, dur, ps, partial)
                warm[key] = {k: w.get(k) for k in ("concurrency", "num_requests", "completed", "duration",
                                                   "total_output_tokens", "accept_length", "spec_verify_ct",
                                                   "ms_per_step", "median_ttft_ms")}
            rec["warmup"] = warm
        rec["warmup_s"] = round(time.time() - tw, 1)
        if arm.get("freeze_gc"):
            status, _ = http_json(base_url, "POST", "/freeze_gc", timeout=60)
            if status != 200:
                raise RuntimeError(f"[{arm['name']}] /freeze_gc answered HTTP {status}")
            for r in recs:
                r["freeze_gc"] = True
        prof_mark = len(read_profile(profile_path))
        prof_spec = parse_trace_spec(getattr(args, "torch_profile", None))
        for cur, cur_outs, cur_arm in zip(recs, outs, group):
            current = cur
            arm_prompts = pinned_prompts(prompts, cur_arm)
            t_arm = time.time()
            prof_mark = _measure_levels(cur, cur_outs, cur_arm, base_url, arm_prompts, levels, per_level, args,
                                        deadline_at, tmpdir, profile_path, prof_mark, prof_spec)
            cur["_span"] = (t_arm, time.time())
        if profile_path:
            _profiles_by_window([lv for r in recs for lv in r["levels"]], profile_path, base_url, prompts,
                                deadline_at)
            allp = read_profile(profile_path)
            for r in recs:
                span = r.get("_span")
                mine = allp if len(recs) == 1 or not span else [
                    x for x in allp if "t_first" in x and span[0] - 0.05 <= x["t_first"] and x.get("t_last", 0) <= span[1] + 0.05]
                r["stage_profile_all"] = aggregate_profile(mine)
        for r in recs:
            for lv in r["levels"]:
                lv.pop("_window", None)
            r["status"] = "ok" if r["levels"] and all(lv["failed"] == 0 and not lv["partial"]
                                                      for lv in r["levels"]) else "partial"
    except Exception as e:  # noqa: BLE001 - one arm's failure never stops the others
        for r in recs[recs.index(current):]:
            r["error"] = repr(e)[:1000]
            r["log_tail"] = log_tail(log_path)
        print(f"[{current['name']}] ERROR {e!r}", flush=True)
    except KeyboardInterrupt:
        for r in recs[recs.index(current):]:
            r["error"] = "interrupted"
            r["status"] = "partial" if r["levels"] else "failed"
        rec["_interrupted"] = True
    finally:
        if server is not None:
            ts = time.time()
            try:
                server.stop()
            except Exception as e:  # noqa: BLE001
                rec["stop_error"] = repr(e)
            rec["stop_s"] = round(time.time() - ts, 1)
        for r in recs:
            r.pop("_span", None)
            r["total_s"] = round(time.time() - t0, 1)
    if rec.pop("_interrupted", False):
        raise _ArmInterrupted(rec, outs[0], list(zip(recs, outs)))
    return (rec, outs[0]) if also is None else list(zip(recs, outs))


def _measure_levels(rec, outputs, arm, base_url, prompts, levels, per_level, args, deadline_at, tmpdir,
                    profile_path, prof_mark, prof_spec) -> int:
    """Every level of one arm on a running server, into ``rec["levels"]`` / ``outputs``; returns the
    profile file's read mark."""
    for c in levels:
        if deadline_at is not None and time.time() > deadline_at - 1:
            rec.setdefault("skipped_levels", []).append(c)
            continue
        n = per_level(c)
        reps = []  # (level record, output ids) per repeat
        for rep in range(max(1, args.repeats)):
            if rep and deadline_at is not None and time.time() > deadline_at - 1:
                break
            try:
                http_json(base_url, "POST", "/flush_cache", timeout=30)
            except Exception:  # noqa: BLE001
                pass
            # socket timeout per read: a hung server cannot hold the run much past the deadline
            tmo = 600.0 if deadline_at is None else max(30.0, min(600.0, deadline_at - time.time() + 30))
            t_lv = time.time()
            res, dur, partial = client.run_level(base_url, prompts[:n], c, args.max_new_tokens, deadline_at,
                                                 desc=f"{arm['name']} c={c}", progress=args.progress, timeout=tmo)
            lv = aggregate_level(c, res, dur, prompts[:n], partial)
            lv["_window"] = (t_lv, time.time())
            if profile_path:
                time.sleep(0.2)
                recs = read_profile(profile_path)
                _set_stage_profile(lv, recs[prof_mark:])
                prof_mark = len(recs)
            reps.append((lv, [r["output_ids"] if r and r["ok"] else None for r in res]))
            if partial:
                break
        lv, outputs[c] = pick_repeat(reps)
        # every repeat's wall-clock window, in run order: the round-profile records of one repeat are
        # those inside it (bench/scale/round_gaps.py splits a level's rounds per repeat with them)
        lv["repeat_windows"] = [[round(r[0]["_window"][0], 3), round(r[0]["_window"][1], 3)] for r in reps]
        if prof_spec and c == prof_spec[0] and not (deadline_at is not None and time.time() > deadline_at - 30):
            lv["torch_profile"] = _traced_pass(arm, base_url, prompts[:n], c, args, tmpdir, prof_spec[1],
                                               deadline_at, cpu=prof_spec[2])
        rec["levels"].append(lv)
        print(f"[{arm['name']}] c={c:3d} n={n}: {lv['output_throughput']} tok/s (repeats "
              f"{lv['output_throughput_repeats']}), TTFT med {lv['median_ttft_ms']} ms, ITL med "
              f"{lv['median_itl_ms']} p99 {lv['p99_itl_ms']} ms, accept {lv['accept_length']}, failed "
              f"{lv['failed']}{' PARTIAL' if lv['partial'] else ''}", flush=True)
    return prof_mark


def _traced_pass(arm, base_url, prompts, c, args, tmpdir, steps, deadline_at, cpu=False) -> dict:
    """One extra, uncounted pass of level ``c`` with SGLang's profiler on for ``steps`` scheduler
    steps (CUPTI slows the GPU's host side: the measured repeats never carry a trace); ``cpu``: the
    host's torch ops too."""
    prof = LevelProfiler(base_url, os.path.join(tmpdir, f"trace_{arm['name']}_c{c}"), steps, cpu=cpu).start()
    try:
        http_json(base_url, "POST", "/flush_cache", timeout=30)
    except Exception:  # noqa: BLE001
        pass
    tmo = 600.0 if deadline_at is None else max(30.0, min(600.0, deadline_at - time.time() + 30))
    res, dur, partial = client.run_level(base_url, prompts, c, args.max_new_tokens, deadline_at,
                                         progress=False, timeout=tmo)
    summary = prof.finish()
    summary["pass"] = dict(concurrency=c, requests=len(prompts), seconds=round(dur, 2), partial=bool(partial),
                           failed=sum(1 for r in res if not (r and r.get("ok"))))
    ps = summary.get("per_step") or {}
    print(f"[{arm['name']}] c={c} GPU trace: {summary.get('error') or ''}step {ps.get('window_ms')} ms, busy "
          f"{ps.get('busy_ms')}, idle {ps.get('idle_ms')}", flush=True)
    return summary


class _ArmInterrupted(KeyboardInterrupt):
    def __init__(self, rec, outputs, group=None):
        super().__init__()
        self.rec, self.outputs = rec, outputs
        self.group = group or [(rec, outputs)]   # every (record, outputs) of the server's arms


def resolve_inputs(args):
    """Model paths, config, prompts (text or ids) from the arguments."""
    model, draft, token_ids = args.model_path, args.draft_model_path, args.token_ids
    cfg_path, cfg_keys = None, set()
    if args.pair == "text":  # the text-trained pair (bench/textpair/materialize.py MODELS_DIR)
        model = model or os.path.join(args.models_dir, "text_target")
        draft = draft or os.path.join(args.models_dir, "text_drafter")
        token_ids = True  # tokenized here with the pair's own tokenizer
    elif args.pair:
        model = model or os.path.join(args.models_dir, f"{args.pair}_target")
        draft = draft or os.path.join(args.models_dir, "drafter")
        token_ids = True
    if args.config:
        raw = load_yaml_config(args.config)
        model = model or raw.get("model-path")
        draft = draft or raw.get("speculative-draft-model-path")
        kept = {k: v for k, v in raw.items() if k not in CONFIG_DROP and k != "model-path"}
        cfg_keys = set(kept)
        fd, cfg_path = tempfile.mkstemp(prefix="ab_serve_cfg_", suffix=".yaml")
        import yaml
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(kept, f, sort_keys=False)
        if int(kept.get("max-running-requests", 10 ** 9)) < max(args.concurrency):
            print(f"WARNING: the config's max-running-requests {kept['max-running-requests']} < the largest "
                  f"concurrency {max(args.concurrency)}", flush=True)
    if not model and not args.config and not args.pair:
        # the default pair: the text-trained pair (bench/textpair), materialized in MODELS_DIR
        model = os.path.join(args.models_dir, "text_target")
        draft = draft or os.path.join(args.models_dir, "text_drafter")
        token_ids = True
        args.pair = "text"
    if not model:
        raise SystemExit("give --model-path, --pair or --config")
    if args.prompts and getattr(args, "long_prompts", None):
        raise ValueError("--long-prompts builds the prompts; it cannot be combined with --prompts")
    if getattr(args, "long_prompts", None):
        prompts = make_long_prompts(args.num_prompts, args.long_prompts, args.prompt_template)
        source = f"generated from the Python {platform.python_version()} standard library: consecutive code " \
                 f"windows and prose joined to >= {args.long_prompts} characters each (long context)"
    elif args.prompts:
        prompts = load_prompts_file(args.prompts, args.prompt_template)
        source = os.path.abspath(args.prompts)
    elif args.pair == "text":
        prompts = textpair_prompts(args.num_prompts, args.prompt_template)
        source = f"generated from the text pair's held-out files of the Python {platform.python_version()} " \
                 "standard library (bench/textpair/corpus_manifest.tsv; bare code windows and docstrings, " \
                 "no task line: in-domain for the pair)"
    else:
        prompts = make_prompts(args.num_prompts, args.prompt_template)
        source = f"generated from the Python {platform.python_version()} standard library (code windows and " \
                 "pydoc_data topics prose, alternating)"
    prompts = spread_new_tokens(prompts[: args.num_prompts], getattr(args, "new_tokens_spread", 0.0) or 0.0)
    if any("input_ids" in p for p in prompts):
        token_ids = True
    how = None
    if token_ids:
        how = tokenize_prompts(prompts, model, args.max_input_tokens, args.vocab_size)
    return model, draft, token_ids, cfg_path, cfg_keys, prompts, source, how


def requests_per_level(spec: str, c: int, n_prompts: int) -> int:
    """Requests run at concurrency c: 'all' = every prompt; 'auto' = min(N, max(16, 4c)); 'auto:M' =
    min(N, max(M, 4c)) (a larger floor for the low levels, the high ones still run 4 waves); a number;
    or 'C:n,C:n,...', a count per concurrency (min(N, n); every measured c must be listed: levels of
    like duration where a fixed count makes some levels a second long)."""
    spec = str(spec)
    if spec == "all":
        return n_prompts
    if "," in spec or (":" in spec and spec.split(":", 1)[0].isdigit()):
        table = {}
        for part in spec.split(","):
            k, sep, v = part.strip().partition(":")
            if not (sep and k.isdigit() and v.isdigit() and int(k) >= 1 and int(v) >= 1):
                raise ValueError(f"--requests-per-level {spec!r}: expected C:n pairs (C, n >= 1), got {part!r}")
            table[int(k)] = int(v)
        if c not in table:
            raise ValueError(f"--requests-per-level {spec!r}: no count for concurrency {c} "
                             f"(listed: {sorted(table)})")
        return min(n_prompts, table[c])
    head, sep, m = spec.partition(":")
    if head == "auto" and (not sep or (m.isdigit() and int(m) >= 1)):
        return min(n_prompts, max(int(m) if sep else 16, 4 * c))
    if spec.isdigit() and int(spec) >= 1:
        return min(n_prompts, int(spec))
    raise ValueError(f"--requests-per-level {spec!r}: expected all, auto, auto:M (M >= 1), a number or C:n,C:n,...")


def run(args, launcher: Callable = popen_launcher) -> dict:
    if getattr(args, "client", "ab") == "bench_serving":   # sglang.bench_serving drives the levels
        from . import serving_client
        return serving_client.run(args, launcher)
    t_start = time.time()
    deadline_at = t_start + args.deadline if args.deadline else None
    arms = parse_arms(args.arms)
    if getattr(args, "freeze_gc", False):
        arms = [dict(a, freeze_gc=True) for a in arms]
    levels = list(args.concurrency)
    maxc = max(levels)
    model, draft, token_ids, cfg_path, cfg_keys, prompts, source, how = resolve_inputs(args)
    N = len(prompts)

    def per_level(c):
        return requests_per_level(args.requests_per_level, c, N)

    tmpdir = args.workdir or tempfile.mkdtemp(prefix="ab_serve_")
    os.makedirs(tmpdir, exist_ok=True)
    python = args.python or sys.executable
    opts = dict(python=python, model_path=model, draft_model_path=draft, maxc=maxc, token_ids=token_ids,
                mem_fraction=args.mem_fraction_static, server_args=args.server_args,
                prefill_cuda_graph=getattr(args, "prefill_cuda_graph", None),
                cuda_graph_bs=[int(x) for x in args.cuda_graph_bs.split(",")] if args.cuda_graph_bs else None)
    doc = dict(
        kind="ab_serve", meta=env_info(python) if not args.no_env_probe else dict(argv=sys.argv),
        settings=dict(model_path=model, draft_model_path=draft, pair=args.pair, config=args.config,
                      arms=[a["name"] for a in arms], concurrency=levels, max_new_tokens=args.max_new_tokens,
                      new_tokens_spread=getattr(args, "new_tokens_spread", 0.0) or 0.0,
                      requests_per_level={str(c): per_level(c) for c in levels}, num_prompts=N,
                      greedy="temperature 0, ignore_eos, stream", token_ids=token_ids, server_args=args.server_args,
                      profile_every=args.profile_every, deadline_s=args.deadline, reference_arm=args.reference_arm,
                      repeats=args.repeats, torch_profile=getattr(args, "torch_profile", None),
                      freeze_gc=[a["name"] for a in arms if a.get("freeze_gc")],
                      prefill_cuda_graph=getattr(args, "prefill_cuda_graph", None)),
        prompts=dict(source=source, count=N, kind="input_ids" if token_ids else "text", tokenized_with=how,
                     sha256_16=prompt_digest(prompts),
                     mean_input_len=round(mean([len(p["input_ids"]) if token_ids else len(p["text"])
                                                for p in prompts]), 1),
                     input_len_unit="tokens" if token_ids else "characters",
                     kinds={k: sum(1 for p in prompts if p.get("kind") == k) for k in ("code", "prose")
                            + (("long",) if any(p.get("kind") == "long" for p in prompts) else ())},
                     sources=[p.get("source") for p in prompts]),
        arms=[], identity=None, kernel_sweep=None,
        definitions=dict(
            output_throughput="total completion tokens of the level / wall time of the level (first send to last byte)",
            ttft="time from sending the request to the first streamed chunk that carries a token",
            itl="gap between consecutive chunks / tokens in the chunk, counted once per token (sglang.bench_serving)",
            accept_length="sum(completion_tokens) / sum(spec_verify_ct) (SGLang's spec_accept_length)",
            ms_per_step="(e2e - TTFT) / (spec_verify_ct, or completion_tokens - 1 without speculation), "
                        "mean over requests: client-side time of one decode round",
            stage_profile="rounds-weighted mean of the per-record medians of sglang_ddtree.profiling records "
                          "written during the level (GPU time between CUDA events); draft includes the top-K; "
                          "outside_ms = ms_per_step - round_ms"))
    if args.save_prompts:
        with open(args.save_prompts, "w") as f:
            for p in prompts:
                f.write(json.dumps({k: p[k] for k in ("text", "input_ids", "source") if k in p}) + "\n")
    outputs: Dict[str, Dict[int, list]] = {}
    reserve = args.reserve_s + (args.sweep_s if args.kernel_sweep else 0)
    print(f"ab_serve: {len(arms)} arms x concurrency {levels}, {N} prompts ({doc['prompts']['kind']}), "
          f"max_new_tokens {args.max_new_tokens}, work dir {tmpdir}", flush=True)
    if args.dry_run:      # the servers a run starts (ports as _run_arms gives them), pinned arms on theirs
        for i, group in enumerate(server_groups(arms)):
            arm = group[0]
            print(f"[{arm['name']}] {shlex.join(build_server_cmd(arm, opts, args.port + 10 * i, cfg_path, cfg_keys))}")
            for a in group[1:]:
                print(f"[{a['name']}] on {arm['name']}'s server, every request with "
                      f"custom_params.{PIN_KEY}={a['pin']}")
        print(json.dumps({k: v for k, v in doc["prompts"].items() if k != "sources"}))
        if cfg_path:
            os.remove(cfg_path)
        return doc
    try:
        _run_arms(doc, arms, opts, args, levels, per_level, prompts, outputs, deadline_at, reserve, launcher,
                  tmpdir, cfg_path, cfg_keys, t_start)
    except KeyboardInterrupt:  # SIGINT / SIGTERM: the running server was stopped; keep what was measured
        doc["interrupted"] = True
        print("interrupted: writing what was measured", flush=True)
    if args.kernel_sweep and not doc.get("interrupted"):
        left = (deadline_at - time.time() - 5) if deadline_at else args.sweep_s * 4
        if left > 20:
            print(f"kernel sweep (limit {left:.0f} s)", flush=True)
            doc["kernel_sweep"] = run_kernel_sweep(python, left, tmpdir)
        else:
            doc["kernel_sweep"] = dict(status="skipped", note="deadline", rows=[])
    doc["identity"] = identity_check(outputs, args.reference_arm)
    doc["elapsed_s"] = round(time.time() - t_start, 1)
    if args.save_output_ids:
        doc["output_ids"] = {a: {str(c): v for c, v in o.items()} for a, o in outputs.items()}
        if token_ids:  # what bench/ab_divergence.py needs to replay any first divergence
            doc["prompt_ids"] = [p["input_ids"] for p in prompts]
    write_outputs(doc, args.out, plot=not args.no_plot)
    if cfg_path:
        os.remove(cfg_path)
    return doc


def server_groups(arms: List[dict]) -> List[List[dict]]:
    """The arms grouped by the server they run on, in order of first appearance: an arm pinned to a
    budget (``_pin<B>``) runs on the server of its adaptive arm (``arm["server"]``), after that arm
    when it is listed; every other arm has a server of its own."""
    groups: Dict[str, List[dict]] = {}
    for a in arms:
        groups.setdefault(a.get("server") or a["name"], []).append(a)
    return [sorted(g, key=lambda a: a.get("pin") is not None) for g in groups.values()]


def _run_arms(doc, arms, opts, args, levels, per_level, prompts, outputs, deadline_at, reserve, launcher, tmpdir,
              cfg_path, cfg_keys, t_start):
    for i, group in enumerate(server_groups(arms)):
        arm, also = group[0], group[1:]
        arm_deadline = deadline_at - reserve if deadline_at else None
        if arm_deadline is not None and arm_deadline - time.time() < args.min_arm_s:
            for a in group:
                doc["arms"].append(dict(name=a["name"], kind=a["kind"], algo=a["algo"], budget=a["budget"],
                                        status="skipped", error=f"deadline: {arm_deadline - time.time():.0f} s "
                                                                f"left < --min-arm-s {args.min_arm_s}"))
                print(f"[{a['name']}] SKIPPED (deadline)", flush=True)
            continue
        port = args.port + 10 * i
        cmd = build_server_cmd(arm, opts, port, cfg_path, cfg_keys)
        env = dict(os.environ)
        env.update(arm.get("env") or {})  # ddtree_auto: the adaptive budget's switches
        prof = None if args.no_stage_profile else profile_env(arm, env, tmpdir, args.profile_every)
        shared = f" (+ {', '.join(a['name'] for a in also)} on the same server)" if also else ""
        print(f"[{arm['name']}] ({i + 1}) {shlex.join(cmd)}{shared}", flush=True)
        try:
            got = measure_arm(arm, cmd, env, f"http://127.0.0.1:{port}", prompts, levels, per_level, args,
                              arm_deadline, launcher, tmpdir, prof, also=also)
        except _ArmInterrupted as e:
            for rec, outs in e.group:
                doc["arms"].append(rec)
                if outs:
                    outputs[rec["name"]] = outs
            raise
        for rec, outs in got:
            doc["arms"].append(rec)
            if outs:
                outputs[rec["name"]] = outs
        doc["identity"] = identity_check(outputs, args.reference_arm)
        doc["elapsed_s"] = round(time.time() - t_start, 1)
        write_outputs(doc, args.out, plot=False)
