"""Train the text pair: the Qwen3 target on the stdlib train split, then the DFlash drafter on the
target's own features and greedy continuations. torch + stdlib only (runs on the device).

    python bench/textpair/train.py --data bench/textpair/cache --out OUT      # the committed pair
    python bench/textpair/train.py --data bench/textpair/cache --out OUT --smoke --device cpu

--data holds train.pt / heldout.pt (int16 token streams, made here by corpus.py cache).
OUT gets target.pt and drafter.pt (bf16 state dicts; export.py converts them to safetensors) and
log.json (every setting, step count, loss curve and evaluation).
The default step counts are those of the committed pair (GPU run 1, see MODEL_CARD.md).
--target-steps / --drafter-steps 0 mean: time the first steps, then take as many as fit in
--target-seconds / --drafter-seconds (the number chosen is printed and logged; pass it back to
reproduce the run from the seed without the timing). --target-init trains only the drafter against
a given (e.g. the committed) target.

Drafter data in parts (bench/textpair/GPU_RECIPE.md): --save-data F writes the greedy sequences
(int16; during the generation at most every 20 s, and at its end), --load-data F reads them back
and generates only what is missing (same settings: the same data as one run; the features are
recomputed, one forward), --data-only stops after the data. With --drafter-steps 0 (or
--data-only) --deadline bounds the generation as well as the drafter (no batch starts that would
leave the drafter less than --min-drafter-seconds); --gen-seconds / --gen-max-batches bound the
generation alone; --gen-cache generates with a KV cache (pairlib.greedy_cached; other bf16 near-tie
choices, so other data than the default full recompute). The features are kept on the device in
bf16, 2 bytes x 2H = 1 KiB a token (16384 sequences x 5 prompt lengths: 19.2 GB).

Target: random windows of --seq tokens, AdamW, warm-up + cosine, bf16 autocast (TF32 matmuls),
tied head. Drafter data: prompts = random train windows of lengths --prompt-lens, continued
greedily for --gen tokens by the bf16-rounded target; features after TARGET_LAYER_IDS of the whole
sequence (bf16). Drafter step: one anchor position n for the batch (SGLang's block: root = token n,
context = features of 0..n-1, mask x (B-1) at n+1..n+B-1), loss = CE on the target's greedy tokens
n+1..n+B-1, with n drawn so the labels are greedy tokens. --anchors-per-seq N > 1: --drafter-batch // N
sequences a step, N distinct anchors in each (the same range), all blocks in one forward with the
context projected once per sequence (pairlib.drafter_loss_multi); --loss-decay-gamma weights the
label at block position k by exp(-(k-1)/gamma). --block-size / --drafter-layers /
--drafter-intermediate train another drafter shape (log.json records its config as
"drafter_config"; the shipped one is block 8, 2 layers, 256). The drafter's final norm starts from the
target's final norm (it feeds the same tied head).
"""
import argparse
import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import pairlib as L  # noqa: E402



def set_drafter_shape(block_size, layers, intermediate):
    """Point the pair's drafter config (common / pairlib / the test bed's forward read it at call
    time) at another block size, depth and width; the target is unchanged."""
    cfg = dict(C.DRAFTER, num_hidden_layers=int(layers), intermediate_size=int(intermediate),
               block_size=int(block_size))
    cfg["dflash_config"] = dict(C.DRAFTER["dflash_config"], block_size=int(block_size))
    C.DRAFTER, C.BLOCK_SIZE = cfg, int(block_size)
    C.install()  # pairlib's test-bed modules copied the shapes at import: refresh them
    return cfg


def optimizer_step(opt, loss, params, lr):
    """One AdamW step at learning rate lr: backward, clip the gradient norm at 1, step."""
    for grp in opt.param_groups:
        grp["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()

def rint(lo, hi, shape, g):
    """Seeded integers from a CPU generator whatever the default device is."""
    with torch.device("cpu"):
        return torch.randint(lo, hi, shape, generator=g)


def draw_anchors(g, rows, n, lo, hi):
    """[rows, n] long: n distinct anchors in [lo, hi] per row (a random permutation's first n; CPU
    generator g)."""
    with torch.device("cpu"):
        return torch.rand((rows, hi - lo + 1), generator=g).argsort(1)[:, :n] + lo


def cpu_init(fn, seed):
    with torch.device("cpu"):
        return fn(seed)


def log(*a):
    print(*a, flush=True)


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepBudget:
    """How many steps fit in ``seconds`` (``steps`` > 0: that many, fixed).

    Auto (``steps`` == 0): after ``calib[1]`` steps the count is fixed from the speed since
    ``calib[0]``, then fixed again at each fraction in ``rechecks`` of it from the speed since the
    last fix, so a slow start does not end the run early: the code pair's drafter ran its steps
    200-400 at 99 ms and the rest at ~50 ms, and a count fixed once stopped it at 229 s of its
    390 s (s35, ``bench/results/codepair_train_h100.json.gz``).  ``update(step)`` after each step
    returns the count (0 while unknown)."""

    def __init__(self, steps, seconds, calib=(20, 60), rechecks=(0.25, 0.5, 0.75), clock=time.time):
        self.steps, self.seconds, self.calib, self.clock = steps, seconds, calib, clock
        self.auto = steps == 0
        self.t0 = self.t_mark = clock()
        self.step_mark = 0
        self.rechecks = sorted(rechecks)
        self.fixes = []          # [step, steps] at each fix

    def _fix(self, step):
        _sync()
        now = self.clock()
        dt = (now - self.t_mark) / max(1, step - self.step_mark)
        self.steps = max(step + 1, step + int((self.seconds - (now - self.t0)) / dt))
        self.t_mark, self.step_mark = now, step
        self.fixes.append([step, self.steps])
        log(f"  timing: {dt*1e3:.1f} ms/step -> {self.steps} steps")

    def update(self, step):
        if not self.auto:
            return self.steps
        if step == self.calib[0]:
            _sync()
            self.t_mark, self.step_mark = self.clock(), step
        elif step == self.calib[1]:
            self._fix(step)
        elif self.steps and self.rechecks and self.rechecks[0] * self.steps <= step < self.steps:
            self.rechecks.pop(0)
            self._fix(step)
        return self.steps


def set_up_torch(a) -> torch.device:
    """``a.threads`` CPU threads, ``a.device`` as torch's default device, ``a.seed``, TF32 matmuls on
    CUDA; returns the device (this trainer and bench/codepair/recipe.py)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    torch.set_default_device(dev)
    torch.manual_seed(a.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return dev


def train_target(a, train, held, dev, res):
    T = {k: v.to(dev).requires_grad_(True) for k, v in cpu_init(C.target_init, a.seed).items()}
    opt = L.adamw(list(T.values()), a.target_lr, 0.1, dev.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(a.seed + 2)
    steps, step, t0, curve = a.target_steps, 0, time.time(), []
    budget = StepBudget(steps, a.target_seconds)
    est = steps or 10 ** 9
    while step < (steps or 10 ** 9):
        starts = rint(0, train.numel() - a.seq - 1, (a.batch,), g).to(dev)
        x, y = L.windows(train, starts, a.seq)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            loss = L.lm_loss(T, x, y)
        lr = L.cosine_lr(step, est, a.target_lr, a.warmup)
        optimizer_step(opt, loss, T.values(), lr)
        step += 1
        new = budget.update(step)
        if new != steps:
            steps = est = new
        if step % a.log_every == 0 or step == steps:
            with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
                ev = L.heldout_eval(T, held, a.seq, 32, a.eval_windows)["heldout_loss"]
            curve.append([step, round(loss.item(), 4), ev])
            log(f"  target step {step}/{steps} t={time.time()-t0:.0f}s lr {lr:.2e} train {loss.item():.3f} heldout {ev:.3f}")
    res["target"] = {"steps": step, "seconds": round(time.time() - t0, 1), "curve": curve,
                     "params": C.n_params(T)}
    return {k: v.detach() for k, v in T.items()}


def data_key(a, Tb, train):
    """What the greedy drafter data depends on: a saved set is resumed only under the same key, and
    refused under another target or train stream (a drafter would learn another model's tokens)."""
    return {"seed": a.seed, "prompt_lens": list(a.prompt_lens), "gen": a.gen, "gen_seqs": a.gen_seqs,
            "gen_batch": a.gen_batch, "bf16": a.bf16, "gen_cache": a.gen_cache,
            "target_sha1": _sha1(Tb[k] for k in sorted(Tb)), "train_tokens": int(train.numel()),
            "train_sha1": _sha1([train])}


def _sha1(tensors):
    """A digest of the tensors' bytes with torch alone (exact integer sums: the same on any device)."""
    parts = []
    for t in tensors:
        b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).long()
        w = torch.arange(b.numel(), dtype=torch.long, device="cpu") % 65521 + 1
        parts.append(f"{b.numel()}:{int(b.sum())}:{int((b * w).sum())}")
    return hashlib.sha1(";".join(parts).encode()).hexdigest()[:16]


def save_data(path, key, done, ties, steps, seconds):
    """The greedy sequences so far (int16 token ids on the host, per prompt length), atomically."""
    blob = {"key": key, "seqs": {p: torch.cat(v).to(torch.int16).cpu() if v else None for p, v in done.items()},
            "ties": ties, "steps": steps, "seconds": seconds}
    tmp = path + ".tmp"
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_data(path, key, dev):
    """(done {p: [seqs]}, ties, steps, seconds, resumable, the file's key) from save_data's file."""
    blob = torch.load(path, map_location="cpu")
    k = blob["key"]
    for f in ("target_sha1", "train_tokens", "train_sha1"):
        if k.get(f) != key[f]:
            raise SystemExit(f"--load-data {path}: made with another {f} ({k.get(f)} vs {key[f]}): refused")
    done = {int(p): ([v.long().to(dev)] if v is not None else []) for p, v in blob["seqs"].items()}
    resumable = k == key
    if not resumable:
        log(f"  --load-data: the file was made with other settings ({ {f: k[f] for f in k if k[f] != key.get(f)} }):"
            " its sequences are used as they are, none generated")
    return done, blob["ties"], blob["steps"], blob["seconds"], resumable, k


def make_drafter_data(a, Tb, train, dev, res, gen_until=None):
    """Greedy continuations of random train windows, a.gen_seqs per prompt length, in batches of
    a.gen_batch taken round-robin over the lengths (the prompts are drawn first, in the order and
    from the generator they always came from, so the data does not depend on the order); then the
    features, in bf16. gen_until (a time.time()): no batch starts that would end after it (the
    last batch's duration is the estimate), so a deadline leaves every length about equally short.
    --save-data writes the sequences after a round at most every 20 s and at the end (a killed run
    keeps what was written), --load-data
    reads them back and generates only what is missing (the same settings: the same data)."""
    t0 = time.time()
    g = torch.Generator(device="cpu").manual_seed(a.seed + 3)
    prompts = {}
    for p in a.prompt_lens:
        starts = rint(0, train.numel() - p - 1, (a.gen_seqs,), g).to(dev)
        prompts[p] = L.windows(train, starts, p)[0]
    key = data_key(a, Tb, train)
    done, ties, steps, prev_s, resumable, file_key = {p: [] for p in a.prompt_lens}, 0, 0, 0.0, True, None
    if a.load_data:
        done, ties, steps, prev_s, resumable, file_key = load_data(a.load_data, key, dev)
        log(f"  drafter data: loaded {a.load_data}: " + ", ".join(
            f"prompt {p}: {sum(x.shape[0] for x in v)}" for p, v in done.items()))
    greedy = L.greedy_cached if a.gen_cache else L.greedy
    n_done = {p: sum(x.shape[0] for x in v) for p, v in done.items()}
    dur, truncated, made = {}, False, 0  # dur: the last batch's seconds per prompt length (the time estimate)
    dirty, saved_at = False, time.time()
    while resumable and not truncated:
        todo = [p for p in a.prompt_lens if n_done[p] < a.gen_seqs]
        if not todo:
            break
        new = 0
        for p in todo:
            if (gen_until is not None and time.time() + dur.get(p, max(dur.values(), default=0.0)) > gen_until
                    or a.gen_max_batches and made >= a.gen_max_batches):
                truncated = True
                break
            i = n_done[p]
            tb = time.time()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
                s, t, n = greedy(Tb, prompts[p][i:i + a.gen_batch], a.gen)
            done[p].append(s)
            n_done[p] += s.shape[0]
            ties, steps, new, made = ties + t, steps + n, new + 1, made + 1
            _sync()
            dur[p] = time.time() - tb
        if new:
            dirty = True
            if a.save_data and time.time() - saved_at > 20:  # at most every 20 s, and at the end
                save_data(a.save_data, key, done, ties, steps, round(prev_s + time.time() - t0, 1))
                dirty, saved_at = False, time.time()
            log(f"  drafter data: {dict(n_done)} seqs per prompt length t={time.time()-t0:.0f}s")
    if a.save_data and dirty:
        save_data(a.save_data, key, done, ties, steps, round(prev_s + time.time() - t0, 1))
    if truncated:
        log(f"  drafter data: generation stopped by the time / batch bound at {dict(n_done)} of {a.gen_seqs}")
    gen_s = time.time() - t0
    buckets = []
    for p, v in done.items():
        if not v or a.data_only:  # data only: the next run recomputes the features
            continue
        seqs = torch.cat(v)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
            feats = L.features(Tb, seqs, dtype=torch.bfloat16)
        buckets.append((p, seqs, feats))
        log(f"  drafter data: prompt {p}: {tuple(seqs.shape)} t={time.time()-t0:.0f}s")
    res["drafter_data"] = {"prompt_lens": list(done), "gen": a.gen, "seqs_per_len": a.gen_seqs,
                           "greedy_tokens": steps, "bf16_tie_frac_greedy_autocast": round(ties / max(1, steps), 5),
                           "seconds": round(time.time() - t0, 1), "greedy_seconds_this_run": round(gen_s, 1),
                           "seqs_done": {str(p): n for p, n in n_done.items()},
                           "complete": all(n_done.get(p, 0) >= a.gen_seqs for p in a.prompt_lens),
                           "gen_cache": a.gen_cache,
                           "feature_bytes": sum(f.numel() * f.element_size() for _, _, f in buckets)}
    if a.load_data:
        res["drafter_data"].update(loaded_from=a.load_data, greedy_seconds_before=prev_s, resumed=resumable,
                                   loaded_key=file_key)
    if a.save_data:
        res["drafter_data"]["saved_to"] = a.save_data
    return buckets


def train_drafter(a, Tb, buckets, dev, res):
    init = cpu_init(C.drafter_init, a.seed + 1)
    init["norm.weight"] = Tb["model.norm.weight"].detach().cpu().clone()
    D = {k: v.to(dev).requires_grad_(True) for k, v in init.items()}
    opt = L.adamw(list(D.values()), a.drafter_lr, 0.0, dev.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(a.seed + 4)
    steps, step, t0, curve = a.drafter_steps, 0, time.time(), []
    budget = StepBudget(steps, a.drafter_seconds, (200, 400))
    est = steps or 10 ** 9
    B = C.BLOCK_SIZE
    per_seq = getattr(a, "anchors_per_seq", 1)
    gamma = getattr(a, "loss_decay_gamma", None)
    n_seqs = a.drafter_batch // per_seq if per_seq > 1 else a.drafter_batch
    if per_seq > 1:
        span = min(s.shape[1] - B - p + 2 for p, s, _ in buckets)   # anchors p-1 .. S-B of a bucket
        if per_seq > span or n_seqs < 1:
            raise SystemExit(f"--anchors-per-seq {per_seq}: needs <= {span} (the anchors of a sequence) "
                             f"and <= --drafter-batch {a.drafter_batch}")
    while step < (steps or 10 ** 9):
        b = int(rint(0, len(buckets), (1,), g))
        p, seqs, feats = buckets[b]
        if per_seq == 1:      # one anchor n for the whole batch (the committed pairs' path)
            n = int(rint(p - 1, seqs.shape[1] - B + 1, (1,), g))
            sel = rint(0, seqs.shape[0], (a.drafter_batch,), g).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
                loss, ok = L.drafter_loss(D, Tb, seqs[sel], feats[sel], n, gamma)
        else:                 # per_seq distinct anchors in [p-1, S-B] for each of n_seqs sequences
            sel = rint(0, seqs.shape[0], (n_seqs,), g).to(dev)
            anchors = draw_anchors(g, n_seqs, per_seq, p - 1, seqs.shape[1] - B).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16):
                loss, ok = L.drafter_loss_multi(D, Tb, seqs[sel], feats[sel], anchors, gamma)
            ok = ok.reshape(-1, B - 1)
        lr = L.cosine_lr(step, est, a.drafter_lr, a.warmup // 2)
        optimizer_step(opt, loss, D.values(), lr)
        step += 1
        new = budget.update(step)
        if new != steps:
            steps = est = new
        if step % a.log_every == 0 or step == steps:
            acc = ok.float().mean(0).tolist()
            curve.append([step, round(loss.item(), 4)] + [round(v, 3) for v in acc])
            log(f"  drafter step {step}/{steps} t={time.time()-t0:.0f}s loss {loss.item():.3f} acc/depth "
                + " ".join(f"{v:.2f}" for v in acc))
    res["drafter"] = {"steps": step, "seconds": round(time.time() - t0, 1), "curve": curve, "step_fixes": budget.fixes,
                      "params": C.n_params(D), "anchors_per_seq": per_seq, "seqs_per_step": n_seqs,
                      "blocks_per_step": n_seqs * per_seq, "loss_decay_gamma": gamma,
                      "how": ("one anchor per step for the whole batch (pairlib.drafter_loss)" if per_seq == 1 else
                              "distinct random anchors per sequence, one forward (pairlib.drafter_loss_multi)")}
    return {k: v.detach() for k, v in D.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=C.CACHE)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=C.SEED)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--target-steps", type=int, default=4861, help="0: as many as fit in --target-seconds")
    ap.add_argument("--target-init", default="", help="skip the target phase: load this target "
                    "(.safetensors as committed, or the trainer's target.pt) and train only the drafter")
    ap.add_argument("--target-seconds", type=float, default=150)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 48, 96, 144, 200])
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--gen-seqs", type=int, default=2048)
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--drafter-batch", type=int, default=256)
    ap.add_argument("--drafter-lr", type=float, default=2e-3)
    ap.add_argument("--anchors-per-seq", type=int, default=1,
                    help="N > 1: each step takes --drafter-batch // N sequences of one prompt length, N distinct "
                    "random anchors in each, all blocks in one forward (pairlib.drafter_loss_multi: the context "
                    "projected once per sequence); 1: one anchor for the whole batch (the committed pairs)")
    ap.add_argument("--loss-decay-gamma", type=float, default=None,
                    help="weight the label at block position k by exp(-(k-1)/gamma) (weighted mean; "
                    "z-lab's block-16 recipe: 7); default: the plain mean")
    ap.add_argument("--drafter-steps", type=int, default=769, help="0: as many as fit in --drafter-seconds")
    ap.add_argument("--drafter-seconds", type=float, default=100)
    ap.add_argument("--deadline", type=float, default=400,
                    help="auto drafter steps end this many seconds after the start, less 45 s for the evaluation; "
                    "with auto steps (or --data-only) it bounds the greedy generation too (see --min-drafter-seconds)")
    ap.add_argument("--min-drafter-seconds", type=float, default=60,
                    help="with --drafter-steps 0: the greedy generation starts no batch that would leave the "
                    "drafter less than this before the deadline's evaluation reserve (fewer sequences then; "
                    "log.json's drafter_data.complete says so)")
    ap.add_argument("--gen-seconds", type=float, default=0,
                    help="the greedy generation starts no batch that would end later than this many seconds "
                    "after it began (0: no bound of its own)")
    ap.add_argument("--gen-max-batches", type=int, default=0,
                    help="generate at most this many batches in this run (0: no bound; with --save-data, "
                    "--load-data continues from there)")
    ap.add_argument("--gen-cache", action="store_true",
                    help="greedy with a KV cache (pairlib.greedy_cached: far fewer FLOPs than the full recompute; "
                    "the same tokens in fp32, bf16-autocast near ties may go the other way, so other data)")
    ap.add_argument("--save-data", default="", help="write the greedy sequences (int16 ids, 2 bytes a token) "
                    "to this file (after a round of batches at most every 20 s, and at the end)")
    ap.add_argument("--load-data", default="", help="start from save-data's file: with the same settings only the "
                    "missing sequences are generated (the same data as one run); other gen settings: used as is; "
                    "another target / train stream: refused. The features are recomputed (one forward)")
    ap.add_argument("--data-only", action="store_true", help="stop after the drafter data (with --save-data: "
                    "generate in one call, train in the next with --load-data)")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows for the curve")
    ap.add_argument("--eval-seqs", type=int, default=256, help="held-out prompts for the DFLASH sim")
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--no-bf16", dest="bf16", action="store_false")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU-sized run of every phase")
    ap.add_argument("--block-size", type=int, default=C.BLOCK_SIZE,
                    help="the drafter's block (the shipped drafter: 8; z-lab's b16 recipe: 16)")
    ap.add_argument("--drafter-layers", type=int, default=C.DRAFTER["num_hidden_layers"])
    ap.add_argument("--drafter-intermediate", type=int, default=C.DRAFTER["intermediate_size"])
    a = ap.parse_args()
    set_drafter_shape(a.block_size, a.drafter_layers, a.drafter_intermediate)
    if a.smoke:
        a.seq, a.batch, a.target_steps, a.prompt_lens, a.gen, a.gen_seqs, a.gen_batch = 64, 8, 30, [16, 24], 24, 16, 16
        a.drafter_batch, a.drafter_steps, a.eval_windows, a.eval_seqs, a.log_every, a.warmup = 16, 30, 4, 8, 10, 10
    dev = set_up_torch(a)
    os.makedirs(a.out, exist_ok=True)
    res = {"args": vars(a), "torch": torch.__version__, "drafter_config": C.DRAFTER,
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    t_all = time.time()
    train = torch.load(os.path.join(a.data, "train.pt")).long().to(dev)
    held = torch.load(os.path.join(a.data, "heldout.pt")).long().to(dev)
    log(f"data: train {train.numel()} tokens, held-out {held.numel()}; device {res['device']}")

    if a.target_init:
        log(f"== target: loaded {a.target_init}")
        sd = (C.read_safetensors(a.target_init) if a.target_init.endswith(".safetensors")
              else torch.load(a.target_init, map_location="cpu"))
        T = {k: v.float().to(dev) for k, v in sd.items() if k != "lm_head.weight"}
        res["target"] = {"init": a.target_init, "steps": 0, "params": C.n_params(T)}
    else:
        log("== target")
        T = train_target(a, train, held, dev, res)
    Tb = L.bf16_round(T)
    torch.backends.cuda.matmul.allow_tf32 = False
    ev = L.heldout_eval(Tb, held, a.seq, 32, None if not a.smoke else a.eval_windows)
    res["target"]["heldout_fp32_bf16weights"] = ev
    log("  held-out (bf16 weights, fp32 forward):", ev)
    if not a.target_init:
        torch.save({k: v.to(torch.bfloat16).cpu() for k, v in T.items()}, os.path.join(a.out, "target.pt"))
    torch.backends.cuda.matmul.allow_tf32 = True
    dump(a, res)

    log("== drafter data")
    gen_until = [time.time() + a.gen_seconds] if a.gen_seconds > 0 else []
    if a.data_only:
        if not a.save_data:
            log("  --data-only without --save-data: the data is generated and dropped")
        gen_until.append(t_all + a.deadline - 15)
    elif a.drafter_steps == 0:
        gen_until.append(t_all + a.deadline - 45 - a.min_drafter_seconds)
    buckets = make_drafter_data(a, Tb, train, dev, res, min(gen_until) if gen_until else None)
    dump(a, res)
    if a.data_only:
        res["total_seconds"] = round(time.time() - t_all, 1)
        dump(a, res)
        log(f"data only: done in {res['total_seconds']}s" + (f"; saved {a.save_data}" if a.save_data else ""))
        return
    if not buckets:
        raise SystemExit("no drafter data: the time bound came before the first batch (raise --deadline / --gen-seconds)")
    log("== drafter")
    if a.drafter_steps == 0:
        a.drafter_seconds = max(10.0, min(a.drafter_seconds, a.deadline - (time.time() - t_all) - 45))
        log(f"  drafter budget {a.drafter_seconds:.0f}s")
    D = train_drafter(a, Tb, buckets, dev, res)
    Db = L.bf16_round(D)
    torch.save({k: v.to(torch.bfloat16).cpu() for k, v in D.items()}, os.path.join(a.out, "drafter.pt"))
    del buckets

    log("== offline DFLASH on held-out prompts (bf16 weights, fp32 forward)")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cpu").manual_seed(a.seed + 5)
    p = 64 if not a.smoke else 16
    starts = rint(0, held.numel() - p - 1, (a.eval_seqs,), g).to(dev)
    seqs, ties, n = L.greedy(Tb, L.windows(held, starts, p)[0], a.gen)
    feats = L.features(Tb, seqs)
    sim = L.dflash_sim(Db, Tb, seqs, feats, p)
    sim.update({"prompt_len": p, "gen": a.gen, "seqs": a.eval_seqs, "bf16_tie_frac_greedy": round(ties / n, 5)})
    res["dflash_sim_heldout"] = sim
    log("  ", sim)
    res["total_seconds"] = round(time.time() - t_all, 1)
    tgt = f"--target-init {a.target_init}" if a.target_init else f"--target-steps {res['target']['steps']}"
    res["reproduce"] = (f"python bench/textpair/train.py --data DATA --out OUT --seed {a.seed} {tgt} "
                        f"--drafter-steps {res['drafter']['steps']} --drafter-lr {a.drafter_lr} "
                        f"--block-size {a.block_size} --drafter-layers {a.drafter_layers} "
                        f"--drafter-intermediate {a.drafter_intermediate} --gen-seqs {a.gen_seqs}"
                        + (" --gen-cache" if a.gen_cache else "")
                        + ("" if res["drafter_data"]["complete"] else
                           " (the greedy data was cut short: --load-data the run's --save-data file)"))
    dump(a, res)
    log(f"done in {res['total_seconds']}s; reproduce: {res['reproduce']}")


def dump(a, res):
    with open(os.path.join(a.out, "log.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
