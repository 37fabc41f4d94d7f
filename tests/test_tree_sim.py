"""bench/textpair/pairlib.tree_sim, the offline DDTree the code pair's recipe reports beside the chain,
on drafters built so that the best-first tree and its accepted path are known by construction:
  * a confident drafter (rank 0 at ~0 log-prob, every other rank at -20): the budget-(B-1) tree is the
    (B-1)-deep chain of rank-0 tokens (B = the pair's block), so tree_sim gives the chain's rounds and
    no sibling win;
  * the greedy token always second at depth 1 (log-prob -0.70 against -0.69), first below it: budget
    B-1 holds only the wrong chain (1 token a round), budget 2(B-1)+1 both chains (B tokens a round,
    every round a sibling win);
  * a control with the greedy token nowhere in the top ranks must give 1 token a round.
The expected rounds come from the construction (how deep the rank-0 chain matches at each anchor),
not from the function's code."""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench", "textpair"))
import common as C  # noqa: E402
import pairlib as PL  # noqa: E402

V = 48
B = C.BLOCK_SIZE


def _seqs(g, S, L):
    return torch.randint(8, V, (S, L), generator=g)


def _fake(seqs, rank_of_greedy, match_depth):
    """drafter_logits stand-in: at anchor n, depth d (1..B-1), the greedy token seqs[s, n+d] sits at rank
    rank_of_greedy(d) while d <= match_depth(s, n), else at no rank (-30); the other ranks hold other
    tokens (rank 0 at -1e-5 d, the rest at -20 and below; -0.69 / -0.70 / -5 where the greedy token is
    second)."""
    def f(D, T, feats, root, n):
        S, L = seqs.shape
        out = torch.full((S, B - 1, V), -30.0)
        for s in range(S):
            for d in range(1, B):
                g = int(seqs[s, n + d]) if n + d < L else 5
                others = [t for t in range(8, V) if t != g]
                r = rank_of_greedy(d) if d <= match_depth(s, n) else None
                if rank_of_greedy(d) == 1:   # two near-equal candidates, a distant third
                    vals = {0: -0.69, 1: -0.70, 2: -5.0, 3: -22.0}
                else:                         # confident: extending a chain costs ~nothing
                    vals = {0: -1e-5 * d, 1: -20.0, 2: -21.0, 3: -22.0}
                for rk in range(4):
                    out[s, d - 1, g if r == rk else others.pop(0)] = vals[rk]
                # the rest of the vocabulary far below: a log-softmax over V keeps the ranks' order
        return out
    return f


def _chain_rounds(match, p, L):
    """Tokens per round of a chain whose round at anchor n accepts match(n) drafts (then the bonus)."""
    rounds = toks = 0
    for s in range(len(match)):
        n = p
        while n <= L - B:
            a = match[s](n)
            rounds, toks, n = rounds + 1, toks + a + 1, n + a + 1
    return toks / rounds, rounds


def test_confident_drafter_gives_the_chain(monkeypatch):
    g = torch.Generator().manual_seed(int(os.environ.get("DDTREE_TEST_SEED", "1")))
    S, p, G = 3, 8, 80
    L = p + G
    seqs = _seqs(g, S, L)
    depth = torch.randint(0, B, (S, L), generator=g)   # how deep the rank-0 chain matches at each anchor
    monkeypatch.setattr(PL, "drafter_logits", _fake(seqs, lambda d: 0, lambda s, n: int(depth[s, n])))
    out = PL.tree_sim(None, None, seqs, torch.zeros(S, L, 1), p, [B - 1])[str(B - 1)]
    tpr, rounds = _chain_rounds([lambda n, s=s: int(depth[s, n]) for s in range(S)], p, L)
    assert out["rounds"] == rounds
    assert out["tokens_per_round"] == pytest.approx(tpr, abs=1e-3)
    assert out["sibling_win_round_frac"] == 0.0


def test_second_rank_wins_only_with_room_for_both_chains(monkeypatch):
    g = torch.Generator().manual_seed(int(os.environ.get("DDTREE_TEST_SEED", "2")))
    S, p, G = 2, 8, 64
    L = p + G
    seqs = _seqs(g, S, L)
    monkeypatch.setattr(PL, "drafter_logits", _fake(seqs, lambda d: 1 if d == 1 else 0, lambda s, n: B))
    one, both = str(B - 1), str(2 * (B - 1) + 1)
    out = PL.tree_sim(None, None, seqs, torch.zeros(S, L, 1), p, [B - 1, 2 * (B - 1) + 1])
    assert out[one]["tokens_per_round"] == 1.0 and out[one]["sibling_win_round_frac"] == 0.0
    tpr, rounds = _chain_rounds([lambda n: B - 1] * S, p, L)
    assert out[both]["rounds"] == rounds and out[both]["tokens_per_round"] == pytest.approx(tpr, abs=1e-3)
    assert out[both]["sibling_win_round_frac"] == 1.0


def test_control_greedy_never_drafted(monkeypatch):
    g = torch.Generator().manual_seed(3)
    S, p, G = 2, 8, 40
    L = p + G
    seqs = _seqs(g, S, L)
    monkeypatch.setattr(PL, "drafter_logits", _fake(seqs, lambda d: 0, lambda s, n: 0))
    out = PL.tree_sim(None, None, seqs, torch.zeros(S, L, 1), p, [B - 1, 2 * B])
    assert out[str(B - 1)]["tokens_per_round"] == 1.0 and out[str(2 * B)]["tokens_per_round"] == 1.0
    assert out[str(2 * B)]["rounds"] == S * (L - B + 1 - p)
