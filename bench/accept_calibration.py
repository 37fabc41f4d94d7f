"""Calibration of the tree's expected acceptance against the exact counterfactual (CPU, greedy).

    PYTHONPATH=. python bench/accept_calibration.py [--pair text|chain|both] [--prompts 16]
        [--random-prompts 16] [--new-tokens 256] [--out bench/results/accept_calibration_cpu.json]

Why (issue 39 item 3): :func:`sglang_ddtree.policy.accept_estimate.expected_accept` reads, before the
verify, the expected accepted nodes of every smaller budget if the target followed the drafter
(sum of exp(path score) over the first b nodes of the best-first tree).  The adaptive policy is to
scale it by a calibration ratio, exact counterfactual acceptance
(:func:`sglang_ddtree.tree_ops.counterfactual_accept_len` of the accepted path of the widest tree)
over the predicted value, pooled over the same request-rounds.  This script measures how that ratio
behaves, on real pairs run by the repo's exact CPU machinery (plain-torch fp32 forwards of
:mod:`sglang_ddtree.demo`'s pairs, ``backend="reference"`` top-K / tree / accept, greedy): per
round and request, the predicted and the exact acceptance at the adaptive ladder's budgets
(:func:`sglang_ddtree.policy.adaptive_config.default_budgets` of the drafter's default widest,
:func:`sglang_ddtree.config.default_budget`: 28 -> 7/15/28 for the block-8 text pair,
60 -> 7/15/31/60 for the block-16 toy chain pair), one widest tree per round.  It reports

(a) the ratio exact/predicted per budget, pooled, per request-age bucket (output tokens emitted
    before the round: 0-15, 16-63, 64-255, 256+) and per workload, and its spread across prompts
    (quantiles of the per-prompt ratio);
(b) Pearson / Spearman of predicted vs exact over request-rounds, and the predicted gain ratios
    (pred[b2] / pred[b1], pooled) against the exact ones;
(c) a workload switch: the request stream "all kind-A prompts, then all kind-B prompts" (text pair:
    held-out text, then random token ids), served at concurrency c (each of c slots takes the next
    prompt when its own ends; 1 = back to back), in windows of 8 steps: predicted mean, predicted
    mean x the ratio calibrated on A, and exact mean, per budget.  The streams are assembled from
    the per-prompt records (every prompt is decoded alone, so its rounds do not depend on what runs
    next to it in a batch).

The JSON holds aggregates only (no per-token dumps).  The models recompute the whole sequence
every forward (no KV cache): cost grows with the sequence length.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_ddtree import config, ddtree, demo, tree_ops  # noqa: E402
from sglang_ddtree.policy import accept_estimate, adaptive_config  # noqa: E402
from sglang_ddtree import textpair as TP  # noqa: E402

AGE_EDGES = (16, 64, 256)                      # buckets 0-15, 16-63, 64-255, 256+
AGE_NAMES = ("0-15", "16-63", "64-255", "256+")
WINDOW = 8
QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
BE = "reference"


def age_bucket(age: int) -> int:
    return sum(age >= e for e in AGE_EDGES)


def pair_budgets(block_size: int):
    """(widest, ladder): the drafter's default widest budget and the adaptive default set."""
    widest = config.default_budget(block_size)
    return widest, adaptive_config.default_budgets(widest)


# ----------------------------------------------------------------------------------------- pairs

def load_pair(name: str):
    if name == "text":
        return demo.TextPair()
    if name == "chain":
        dev_dir = os.path.join(ROOT, "bench", "device")
        scale_dir = os.path.join(ROOT, "bench", "scale")
        for d in (dev_dir, scale_dir):
            if d not in sys.path:
                sys.path.insert(0, d)
        import chain_pair as CP
        import mk_models as M
        pair = demo.TinyPair(CP.DEFAULT_DRAFTER)
        pair.block_size, pair.drafter_cfg = CP.DEFAULT_BLOCK, M.drafter_config(CP.DEFAULT_BLOCK)
        pair.depth = pair.block_size - 1
        return pair
    raise ValueError(name)


def text_prompts(n: int, max_len: int = 10 ** 9):
    """The first n held-out text prompts (file order), each cut to max_len tokens."""
    return [p["ids"][:max_len] for p in TP.heldout_prompts()[:n]]


def random_prompts(n: int, vocab: int, seed: int, lo: int = 16, hi: int = 200, first: int = 5):
    """n prompts of ids uniform in [first, vocab), lengths uniform in [lo, hi] (BOS first)."""
    rng = random.Random(seed)
    return [[TP.BOS] + [rng.randrange(first, vocab) for _ in range(rng.randint(lo, hi) - 1)]
            for _ in range(n)]


def chain_prompts(n: int, seed: int = 0):
    import mk_chain_prompts as MCP
    return MCP.chain_prompts(n, seed=seed)


# ----------------------------------------------------------------------------------------- core

def run_round(pair, seq, budgets):
    """One round of the widest tree on committed tokens ``seq`` (its last token is the root).

    Returns dict(lp, ids, tree, target, acc, pred [nb] float, exact [nb] int, new [tokens])."""
    widest = max(budgets)
    k = min(widest, pair.vocab)
    logits = pair.draft_logits(seq)[None].float()
    lp, ids = ddtree.topk_logprobs(logits, k, backend=BE)
    tree = ddtree.build_tree(lp, ids, widest, root_tokens=torch.tensor([seq[-1]]), backend=BE)
    target = pair.verify(seq, tree.tokens[0], tree.depth[0], tree.visibility[0])[None]
    acc = ddtree.accept_greedy(tree, target, backend=BE)
    pred = accept_estimate.expected_accept(tree, lp, ids, [b + 1 for b in budgets])[0].tolist()
    exact = tree_ops.counterfactual_accept_len(acc.path, list(budgets))[0].tolist()
    new = [t for t in acc.new_tokens(tree)[0].tolist() if t >= 0]
    return dict(lp=lp, ids=ids, tree=tree, target=target, acc=acc, pred=pred, exact=exact, new=new)


def decode_prompt(pair, prompt, n_new, budgets, eos=None):
    """Greedy DDTree decoding of one prompt with the widest tree; one record per round:
    dict(age=output tokens before the round, pred, exact, emitted, accept_len).  Stops after
    n_new output tokens or at ``eos``."""
    seq, emitted, rows = list(prompt), 0, []
    while emitted < n_new:
        r = run_round(pair, seq, budgets)
        new = r["new"][: n_new - emitted]
        if eos is not None and eos in new:
            new = new[: new.index(eos) + 1]
        rows.append(dict(age=emitted, pred=r["pred"], exact=r["exact"], emitted=len(new),
                         accept_len=int(r["acc"].accept_len[0])))
        seq += new
        emitted += len(new)
        if eos is not None and new and new[-1] == eos:
            break
    return rows, seq[len(prompt):]


# ----------------------------------------------------------------------------------------- stats

def _ratio(ex, pr):
    return None if pr <= 0 else round(float(ex) / float(pr), 4)


def _rank(x):
    x = np.asarray(x, float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    # average ties
    vals, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.zeros(len(vals))
    np.add.at(sums, inv, ranks)
    return (sums / counts)[inv]


def _corr(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return None
    return round(float(np.corrcoef(a, b)[0, 1]), 4)


def ratio_table(rows, budgets):
    """{n, pred_mean, exact_mean, ratio} per budget over ``rows``."""
    if not rows:
        return dict(n=0)
    P = np.array([r["pred"] for r in rows], float)
    E = np.array([r["exact"] for r in rows], float)
    out = dict(n=len(rows))
    for j, b in enumerate(budgets):
        out[f"b{b}"] = dict(pred=round(P[:, j].mean(), 4), exact=round(E[:, j].mean(), 4),
                            ratio=_ratio(E[:, j].sum(), P[:, j].sum()))
    return out


def summarize(records, budgets, label):
    """records: [dict(prompt, kind, rows)] -> the (a) / (b) aggregates of these prompts."""
    rows = [r for rec in records for r in rec["rows"]]
    out = dict(label=label, prompts=len(records), rounds=len(rows),
               output_tokens=sum(r["emitted"] for r in rows),
               tokens_per_round=round(sum(r["emitted"] for r in rows) / max(1, len(rows)), 4))
    out["pooled"] = ratio_table(rows, budgets)
    out["by_age"] = {AGE_NAMES[i]: ratio_table([r for r in rows if age_bucket(r["age"]) == i], budgets)
                     for i in range(len(AGE_NAMES))}
    # calibration curve: request-rounds in quintiles of the widest prediction
    if len(rows) >= 10:
        pw = np.array([r["pred"][-1] for r in rows], float)
        edges = np.quantile(pw, [0.2, 0.4, 0.6, 0.8])
        qb = np.searchsorted(edges, pw, side="right")
        out["by_pred_quintile"] = {f"Q{q + 1}": ratio_table([r for r, k in zip(rows, qb) if k == q], budgets)
                                   for q in range(5)}
    # per-prompt ratio spread (prompts with any predicted mass)
    spread = {}
    for j, b in enumerate(budgets):
        rs = [sum(r["exact"][j] for r in rec["rows"]) / sum(r["pred"][j] for r in rec["rows"])
              for rec in records if rec["rows"] and sum(r["pred"][j] for r in rec["rows"]) > 0]
        spread[f"b{b}"] = (dict(n=len(rs), **{f"q{int(q * 100)}": round(float(np.quantile(rs, q)), 4)
                                              for q in QUANTILES},
                                cv=round(float(np.std(rs) / np.mean(rs)), 4) if np.mean(rs) > 0 else None)
                           if rs else dict(n=0))
    out["per_prompt_ratio"] = spread
    # (b) correlation per request-round, pooled and within age buckets
    P = np.array([r["pred"] for r in rows], float)
    E = np.array([r["exact"] for r in rows], float)
    corr = {}
    for j, b in enumerate(budgets):
        corr[f"b{b}"] = dict(pearson=_corr(P[:, j], E[:, j]),
                             spearman=_corr(_rank(P[:, j]), _rank(E[:, j])))
    out["correlation"] = corr
    # per-prompt means: does the prediction rank prompts?
    pm = [np.mean([r["pred"][-1] for r in rec["rows"]]) for rec in records if rec["rows"]]
    em = [np.mean([r["exact"][-1] for r in rec["rows"]]) for rec in records if rec["rows"]]
    out["per_prompt_mean_corr_widest"] = dict(pearson=_corr(pm, em),
                                              spearman=_corr(_rank(pm), _rank(em)))
    # gains: pooled sums, consecutive budgets and each vs the narrowest
    gains = {}
    for j in range(1, len(budgets)):
        for i in sorted({j - 1, 0}):
            sp_i, sp_j = P[:, i].sum(), P[:, j].sum()
            se_i, se_j = E[:, i].sum(), E[:, j].sum()
            gains[f"b{budgets[j]}/b{budgets[i]}"] = dict(
                pred=_ratio(sp_j, sp_i), exact=_ratio(se_j, se_i),
                pred_gain_tokens=round((sp_j - sp_i) / len(rows), 4),
                exact_gain_tokens=round((se_j - se_i) / len(rows), 4))
    out["gains"] = gains
    gains_age = {}
    for a in range(len(AGE_NAMES)):
        sub = [r for r in rows if age_bucket(r["age"]) == a]
        if not sub:
            continue
        Pa = np.array([r["pred"] for r in sub], float)
        Ea = np.array([r["exact"] for r in sub], float)
        gains_age[AGE_NAMES[a]] = {f"b{budgets[j]}/b{budgets[j - 1]}":
                                   dict(pred=_ratio(Pa[:, j].sum(), Pa[:, j - 1].sum()),
                                        exact=_ratio(Ea[:, j].sum(), Ea[:, j - 1].sum()))
                                   for j in range(1, len(budgets))}
    out["gains_by_age"] = gains_age
    return out


def stream_windows(seq_a, seq_b, budgets, ratio_a, concurrency=1, window=WINDOW, keep=(6, 10), roll=4):
    """The request stream "every prompt of seq_a, then every prompt of seq_b" at ``concurrency``
    slots; each step every busy slot runs its request's next round; windows of ``window`` steps.

    seq_a / seq_b: lists of per-prompt round lists.  Returns the windows from ``keep[0]`` before
    the first B round to ``keep[1]`` after it: dict(w (0 = the first window holding a B round),
    n, frac_b, pred, scaled (pred x ratio_a), exact, err_scaled) per budget, plus the error of an
    estimator that only counts acceptance (the previous window's exact mean) and of the prediction
    scaled by a rolling ratio (sum exact / sum pred over the previous ``roll`` windows)."""
    queue = [("A", rs) for rs in seq_a] + [("B", rs) for rs in seq_b]
    slots = [None] * concurrency
    qi, steps = 0, []
    while True:
        for s in range(concurrency):
            if slots[s] is None or slots[s][2] >= len(slots[s][1]):
                slots[s] = None
                while qi < len(queue) and not queue[qi][1]:
                    qi += 1
                if qi < len(queue):
                    slots[s] = [queue[qi][0], queue[qi][1], 0]
                    qi += 1
        live = [s for s in slots if s is not None]
        if not live:
            break
        step = []
        for s in live:
            step.append((s[0], s[1][s[2]]))
            s[2] += 1
        steps.append(step)
    wins = [sum(steps[i:i + window], []) for i in range(0, len(steps), window)]
    first_b = next(i for i, w in enumerate(wins) if any(k == "B" for k, _ in w))
    sums = [(np.array([r["pred"] for _, r in w], float).sum(0), np.array([r["exact"] for _, r in w], float).sum(0))
            for w in wins]
    out = []
    for i in range(max(0, first_b - keep[0]), min(len(wins), first_b + keep[1])):
        w = wins[i]
        P, E = sums[i][0] / len(w), sums[i][1] / len(w)
        prev = sums[i - 1][1] / len(wins[i - 1]) if i > 0 else None
        hist = sums[max(0, i - roll):i]
        rr = (sum(h[1] for h in hist) / np.maximum(sum(h[0] for h in hist), 1e-9)) if hist else None
        row = dict(w=i - first_b, n=len(w), frac_b=round(sum(k == "B" for k, _ in w) / len(w), 3))
        for j, b in enumerate(budgets):
            sc = P[j] * ratio_a[j]
            rel = lambda est: round((est - E[j]) / E[j], 3) if E[j] > 0 else None  # noqa: E731
            row[f"b{b}"] = dict(pred=round(P[j], 3), scaled=round(sc, 3), exact=round(E[j], 3),
                                rel_err_scaled=rel(sc),
                                rel_err_prev_window=rel(prev[j]) if prev is not None else None,
                                rel_err_rolling_ratio=rel(P[j] * rr[j]) if rr is not None else None)
        out.append(row)
    return out


def switch_summary(windows, budgets):
    """Mean |relative error| over the windows after the switch (w >= 0) and before (w < 0)."""
    res = {}
    for j, b in enumerate(budgets):
        k = f"b{b}"
        for side, sel in (("before", lambda w: w["w"] < 0), ("after_0_1", lambda w: 0 <= w["w"] <= 1),
                          ("after_2plus", lambda w: w["w"] >= 2)):
            for est in ("rel_err_scaled", "rel_err_prev_window", "rel_err_rolling_ratio"):
                v = [abs(w[k][est]) for w in windows if sel(w) and w[k][est] is not None]
                res.setdefault(k, {})[f"{est}_{side}"] = round(float(np.mean(v)), 3) if v else None
    return res


# ----------------------------------------------------------------------------------------- main

def run_set(pair, prompts, kind, n_new, budgets, eos, log, t_stop):
    recs = []
    for i, p in enumerate(prompts):
        if time.time() > t_stop:
            log(f"  time limit: {kind} stops after {i} prompts")
            break
        t0 = time.time()
        rows, _ = decode_prompt(pair, p, n_new, budgets, eos=eos)
        recs.append(dict(prompt=i, kind=kind, prompt_len=len(p), rows=rows))
        log(f"  {kind} {i} (len {len(p)}): {len(rows)} rounds, {sum(r['emitted'] for r in rows)} tokens, "
            f"{time.time() - t0:.1f}s")
    return recs


def card():
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    return dict(device="CPU", torch=torch.__version__, threads=torch.get_num_threads(),
                date=datetime.date.today().isoformat(), commit=commit)


def bench_pair(name, n_a, n_b, n_new, seed, minutes, log):
    """Decode the pair's prompt sets; returns (A records, B records, meta)."""
    torch.manual_seed(seed)
    pair = load_pair(name)
    widest, budgets = pair_budgets(pair.block_size)
    log(f"[{name}] block {pair.block_size}, widest {widest}, budgets {budgets}")
    t_stop = time.time() + 60 * minutes
    if name == "text":
        A = run_set(pair, text_prompts(n_a), "text", n_new, budgets, TP.EOS, log, t_stop)
        B = run_set(pair, random_prompts(n_b, pair.vocab, seed), "random", n_new, budgets, TP.EOS, log,
                    t_stop + 60 * minutes)
    else:
        A = run_set(pair, chain_prompts(n_a, seed), "chain", n_new, budgets, None, log, t_stop)
        B = []
    meta = dict(pair=name, block_size=pair.block_size, widest=widest, budgets=budgets, new_tokens=n_new,
                seed=seed)
    return A, B, meta


def analyze(A, B, meta):
    """The report of one pair from its records (A: kind-A prompts, B: kind-B, possibly empty)."""
    budgets = meta["budgets"]
    res = dict(meta)
    res["kinds"] = {recs[0]["kind"]: summarize(recs, budgets, recs[0]["kind"]) for recs in (A, B) if recs}
    if A and B:
        ka, kb = A[0]["kind"], B[0]["kind"]
        res["pooled_all"] = summarize(A + B, budgets, "all")
        ra = [res["kinds"][ka]["pooled"][f"b{b}"]["ratio"] for b in budgets]
        rb = [res["kinds"][kb]["pooled"][f"b{b}"]["ratio"] for b in budgets]
        sw = {}
        for c in (1, 4):
            w_ab = stream_windows([r["rows"] for r in A], [r["rows"] for r in B], budgets, ra, c)
            w_ba = stream_windows([r["rows"] for r in B], [r["rows"] for r in A], budgets, rb, c)
            sw[f"c{c}"] = {f"{ka}_to_{kb}": dict(windows=w_ab, summary=switch_summary(w_ab, budgets)),
                           f"{kb}_to_{ka}": dict(windows=w_ba, summary=switch_summary(w_ba, budgets))}
        res["switch"] = sw
    return res


def fmt_md(report):
    c = report["card"]
    L = [f"# Calibration of the tree's expected acceptance (exact / predicted), CPU",
         "",
         f"Card: {c['device']} ({c['threads']} threads), torch {c['torch']}, {c['date']}, commit {c['commit']}. "
         f"`{report['command']}`. Greedy, fp32 plain-torch forwards (`sglang_ddtree.demo` pairs), "
         "reference top-K / tree / accept; one widest tree per round; predicted = "
         "`accept_estimate.expected_accept`, exact = `tree_ops.counterfactual_accept_len` of the "
         "widest tree's accepted path. Ratio = sum(exact) / sum(predicted) over the request-rounds.", ""]
    for res in report["pairs"]:
        bs = res["budgets"]
        L += [f"## {res['pair']} pair (block {res['block_size']}, widest {res['widest']}, budgets {bs}, "
              f"{res['new_tokens']} new tokens, seed {res['seed']})", ""]
        for kind, s in res["kinds"].items():
            L += [f"### {kind}: {s['prompts']} prompts, {s['rounds']} rounds, "
                  f"{s['tokens_per_round']} tokens/round", "",
                  "| rows | n | " + " | ".join(f"b{b} pred / exact / **ratio**" for b in bs) + " |",
                  "|---|---:|" + "---:|" * len(bs)]
            tabs = ([("pooled", s["pooled"])] + [(f"age {k}", v) for k, v in s["by_age"].items()]
                    + [(f"pred {k} (widest)", v) for k, v in s.get("by_pred_quintile", {}).items()])
            for lab, t in tabs:
                if not t.get("n"):
                    continue
                L.append(f"| {lab} | {t['n']} | " + " | ".join(
                    f"{t[f'b{b}']['pred']} / {t[f'b{b}']['exact']} / **{t[f'b{b}']['ratio']}**" for b in bs) + " |")
            L += ["", "| per-prompt ratio | " + " | ".join(f"b{b}" for b in bs) + " |",
                  "|---|" + "---:|" * len(bs)]
            for q in ("q0", "q10", "q25", "q50", "q75", "q90", "q100", "cv"):
                L.append(f"| {q} | " + " | ".join(str(s["per_prompt_ratio"][f"b{b}"].get(q)) for b in bs) + " |")
            L += ["", "| per round: pred vs exact | " + " | ".join(f"b{b}" for b in bs) + " |",
                  "|---|" + "---:|" * len(bs),
                  "| Pearson | " + " | ".join(str(s["correlation"][f"b{b}"]["pearson"]) for b in bs) + " |",
                  "| Spearman | " + " | ".join(str(s["correlation"][f"b{b}"]["spearman"]) for b in bs) + " |",
                  "", f"Per-prompt mean at the widest, pred vs exact: Pearson "
                  f"{s['per_prompt_mean_corr_widest']['pearson']}, Spearman "
                  f"{s['per_prompt_mean_corr_widest']['spearman']}.", "",
                  "| gain (pooled) | pred ratio | exact ratio | pred +tok/round | exact +tok/round |",
                  "|---|---:|---:|---:|---:|"]
            for g, v in s["gains"].items():
                L.append(f"| {g} | {v['pred']} | {v['exact']} | {v['pred_gain_tokens']} | {v['exact_gain_tokens']} |")
            L.append("")
        if "switch" in res:
            for c_key, sw in res["switch"].items():
                for direction, d in sw.items():
                    L += [f"### switch {direction.replace('_', ' ')}, concurrency {c_key[1:]}, windows of "
                          f"{WINDOW} steps (w=0: first window with a B round; scaled = pred x ratio of A)", "",
                          "| w | n | frac B | " + " | ".join(f"b{b} pred / scaled / exact" for b in bs) + " |",
                          "|---:|---:|---:|" + "---:|" * len(bs)]
                    for w in d["windows"]:
                        L.append(f"| {w['w']} | {w['n']} | {w['frac_b']} | " + " | ".join(
                            f"{w[f'b{b}']['pred']} / {w[f'b{b}']['scaled']} / {w[f'b{b}']['exact']}"
                            for b in bs) + " |")
                    sm = d["summary"][f"b{bs[-1]}"]
                    L += ["", f"Mean |rel. error| at b{bs[-1]}: scaled prediction before / windows 0-1 / 2+ "
                          f"after: {sm['rel_err_scaled_before']} / {sm['rel_err_scaled_after_0_1']} / "
                          f"{sm['rel_err_scaled_after_2plus']}; previous window's exact mean: "
                          f"{sm['rel_err_prev_window_before']} / {sm['rel_err_prev_window_after_0_1']} / "
                          f"{sm['rel_err_prev_window_after_2plus']}; pred x rolling ratio (previous 4 "
                          f"windows): {sm['rel_err_rolling_ratio_before']} / "
                          f"{sm['rel_err_rolling_ratio_after_0_1']} / {sm['rel_err_rolling_ratio_after_2plus']}.", ""]
    L += ["## Conclusions", "", "(filled in by hand after the run)", ""]
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=("text", "chain", "both"), default="text")
    ap.add_argument("--prompts", type=int, default=16, help="kind-A prompts (text / chain)")
    ap.add_argument("--random-prompts", type=int, default=16, help="kind-B prompts (text pair only)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--chain-prompts", type=int, default=8)
    ap.add_argument("--chain-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=6.0, help="soft time limit per prompt set")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "accept_calibration_cpu.json"))
    ap.add_argument("--md", default=None, help="markdown report (default: --out with .md)")
    ap.add_argument("--from-rows", nargs="+", default=None,
                    help="no decoding: rebuild the report from --rows-out dumps")
    ap.add_argument("--rows-out", default=None, help="also dump every round (gzipped JSON; for re-analysis, "
                    "large: keep out of the repository)")
    a = ap.parse_args(argv)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)

    def log(msg):
        print(msg, flush=True)

    report = dict(card=card(), command="python bench/accept_calibration.py " + " ".join(argv or sys.argv[1:]),
                  pairs=[])
    if a.from_rows:
        import gzip
        sources = []
        for path in a.from_rows:
            with gzip.open(path, "rt") as f:
                d = json.load(f)
            recs = d["records"]
            meta = d.get("meta") or dict(   # dumps of the first version: pair, budgets, records
                pair=d["pair"], block_size=TP.BLOCK_SIZE if d["pair"] == "text" else 16,
                widest=max(d["budgets"]), budgets=d["budgets"],
                new_tokens=a.new_tokens if d["pair"] == "text" else a.chain_new_tokens, seed=a.seed)
            sources.append(d.get("command", f"rows of {os.path.basename(path)}"))
            A = [r for r in recs if r["kind"] == recs[0]["kind"]]
            B = [r for r in recs if r["kind"] != recs[0]["kind"]]
            report["pairs"].append(analyze(A, B, meta))
        report["source_commands"] = sources
    pairs = () if a.from_rows else (("text", "chain") if a.pair == "both" else (a.pair,))
    for name in pairs:
        if name == "text":
            A, B, meta = bench_pair("text", a.prompts, a.random_prompts, a.new_tokens, a.seed, a.minutes, log)
        else:
            A, B, meta = bench_pair("chain", a.chain_prompts, 0, a.chain_new_tokens, a.seed, a.minutes, log)
        report["pairs"].append(analyze(A, B, meta))
        if a.rows_out:
            import gzip
            with gzip.open(a.rows_out.replace("{pair}", name), "wt") as f:
                json.dump(dict(meta=meta, command=report["command"], records=A + B), f)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        with open(a.md or os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(fmt_md(report))
        log(f"-> {a.out}")
    if a.from_rows:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        with open(a.md or os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(fmt_md(report))
    return report


if __name__ == "__main__":
    main()
