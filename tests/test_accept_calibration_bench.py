"""bench/accept_calibration.py on a tiny case (text pair, CPU, reference backends): the exact
counterfactual it records equals an independent recount (a walk restricted to the first b slots, and
a real verify of a separately built budget-b tree); the prediction equals the sum of exp(path
log-prob) computed node by node, is monotone in b; the decoding stays lossless; the aggregates are
what they claim."""
import math
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import accept_calibration as AC  # noqa: E402
from sglang_ddtree import ddtree  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    return AC.load_pair("text")


def _walk(tokens, parent, target, limit):
    """Greedy accept length using only slots 1..limit (the budget-`limit` tree)."""
    cur, n = 0, 0
    while True:
        kids = [c for c in range(1, limit + 1) if parent[c] == cur and tokens[c] == target[cur]]
        if not kids:
            return n
        cur, n = kids[0], n + 1


def _path_logprob(tree, lp, ids, slot):
    s, i = 0.0, slot
    while i > 0:
        d = int(tree.depth[0, i]) - 1
        row = ids[0, d].tolist()
        s += float(lp[0, d, row.index(int(tree.tokens[0, i]))])
        i = int(tree.parent[0, i])
    return s


def test_budgets_of_the_pairs():
    assert AC.pair_budgets(8) == (28, [7, 15, 28])
    assert AC.pair_budgets(16) == (60, [7, 15, 31, 60])


def test_round_records_match_independent_recount(pair):
    budgets = [7, 15, 28]
    prompts = [p[:24] for p in AC.text_prompts(2)]
    checked_reverify, accepted = 0, 0
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(4):
            r = AC.run_round(pair, seq, budgets)
            tree, lp, ids, target = r["tree"], r["lp"], r["ids"], r["target"]
            tok, par, tgt = tree.tokens[0].tolist(), tree.parent[0].tolist(), target[0].tolist()
            for j, b in enumerate(budgets):
                assert r["exact"][j] == _walk(tok, par, tgt, b)
            assert r["exact"][-1] == int(r["acc"].accept_len[0])
            # prediction: sum of exp(path log-prob) over slots 1..b, node by node
            probs = [math.exp(_path_logprob(tree, lp, ids, i)) for i in range(1, budgets[-1] + 1)]
            want = [sum(probs[:b]) for b in budgets]
            np.testing.assert_allclose(r["pred"], want, rtol=1e-5, atol=1e-6)
            assert all(x <= y + 1e-7 for x, y in zip(r["pred"], r["pred"][1:]))
            assert all(0 <= p <= b for p, b in zip(r["pred"], budgets))
            # a budget-7 tree built and verified on its own accepts exactly the recorded count
            t7 = ddtree.build_tree(lp[..., :7].contiguous(), ids[..., :7].contiguous(), 7,
                                   root_tokens=torch.tensor([seq[-1]]), backend="reference")
            assert torch.equal(t7.tokens[0], tree.tokens[0, :8]) and torch.equal(t7.parent[0], tree.parent[0, :8])
            tg7 = pair.verify(seq, t7.tokens[0], t7.depth[0], t7.visibility[0])[None]
            a7 = ddtree.accept_greedy(t7, tg7, backend="reference")
            assert int(a7.accept_len[0]) == r["exact"][0]
            checked_reverify += 1
            accepted += r["exact"][-1]
            seq += r["new"]
    assert checked_reverify == 8 and accepted > 0      # the recounts saw real acceptance


def test_decode_is_lossless_and_summary_consistent(pair):
    budgets = [7, 15, 28]
    prompts = [p[:20] for p in AC.text_prompts(2)]
    recs = []
    for i, p in enumerate(prompts):
        rows, out = AC.decode_prompt(pair, p, 12, budgets)
        assert out == pair.greedy(p, 12)
        assert sum(r["emitted"] for r in rows) == 12
        assert [r["age"] for r in rows] == list(np.cumsum([0] + [r["emitted"] for r in rows[:-1]]))
        recs.append(dict(prompt=i, kind="text", rows=rows))
    s = AC.summarize(recs, budgets, "t")
    allr = [r for rec in recs for r in rec["rows"]]
    for j, b in enumerate(budgets):
        want = sum(r["exact"][j] for r in allr) / sum(r["pred"][j] for r in allr)
        assert s["pooled"][f"b{b}"]["ratio"] == pytest.approx(want, abs=1e-4)
    assert s["rounds"] == len(allr) and s["by_age"]["0-15"]["n"] == len(allr)


def test_stream_windows_concurrency():
    budgets = [7]
    mk = lambda v, n: [dict(age=0, pred=[1.0], exact=[v], emitted=1) for _ in range(n)]  # noqa: E731
    A = [mk(1.0, 16), mk(1.0, 16)]
    B = [mk(3.0, 16), mk(3.0, 16)]
    w = AC.stream_windows(A, B, budgets, [1.0], concurrency=1, keep=(10, 10))
    assert [x["w"] for x in w] == [-4, -3, -2, -1, 0, 1, 2, 3]
    assert [x["b7"]["exact"] for x in w] == [1.0] * 4 + [3.0] * 4
    assert w[4]["b7"]["rel_err_prev_window"] == pytest.approx(-2 / 3, abs=1e-3)
    w2 = AC.stream_windows(A, B, budgets, [1.0], concurrency=2, keep=(10, 10))
    # two slots: both A prompts run side by side (2 windows), then both B prompts
    assert [x["n"] for x in w2] == [16] * 4 and [x["frac_b"] for x in w2] == [0, 0, 1, 1]
