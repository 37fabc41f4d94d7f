"""Stand-in top-k fixtures from a real (tiny) torch language model's bf16 logits on real text.

Until the GPU test bed's DFlash drafter captures replace them, this makes
``tests/fixtures/topk_standin_bytelm.npz``: a byte-level GRU language model is trained for
about a minute on the CPU on the Python standard library's own sources (real text that ships
with every interpreter), then, for held-out contexts, it is rolled out greedily for D
positions; the logits at each position are cast to bf16 (as a drafter's are) and reduced to
top-K log-probs by the exact reference.

    python bench/capture_standin_fixtures.py [--seconds 60] [--out tests/fixtures]
"""
import argparse
import datetime
import glob
import json
import os
import sysconfig
import time

import numpy as np
import torch

from sglang_ddtree.reference import topk_logprobs_ref


def corpus(max_bytes=4_000_000):
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    train, held = [], []
    for i, f in enumerate(files):
        with open(f, "rb") as fh:
            (held if i % 10 == 0 else train).append(fh.read())
    tr = b"".join(train)[:max_bytes]
    he = b"".join(held)[:200_000]
    return torch.frombuffer(bytearray(tr), dtype=torch.uint8).long(), \
        torch.frombuffer(bytearray(he), dtype=torch.uint8).long(), len(files)


class ByteLM(torch.nn.Module):
    def __init__(self, hidden=256):
        super().__init__()
        self.emb = torch.nn.Embedding(256, hidden)
        self.rnn = torch.nn.GRU(hidden, hidden, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(hidden, 256)

    def forward(self, x, h=None):
        y, h = self.rnn(self.emb(x), h)
        return self.head(y), h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--k", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(2)
    train, held, nfiles = corpus()
    model = ByteLM()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t0, steps, seq, batch = time.time(), 0, 128, 32
    while time.time() - t0 < a.seconds:
        idx = torch.randint(0, len(train) - seq - 1, (batch,))
        x = torch.stack([train[i:i + seq] for i in idx])
        y = torch.stack([train[i + 1:i + seq + 1] for i in idx])
        logits, _ = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    model.eval()
    with torch.no_grad():
        idx = torch.randint(0, len(held) - 300, (64,))
        x = torch.stack([held[i:i + 256] for i in idx])
        hl, _ = model(x[:, :-1])
        held_loss = torch.nn.functional.cross_entropy(hl.reshape(-1, 256), x[:, 1:].reshape(-1)).item()
        starts = torch.randint(0, len(held) - 300, (a.bs,))
        ctx = torch.stack([held[i:i + 200] for i in starts])
        logits, h = model(ctx)
        last = logits[:, -1]
        rows = []
        for _ in range(a.depth):  # roll out the model's own top-1 chain, as a block drafter sees it
            rows.append(last.to(torch.bfloat16))
            nxt = last.argmax(-1, keepdim=True)
            out, h = model(nxt, h)
            last = out[:, -1]
        block = torch.stack(rows, 1).float().numpy()  # [bs, D, 256], values exactly bf16
    lp, ids = topk_logprobs_ref(block, a.k)
    meta = dict(logits_dtype="bfloat16", vocab_size=256, budget=a.k, K=a.k, D=a.depth,
                source=(f"stand-in: byte-level 2x256 GRU LM trained {steps} steps ({a.seconds:.0f}s CPU) on "
                        f"{nfiles} Python stdlib files (held-out every 10th file, loss {held_loss:.3f} nats/byte); "
                        "greedy roll-out of D positions from held-out contexts"),
                captured_by=f"bench/capture_standin_fixtures.py --seconds {a.seconds} --seed {a.seed}",
                date=datetime.date.today().isoformat(), device="cpu")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "topk_standin_bytelm.npz")
    np.savez_compressed(path, log_probs=lp.astype(np.float32), token_ids=ids.astype(np.int64),
                        meta=np.array(json.dumps(meta)))
    print(path, lp.shape, meta["source"])


if __name__ == "__main__":
    main()
