"""The code pair (issue 42), end to end with one seed: corpus -> target -> greedy drafter data ->
block-16 DFlash drafter -> offline acceptance on held-out prompts -> Hugging Face folders SGLang
0.5.16 loads.  torch + tokenizers + safetensors (the GPU host's image has them; no SGLang kit).

    python bench/codepair/recipe.py --work /tmp/codepair --models /tmp/models --out-dir $OUT   # GPU, preset full
    python bench/codepair/recipe.py --work W --models M --preset smoke --device cpu --threads 2 # CPU smoke

Phases (each skipped when WORK already holds its result, so a second call on a warm machine resumes;
``--force`` redoes them): 1. corpus (bench/codepair/codecorpus.py: manifest, tokenizer, streams, held-out
prompts); 2. target (bench/textpair/train.py's train_target with the code pair's shapes installed,
bench/codepair/codeconfig.py, and the causal training forward of fastlm.py; time-bounded:
--target-seconds, the step count fixed after 60 timed steps); 3. drafter data (train.py's
make_drafter_data: greedy continuations of train windows with a KV cache, then the target's features
after target_layer_ids, bf16 on the device); 4. drafter (train.py's train_drafter, block 16;
bounded by --drafter-seconds and --deadline; by default 16 anchors in each of 16 sequences a step, one
forward: --anchors-per-seq, --loss-decay-gamma); 5. offline acceptance on the held-out prompts
(pairlib.greedy_cached in fp32, pairlib.dflash_sim: accepted length against the target's greedy
continuation, per prompt length) and held-out perplexity (bf16 weights, fp32 forward);
6. MODELS/code_target, MODELS/code_drafter (bench/textpair/materialize.py's writer), MODELS/
code_heldout_prompts.json, MODELS/code_pair.json (what the serving stages check).

WORK/log.json has every setting, the loss curves, timings (ms/step and the implied MFU), perplexity
and acceptance; ``checks`` holds the trainer's greedy tokens and drafter argmax for a few held-out
prompts (tests/test_codepair.py reloads the folders and compares).  --out-dir gets the files to
commit (<= 6: codepair_log.json, corpus_manifest.tsv.gz, tokenizer.json, heldout_prompts.json,
corpus_meta.json, and recipe stdout when the caller tees it there).  See bench/codepair/GPU_RECIPE.md.
"""
import argparse
import json
import os
import shutil
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import codeconfig as K  # noqa: E402  (puts bench/textpair on sys.path)

T_START = time.time()


def log(*a):
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


def settings(a):
    """The namespace bench/textpair/train.py's phase functions read."""
    s = types.SimpleNamespace(
        seed=a.seed, seq=a.seq, batch=a.batch, target_lr=a.target_lr, warmup=a.warmup,
        target_steps=a.target_steps, target_seconds=a.target_seconds, log_every=a.log_every, bf16=a.bf16,
        eval_windows=a.eval_windows, prompt_lens=a.prompt_lens, gen=a.gen, gen_seqs=a.gen_seqs,
        gen_batch=a.gen_batch, gen_cache=True, load_data="", save_data="", data_only=False, gen_max_batches=0,
        drafter_batch=a.drafter_batch, drafter_lr=a.drafter_lr, drafter_steps=a.drafter_steps,
        drafter_seconds=a.drafter_seconds, anchors_per_seq=a.anchors_per_seq, loss_decay_gamma=a.loss_decay_gamma)
    return s


def dump(path, res):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def phase_corpus(a, res):
    import codecorpus as CO
    cdir = os.path.join(a.work, "corpus")
    mp = os.path.join(cdir, "meta.json")
    if os.path.exists(mp) and not a.force:
        meta = json.load(open(mp))
        log(f"corpus: reusing {cdir}")
    else:
        log("corpus: scanning", a.root or CO.DEFAULT_ROOTS)
        meta = CO.build(cdir, a.root, a.vocab, a.tok_sample_mb, a.max_file_kb, a.seed, a.prompt_lens_eval,
                        a.prompts_per_len, a.check_manifest)
    log("corpus:", json.dumps({k: meta.get(k) for k in ("files", "bytes", "tokens", "bytes_per_token", "seconds")}))
    res["corpus"] = meta
    return cdir


def load_target(path, dev):
    import torch
    sd = torch.load(path, map_location="cpu")
    return {k: v.float().to(dev) for k, v in sd.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="working folder (resumable; on the GPU host /tmp/codepair)")
    ap.add_argument("--models", required=True, help="where code_target / code_drafter are written (/tmp/models)")
    ap.add_argument("--out-dir", default="", help="copy the committable results here ($OUT)")
    ap.add_argument("--preset", default="full", choices=sorted(K.PRESETS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=K.SEED)
    ap.add_argument("--force", action="store_true", help="redo every phase")
    ap.add_argument("--stop-after", choices=("corpus",), default=None,
                    help="corpus: build (or check) the corpus and stop: an earlier call on the machine, whose GPU "
                    "serves other stages meanwhile, leaves the next call the whole budget for the target")
    ap.add_argument("--deadline", type=float, default=560, help="seconds from the start: the greedy data and the "
                    "drafter are cut so that evaluation and writing end by then")
    ap.add_argument("--reserve", type=float, default=60, help="seconds kept for evaluation + writing (the "
                    "chain's and the tree's offline walks, ~10 s each estimated on the GPU, the folders)")
    # corpus
    ap.add_argument("--root", action="append", default=None, help="corpus roots (codecorpus.py; default its DEFAULT_ROOTS)")
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--tok-sample-mb", type=float, default=48)
    ap.add_argument("--max-file-kb", type=int, default=512)
    ap.add_argument("--check-manifest", default=None, help="refuse a corpus other than this manifest's")
    ap.add_argument("--prompt-lens-eval", type=int, nargs="+", default=[64, 128, 256, 512],
                    help="held-out prompt lengths (the served prompts and the offline acceptance)")
    ap.add_argument("--prompts-per-len", type=int, default=16)
    # target
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--target-steps", type=int, default=0, help="0: as many as fit in --target-seconds")
    ap.add_argument("--target-seconds", type=float, default=230)
    ap.add_argument("--data-seconds", type=float, default=75, help="the greedy data's expected seconds: the "
                    "target's budget is min(--target-seconds, deadline - elapsed - reserve - min-drafter - this)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the target's training forward")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows for the curve")
    ap.add_argument("--ppl-windows", type=int, default=512, help="held-out windows for the final perplexity")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--no-bf16", dest="bf16", action="store_false")
    # drafter
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 128, 256, 384, 512])
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--gen-seqs", type=int, default=2048, help="greedy sequences per prompt length")
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--drafter-batch", type=int, default=256, help="blocks a drafter step (with --anchors-per-seq "
                    "N > 1: drafter-batch // N sequences x N anchors)")
    # Multi-anchor default (full: 16 anchors x 16 sequences = 256 blocks a step, as the one-anchor
    # path's batch). Memory at the largest bucket (S = 512 + 256 = 768 tokens; keys n_ctx + N*16 <=
    # 768 + 256 = 1024, queries N*16 = 256): attention scores [16, 12 heads, 256, 1024] fp32 = 201 MB
    # a layer, 1.0 GB for 5 layers (2.0 GB if a math SDPA path keeps scores and probabilities for
    # backward; the memory-efficient kernel keeps neither); the mask [16, 1, 256, 1024] bool 4 MB;
    # logits [16, 240, 8192]: 63 MB bf16, 126 MB fp32 for the CE, 126 MB its gradient. A step's
    # activations are < 3 GB beside the ~28 GB of features: far inside an H100's 80 GB.
    ap.add_argument("--anchors-per-seq", type=int, default=None, help="anchors a sequence per drafter step, one "
                    "forward (pairlib.drafter_loss_multi); 1: train.py's one anchor per batch (the s35 lease's "
                    "run). Default: full 16, smoke 4")
    ap.add_argument("--loss-decay-gamma", type=float, default=None, help="weight the label at block position k "
                    "by exp(-(k-1)/gamma) (z-lab's block-16 recipe: 7); default: the plain mean (smoke: 7, to run "
                    "the path; 0 there: the plain mean)")
    ap.add_argument("--drafter-lr", type=float, default=1.5e-3)
    ap.add_argument("--drafter-steps", type=int, default=0, help="0: as many as fit in --drafter-seconds")
    ap.add_argument("--drafter-seconds", type=float, default=150)
    ap.add_argument("--min-drafter-seconds", type=float, default=60)
    ap.add_argument("--redo-drafter", action="store_true", help="train the drafter again (a longer --drafter-seconds) "
                    "on the work folder's target and greedy data (WORK/gen.pt; missing batches are generated)")
    ap.add_argument("--eval-new", type=int, default=256, help="greedy tokens per held-out prompt (offline acceptance)")
    ap.add_argument("--tree-budgets", type=int, nargs="*", default=[15, 31, 63],
                    help="offline DDTree budgets walked beside the chain (pairlib.tree_sim); none: skip")
    ap.add_argument("--check-prompts", type=int, default=4, help="prompts whose greedy tokens log.json keeps")
    a = ap.parse_args()
    if a.preset == "smoke":   # CPU sizes of every phase (seconds on 2 cores)
        a.seq, a.batch, a.warmup, a.target_steps, a.log_every = 64, 8, 10, a.target_steps or 60, 20
        a.target_lr = 3e-3
        a.prompt_lens, a.gen, a.gen_seqs, a.gen_batch = [16, 24], 24, 16, 16
        a.drafter_batch, a.drafter_steps, a.eval_windows, a.ppl_windows = 16, a.drafter_steps or 30, 4, 8
        a.prompt_lens_eval, a.prompts_per_len, a.eval_new, a.tok_sample_mb = [16, 32], 2, 24, 2
        a.tree_budgets = [3, 7] if a.tree_budgets == [15, 31, 63] else a.tree_budgets
        # 4 sequences x 4 anchors = 16 blocks (of 10 anchors a sequence: gen 24 - block 16 + 2)
        a.anchors_per_seq = a.anchors_per_seq or 4
        a.loss_decay_gamma = 7.0 if a.loss_decay_gamma is None else a.loss_decay_gamma
    a.anchors_per_seq = a.anchors_per_seq or 16
    a.vocab = a.vocab or K.PRESETS[a.preset]["vocab"]
    if a.vocab != K.PRESETS[a.preset]["vocab"]:
        K.PRESETS[a.preset] = dict(K.PRESETS[a.preset], vocab=a.vocab)

    import torch
    os.makedirs(a.work, exist_ok=True)
    res_path = os.path.join(a.work, "log.json")
    res = json.load(open(res_path)) if os.path.exists(res_path) and not a.force else {}
    res.update(args=vars(a), torch=torch.__version__, preset=K.PRESETS[a.preset])
    t_all = T_START

    # 1. corpus ---------------------------------------------------------------------------------
    cdir = phase_corpus(a, res)
    if a.stop_after == "corpus":
        dump(res_path, res)
        log(f"stopped after the corpus ({cdir})")
        return
    C, L = K.install(a.preset, tokenizer_dir=os.path.join(cdir, "tokenizer"))
    import fastlm
    import train as TR              # bench/textpair/train.py: the phase functions
    import materialize as MAT       # bench/textpair/materialize.py: the HF folder writer
    fastlm.install(L, C, a.compile)
    res["target_config"], res["drafter_config"] = C.TARGET, C.DRAFTER
    res["params"] = dict(zip(("target", "target_no_embedding", "drafter"), K.n_params(K.PRESETS[a.preset])))
    dev = TR.set_up_torch(a)
    res["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    s = settings(a)
    train = torch.load(os.path.join(cdir, "train.pt")).long().to(dev)
    held = torch.load(os.path.join(cdir, "heldout.pt")).long().to(dev)
    log(f"data: train {train.numel()} tokens, held-out {held.numel()}; {res['device']}")
    dump(res_path, res)

    # 2. target ---------------------------------------------------------------------------------
    tp = os.path.join(a.work, "target.pt")
    if os.path.exists(tp) and not a.force and res.get("target", {}).get("steps"):
        log(f"target: reusing {tp} ({res['target']['steps']} steps)")
        T = load_target(tp, dev)
    else:
        if a.target_steps == 0:   # what is left after the corpus phase, less the later phases' shares
            left = a.deadline - (time.time() - t_all) - a.reserve - a.min_drafter_seconds - a.data_seconds
            s.target_seconds = min(a.target_seconds, left)
            if s.target_seconds < 30:
                raise SystemExit(f"target: only {left:.0f}s left of --deadline {a.deadline} for the target")
        log(f"target: {res['params']['target'] / 1e6:.1f}M parameters, seq {a.seq} x batch {a.batch}, "
            f"budget {s.target_seconds:.0f}s" if a.target_steps == 0 else f"{a.target_steps} steps")
        tt = time.time()
        T = TR.train_target(s, train, held, dev, res)
        st = res["target"]
        st["tokens"] = st["steps"] * a.seq * a.batch
        fpt = fastlm.train_flops_per_token(C.TARGET, a.seq)
        st["flops_per_token"] = fpt
        st["tokens_per_second"] = round(st["tokens"] / max(1e-9, time.time() - tt))
        st["achieved_tflops"] = round(fpt * st["tokens_per_second"] / 1e12, 1)
        st["mfu_vs_790"] = round(st["achieved_tflops"] / 790.0, 3)   # the H200's measured bf16 GEMM rate
        torch.save({k: v.to(torch.bfloat16).cpu() for k, v in T.items()}, tp)
        log(f"target: {st['steps']} steps, {st['tokens'] / 1e6:.1f}M tokens, {st['achieved_tflops']} TFLOP/s")
    Tb = L.bf16_round(T)
    del T
    torch.backends.cuda.matmul.allow_tf32 = False
    if "heldout_fp32_bf16weights" not in res.get("target", {}):
        with torch.no_grad():
            ev = L.heldout_eval(Tb, held, a.seq, 8, a.ppl_windows)
        res["target"]["heldout_fp32_bf16weights"] = ev
        log("target held-out (bf16 weights, fp32 forward):", ev)
    torch.backends.cuda.matmul.allow_tf32 = True
    dump(res_path, res)

    # 3-4. drafter data + drafter ---------------------------------------------------------------
    dp = os.path.join(a.work, "drafter.pt")
    gp = os.path.join(a.work, "gen.pt")     # the greedy sequences (int16): a later run reuses them
    s.save_data, s.load_data = gp, (gp if os.path.exists(gp) and not a.force else "")
    if os.path.exists(dp) and not (a.force or a.redo_drafter) and res.get("drafter", {}).get("steps"):
        log(f"drafter: reusing {dp}")
        D = load_target(dp, dev)
    else:
        gen_until = t_all + a.deadline - a.reserve - a.min_drafter_seconds
        buckets = TR.make_drafter_data(s, Tb, train, dev, res, gen_until if a.drafter_steps == 0 else None)
        log("drafter data:", {k: res["drafter_data"][k] for k in ("greedy_tokens", "seconds", "complete", "feature_bytes")})
        if not buckets:
            raise SystemExit("no drafter data (the deadline came before the first batch)")
        dump(res_path, res)
        if a.drafter_steps == 0:
            s.drafter_seconds = max(10.0, min(a.drafter_seconds, a.deadline - (time.time() - t_all) - a.reserve))
            log(f"drafter: budget {s.drafter_seconds:.0f}s")
        D = TR.train_drafter(s, Tb, buckets, dev, res)
        del buckets
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        torch.save({k: v.to(torch.bfloat16).cpu() for k, v in D.items()}, dp)
        log(f"drafter: {res['drafter']['steps']} steps in {res['drafter']['seconds']}s, "
            f"{res['drafter']['blocks_per_step']} blocks a step ({res['drafter']['anchors_per_seq']} anchors x "
            f"{res['drafter']['seqs_per_step']} sequences), loss decay gamma {res['drafter']['loss_decay_gamma']}")
    Db = L.bf16_round(D)
    del D
    dump(res_path, res)

    # 5. offline acceptance on the held-out prompts (fp32 forward, bf16 weights) -----------------
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = json.load(open(os.path.join(cdir, "heldout_prompts.json")))
    by_len, checks = {}, []
    for p in prompts:
        by_len.setdefault(p["len"], []).append(p["input_ids"])
    acc, trees, tree_s = {}, {}, 0.0
    tot_tokens = tot_rounds = 0
    for plen, ids in sorted(by_len.items()):
        x = torch.tensor(ids, dtype=torch.long, device=dev)
        seqs, ties, n = L.greedy_cached(Tb, x, a.eval_new)
        feats = L.features(Tb, seqs)
        sim = L.dflash_sim(Db, Tb, seqs, feats, plen)
        sim.update(prompts=len(ids), bf16_tie_frac_greedy=round(ties / max(1, n), 5))
        acc[str(plen)] = sim
        if a.tree_budgets:
            t_tree = time.time()
            trees[str(plen)] = L.tree_sim(Db, Tb, seqs, feats, plen, a.tree_budgets)
            tree_s += time.time() - t_tree
        tot_tokens += sim["dflash_tokens_per_round"] * sim["rounds"]
        tot_rounds += sim["rounds"]
        for i in range(min(len(ids), a.check_prompts - len(checks))):
            nroot = plen   # the drafter's block at the first anchor: root = the first greedy token
            lg = L.drafter_logits(Db, Tb, feats[i:i + 1, :nroot].float(), seqs[i:i + 1, nroot], nroot)
            tl = L.logits(Tb, seqs[i:i + 1, :plen])[0, -1]   # the target's logits after the prompt
            tv, ti = tl.topk(5)
            dv, di = lg[0].topk(5, -1)
            checks.append({"prompt_ids": ids[i], "greedy": seqs[i, plen:plen + 32].tolist(),
                           "target_top5_ids": ti.tolist(), "target_top5_logits": [round(v, 4) for v in tv.tolist()],
                           "drafter_anchor": nroot, "drafter_argmax": lg.argmax(-1)[0].tolist(),
                           "drafter_top5_ids": di.tolist(),
                           "drafter_top5_logits": [[round(v, 4) for v in r] for r in dv.tolist()]})
        log(f"offline DFLASH, prompts of {plen}: {sim['dflash_tokens_per_round']} tokens/round, "
            f"depth-1 top-1 {sim['depth_top1'][0]}")
    res["offline_acceptance"] = {"per_prompt_len": acc, "gen": a.eval_new, "prompts": len(prompts),
                                 "dflash_tokens_per_round": round(tot_tokens / max(1, tot_rounds), 3),
                                 "how": "pairlib.dflash_sim: chain DFLASH over the target's fp32 greedy "
                                        "continuation (bf16 weights), first root = the first greedy token"}
    # the text pair's field, so bench/textpair/drafter_curve.py reads a code-pair run as it is
    w = {k: v["prompts"] for k, v in acc.items()}
    res["dflash_sim_heldout"] = {
        "depth_top1": [round(sum(v["depth_top1"][j] * w[k] for k, v in acc.items()) / sum(w.values()), 3)
                       for j in range(C.BLOCK_SIZE - 1)],
        "dflash_tokens_per_round": res["offline_acceptance"]["dflash_tokens_per_round"],
        "prompt_len": "held-out prompts of " + "/".join(sorted(acc, key=int)), "gen": a.eval_new,
        "seqs": len(prompts)}
    if trees:   # the tree at each budget against the chain over the same anchors and rounds
        tr = {}
        for b in map(str, a.tree_budgets):
            r = sum(t[b]["rounds"] for t in trees.values())
            tpr = sum(t[b]["tokens_per_round"] * t[b]["rounds"] for t in trees.values()) / max(1, r)
            sw = sum(t[b]["sibling_win_round_frac"] * t[b]["rounds"] for t in trees.values()) / max(1, r)
            tr[b] = {"tokens_per_round": round(tpr, 3), "rounds": r, "sibling_win_round_frac": round(sw, 4),
                     "gain_over_chain": round(tpr / max(1e-9, res["offline_acceptance"]["dflash_tokens_per_round"]), 3)}
            log(f"offline DDTree budget {b}: {tr[b]['tokens_per_round']} tokens/round "
                f"({tr[b]['gain_over_chain']}x the chain), a sibling won in {100 * tr[b]['sibling_win_round_frac']:.1f}% of rounds")
        res["offline_tree"] = {"per_prompt_len": trees, "all": tr, "seconds": round(tree_s, 1), "how": "pairlib.tree_sim: the project's best-first "
                               "tree (top-b per depth) walked against the same greedy continuations; budget 15 verifies "
                               "16 tokens, as the block-16 chain"}
    res["checks"] = checks
    torch.backends.cuda.matmul.allow_tf32 = True
    log("offline DFLASH tokens per round (all held-out prompts):", res["offline_acceptance"]["dflash_tokens_per_round"])

    # 6. Hugging Face folders --------------------------------------------------------------------
    tgt, dr = os.path.join(a.models, "code_target"), os.path.join(a.models, "code_drafter")
    MAT._write(tgt, C.TARGET, {k: v.cpu() for k, v in C.with_head(Tb).items()})
    MAT._write(dr, C.DRAFTER, {k: v.cpu() for k, v in Db.items()})
    shutil.copy(os.path.join(cdir, "heldout_prompts.json"), os.path.join(a.models, "code_heldout_prompts.json"))
    res["models"] = {"target": tgt, "drafter": dr, "prompts": os.path.join(a.models, "code_heldout_prompts.json")}
    res["total_seconds"] = round(time.time() - t_all, 1)
    stamp = {"work": a.work, "preset": a.preset, "seed": a.seed, "target_steps": res["target"]["steps"],
             "drafter_steps": res["drafter"]["steps"], "tokenizer_sha256": res["corpus"]["tokenizer_sha256"],
             "offline_dflash_tokens_per_round": res["offline_acceptance"]["dflash_tokens_per_round"],
             "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(os.path.join(a.models, "code_pair.json"), "w") as f:
        json.dump(stamp, f, indent=1)
    dump(res_path, res)
    if a.out_dir:
        os.makedirs(a.out_dir, exist_ok=True)
        shutil.copy(res_path, os.path.join(a.out_dir, "codepair_log.json"))
        for src, name in (("manifest.tsv.gz", "corpus_manifest.tsv.gz"), ("tokenizer/tokenizer.json", "tokenizer.json"),
                          ("heldout_prompts.json", "heldout_prompts.json"), ("meta.json", "corpus_meta.json")):
            shutil.copy(os.path.join(cdir, src), os.path.join(a.out_dir, name))
    log(f"done in {res['total_seconds']}s: {tgt}, {dr}")


if __name__ == "__main__":
    main()
