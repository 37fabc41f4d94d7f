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
