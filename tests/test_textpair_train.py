"""bench/textpair/train.py trains a drafter of another shape against the shipped target (CPU smoke:
random token streams stand in for the corpus, so it needs no stdlib match): the block size, depth
and width flags reach the drafter, its loss and the offline DFLASH simulation."""
import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_drafter_only_run_with_a_block_16_drafter(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    torch.save(torch.randint(5, 2048, (20000,), generator=g).to(torch.int16), data / "train.pt")
    torch.save(torch.randint(5, 2048, (4000,), generator=g).to(torch.int16), data / "heldout.pt")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "textpair", "train.py"), "--data", str(data),
                        "--out", str(out), "--device", "cpu", "--smoke", "--threads", "2",
                        "--target-init", os.path.join(REPO, "sglang_ddtree", "data", "textpair", "target.safetensors"),
                        "--block-size", "16", "--drafter-layers", "3", "--drafter-intermediate", "320"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = json.load(open(out / "log.json"))
    cfg = log["drafter_config"]
    assert (cfg["block_size"], cfg["dflash_config"]["block_size"], cfg["num_hidden_layers"],
            cfg["intermediate_size"]) == (16, 16, 3, 320)
    assert len(log["dflash_sim_heldout"]["depth_top1"]) == 15
    assert "--block-size 16 --drafter-layers 3 --drafter-intermediate 320" in log["reproduce"]
    sd = torch.load(out / "drafter.pt")
    assert {k.split(".")[1] for k in sd if k.startswith("layers.")} == {"0", "1", "2"}
    assert sd["layers.0.mlp.gate_proj.weight"].shape == (320, 256)


TARGET = os.path.join(REPO, "sglang_ddtree", "data", "textpair", "target.safetensors")
# drafter-only, tiny: 2 prompt lengths x 16 sequences in batches of 8 (two batches a length)
TINY = ["--device", "cpu", "--threads", "1", "--target-init", TARGET, "--block-size", "16",
        "--drafter-layers", "1", "--drafter-intermediate", "64", "--seq", "64", "--prompt-lens", "16", "24",
        "--gen", "20", "--gen-seqs", "16", "--gen-batch", "8", "--drafter-batch", "8", "--drafter-steps", "6",
        "--eval-seqs", "2", "--log-every", "3", "--warmup", "4"]


def _streams(path, seed):
    path.mkdir()
    g = torch.Generator().manual_seed(seed)
    torch.save(torch.randint(5, 2048, (6000,), generator=g).to(torch.int16), path / "train.pt")
    torch.save(torch.randint(5, 2048, (1200,), generator=g).to(torch.int16), path / "heldout.pt")


def _train(data, out, *extra):
    return subprocess.run([sys.executable, os.path.join(REPO, "bench", "textpair", "train.py"), "--data", str(data),
                           "--out", str(out), *TINY, *extra], capture_output=True, text=True, timeout=600)


def test_drafter_data_in_parts_is_the_data_of_one_run(tmp_path):
    """--save-data / --data-only / --gen-max-batches, then --load-data: the missing batches are
    generated, and the drafter is bit for bit the one of a single run; the saved drafter loads as a
    DRAFTER_RUN; a file made from another train stream is refused."""
    data = tmp_path / "data"
    _streams(data, 11)
    one = _train(data, tmp_path / "one", "--save-data", str(tmp_path / "one.pt"))
    assert one.returncode == 0, one.stderr[-3000:]
    part = _train(data, tmp_path / "p1", "--data-only", "--save-data", str(tmp_path / "p.pt"), "--gen-max-batches", "3")
    assert part.returncode == 0, part.stderr[-3000:]
    d1 = json.load(open(tmp_path / "p1" / "log.json"))["drafter_data"]
    assert (d1["seqs_done"], d1["complete"]) == ({"16": 16, "24": 8}, False)
    assert not (tmp_path / "p1" / "drafter.pt").exists()
    blob = torch.load(tmp_path / "p.pt")
    assert blob["seqs"][16].dtype == torch.int16 and tuple(blob["seqs"][16].shape) == (16, 36)
    rest = _train(data, tmp_path / "p2", "--load-data", str(tmp_path / "p.pt"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    l1, l2 = (json.load(open(tmp_path / d / "log.json")) for d in ("one", "p2"))
    assert l2["drafter_data"]["complete"] and l2["drafter_data"]["resumed"]
    assert l2["drafter_data"]["greedy_tokens"] == l1["drafter_data"]["greedy_tokens"] == 2 * 16 * 20
    assert l2["dflash_sim_heldout"] == l1["dflash_sim_heldout"]
    a, b = torch.load(tmp_path / "one" / "drafter.pt"), torch.load(tmp_path / "p2" / "drafter.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sys.path.insert(0, REPO)
    from sglang_ddtree.textpair import load_drafter_run
    sd, cfg = load_drafter_run(str(tmp_path / "p2"))
    assert cfg["block_size"] == 16 and sd["layers.0.mlp.gate_proj.weight"].shape == (64, 256)
    other = tmp_path / "other"
    _streams(other, 12)
    bad = _train(other, tmp_path / "bad", "--load-data", str(tmp_path / "one.pt"))
    assert bad.returncode != 0 and "refused" in bad.stdout + bad.stderr


def test_kv_cached_greedy_is_the_full_recompute_in_fp32():
    """pairlib.greedy_cached (--gen-cache) takes the same greedy tokens as pairlib.greedy in fp32
    (only the per-step work differs), ties counted the same way."""
    sys.path.insert(0, os.path.join(REPO, "bench", "textpair"))
    import common as C
    import pairlib as PL
    T = {k: v.float() for k, v in C.read_safetensors(TARGET).items() if k != "lm_head.weight"}
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    prompts = torch.randint(5, 2048, (6, 20), generator=g)
    a, b = PL.greedy(T, prompts, 16), PL.greedy_cached(T, prompts, 16)
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def _budget_run(rechecks, seconds=390.0, calib=(200, 400), slow=(0.099, 400), fast=0.05):
    """StepBudget driven by a fake clock: steps before ``slow[1]`` take ``slow[0]`` s, later ones
    ``fast`` s (the code pair drafter's measured 99 ms / ~50 ms).  Returns (steps run, seconds)."""
    sys.path.insert(0, os.path.join(REPO, "bench", "textpair"))
    import train as T
    now = [0.0]
    b = T.StepBudget(0, seconds, calib, rechecks, clock=lambda: now[0])
    step, steps = 0, 0
    while step < (steps or 10 ** 9):
        now[0] += slow[0] if step < slow[1] else fast
        step += 1
        steps = b.update(step)
    return step, now[0], b.fixes


def test_step_budget_spends_the_budget_after_a_slow_start():
    """Fixed once at step 400 from the slow start, the count stops the drafter at ~60 % of its
    budget (the control, rechecks off); re-fixed at 25 / 50 / 75 % it ends within 3 % of it."""
    steps, secs, fixes = _budget_run(rechecks=(0.25, 0.5, 0.75))
    assert 0.97 * 390 <= secs <= 1.01 * 390, (steps, secs, fixes)
    assert len(fixes) == 4 and fixes[0][0] == 400
    steps0, secs0, fixes0 = _budget_run(rechecks=())
    assert secs0 < 0.7 * 390 and len(fixes0) == 1, (steps0, secs0)
    # a steady speed: the rechecks change nothing that matters
    steps1, secs1, _ = _budget_run(rechecks=(0.25, 0.5, 0.75), slow=(0.05, 0))
    assert abs(secs1 - 390) <= 0.5 and abs(steps1 - 7800) <= 10, (steps1, secs1)


def test_step_budget_fixed_count_is_kept():
    sys.path.insert(0, os.path.join(REPO, "bench", "textpair"))
    import train as T
    b = T.StepBudget(123, 5.0, clock=lambda: 0.0)
    assert [b.update(s) for s in (1, 20, 60, 100)] == [123] * 4 and b.fixes == []


def test_multi_anchor_flags_reach_the_drafter_step(tmp_path):
    """--anchors-per-seq 2 --loss-decay-gamma 7: 8 // 2 = 4 sequences x 2 anchors a step, logged;
    more anchors than a sequence holds (gen 20 - block 16 + 2 = 6) is refused."""
    _streams(tmp_path / "data", 11)
    r = _train(tmp_path / "data", tmp_path / "out", "--anchors-per-seq", "2", "--loss-decay-gamma", "7")
    assert r.returncode == 0, r.stderr[-3000:]
    dr = json.load(open(tmp_path / "out" / "log.json"))["drafter"]
    assert (dr["anchors_per_seq"], dr["seqs_per_step"], dr["blocks_per_step"], dr["loss_decay_gamma"]) == (2, 4, 8, 7.0)
    assert dr["steps"] == 6 and all(len(c) == 2 + 15 for c in dr["curve"])
    r = _train(tmp_path / "data", tmp_path / "out2", "--anchors-per-seq", "7")
    assert r.returncode != 0 and "--anchors-per-seq 7: needs <= 6" in r.stdout + r.stderr
