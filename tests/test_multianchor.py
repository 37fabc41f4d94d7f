"""The multi-anchor DFlash training forward (sglang_ddtree.reference_model.drafter_forward_blocks,
bench/textpair/pairlib.drafter_loss_multi) against the served single-block forward
(reference_model.drafter_forward, run once per block): the same logits, the same loss; controls
show that a mask leaking the anchor's own context position or other blocks is caught."""
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from sglang_ddtree import reference_model as RM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench", "textpair"))

# a tiny block-16 drafter: 2 layers, hidden 32, 4 q / 2 kv heads x 8 (GQA), 3 target layers
CFG = dict(hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
           num_hidden_layers=2, rope_theta=10000.0)
V, B, MASK_ID, NT = 64, 16, 4, 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _drafter(seed=0):
    """Random weights large enough that attention is far from uniform (a wrong mask shows), norms
    not ones (a skipped norm shows)."""
    g = torch.Generator().manual_seed(seed)
    H, hd, nq, nkv, I = (CFG[k] for k in ("hidden_size", "head_dim", "num_attention_heads",
                                           "num_key_value_heads", "intermediate_size"))

    def lin(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i) * 1.5

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g)
    P = {"fc.weight": lin(H, NT * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(CFG["num_hidden_layers"]):
        p = f"layers.{i}."
        P.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.q_proj.weight": lin(nq * hd, H), p + "self_attn.k_proj.weight": lin(nkv * hd, H),
                  p + "self_attn.v_proj.weight": lin(nkv * hd, H), p + "self_attn.o_proj.weight": lin(H, nq * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "mlp.gate_proj.weight": lin(I, H), p + "mlp.up_proj.weight": lin(I, H),
                  p + "mlp.down_proj.weight": lin(H, I)})
    E = torch.randn(V, H, generator=g)
    return P, E, g


def _case(p=20, S=60, b=3):
    """Sequences [b, S], features [b, S, NT*H], anchors [b, 6] with a tie (two blocks at one anchor)
    and both extremes of the trainer's range p-1 .. S-B."""
    P, E, g = _drafter()
    seqs = torch.randint(5, V, (b, S), generator=g)
    feats = torch.randn(b, S, NT * CFG["hidden_size"], generator=g)
    lo, hi = p - 1, S - B
    anchors = torch.stack([torch.tensor([lo, hi, 30, 30, 25, lo + 1]),
                           torch.tensor([hi, 33, lo, 22, hi, 40]),
                           torch.tensor([31, 31, 31, lo, hi - 1, 27])])[:b]
    return P, E, seqs, feats, anchors


def _single(P, E, seqs, feats, a, i):
    """The served forward for sequence i's block at anchor a: logits [B-1, V]."""
    return RM.drafter_forward(P, CFG, B, MASK_ID, E, E, feats[i:i + 1, :a], seqs[i:i + 1, a], a)[0]


def _blocks(P, E, seqs, feats, anchors, mask=None):
    n_ctx = int(anchors.max())
    return RM.drafter_forward_blocks(P, CFG, B, MASK_ID, E, E, feats[:, :n_ctx], torch.gather(seqs, 1, anchors),
                                     anchors, mask)


def _rel(x, y):
    return float((x - y).abs().max() / y.abs().max())


def test_blocks_forward_equals_the_single_block_forward_per_block():
    P, E, seqs, feats, anchors = _case()
    lg = _blocks(P, E, seqs, feats, anchors)
    assert lg.shape == (3, 6, B - 1, V)
    for i in range(anchors.shape[0]):
        for j in range(anchors.shape[1]):
            ref = _single(P, E, seqs, feats, int(anchors[i, j]), i)
            assert _rel(lg[i, j], ref) < 1e-4, (i, j, _rel(lg[i, j], ref))
    # the context beyond the largest anchor is never seen: a longer feats changes nothing
    lg2 = RM.drafter_forward_blocks(P, CFG, B, MASK_ID, E, E, feats, torch.gather(seqs, 1, anchors), anchors)
    assert _rel(lg2, lg) < 1e-5


def test_a_leaky_mask_is_caught():
    """Controls: the same comparison fails for (a) context kv <= anchor (the anchor's own features,
    which the server does not have yet), (b) blocks seeing each other, (c) block rope positions at
    0..L-1 (sanity: the positions matter)."""
    P, E, seqs, feats, anchors = _case()
    b, N = anchors.shape
    n_ctx = int(anchors.max()) + 1          # one more column so that kv == anchor exists for the largest
    good = RM.dflash_blocks_mask(anchors, n_ctx, B)
    ref = torch.stack([torch.stack([_single(P, E, seqs, feats, int(anchors[i, j]), i) for j in range(N)])
                       for i in range(b)])
    roots = torch.gather(seqs, 1, anchors)

    def run(mask):
        return RM.drafter_forward_blocks(P, CFG, B, MASK_ID, E, E, feats[:, :n_ctx], roots, anchors, mask)
    assert _rel(run(good), ref) < 1e-4      # the built mask over the wider context still matches
    kv = torch.arange(n_ctx)
    at_anchor = good.clone()
    at_anchor[:, 0, :, :n_ctx] = kv.view(1, 1, -1) <= anchors.repeat_interleave(B, 1).unsqueeze(-1)
    see_all = good.clone()
    see_all[:, 0, :, n_ctx:] = True
    for bad in (at_anchor, see_all):
        d = (run(bad) - ref).abs().amax((-1, -2)) / ref.abs().amax((-1, -2))
        assert float(d.max()) > 1e-2       # a leak is far beyond the 1e-4 tolerance
    # a block's leak shows in its own logits: every block of at_anchor differs
    d = (run(at_anchor) - ref).abs().amax((-1, -2)) / ref.abs().amax((-1, -2))
    assert float(d.min()) > 1e-3, d


def _pair():
    """The text pair's shapes (block 8) with seeded random weights, through pairlib."""
    import pairlib as L
    import common as C
    T, D = C.target_init(5), C.drafter_init(6)
    g = torch.Generator().manual_seed(7)
    S, p = 40, 12
    seqs = torch.randint(5, C.VOCAB, (2, S), generator=g)
    feats = L.features(T, seqs).to(torch.bfloat16)       # stored as the trainer does
    Bk = C.BLOCK_SIZE
    anchors = torch.tensor([[p - 1, S - Bk, 20, 20], [S - Bk, p - 1, 15, 30]])
    return L, C, T, D, seqs, feats, anchors


def test_multi_loss_equals_the_mean_of_single_anchor_losses():
    L, C, T, D, seqs, feats, anchors = _pair()
    loss, ok = L.drafter_loss_multi(D, T, seqs, feats, anchors)
    assert ok.shape == (2, 4, C.BLOCK_SIZE - 1)
    singles, oks = [], []
    for i in range(2):
        for j in range(4):
            ce, o = L.drafter_loss(D, T, seqs[i:i + 1], feats[i:i + 1], int(anchors[i, j]))
            singles.append(ce)
            oks.append(o[0])
    ref = torch.stack(singles).mean()
    assert abs(float(loss) - float(ref)) < 1e-4 * float(ref)
    assert torch.equal(ok.reshape(-1, C.BLOCK_SIZE - 1), torch.stack(oks))
    # control: the labels are the block's own (a shifted label set is a different loss)
    sh = L.drafter_loss_multi(D, T, seqs, feats, anchors - 1)[0]
    assert abs(float(sh) - float(ref)) > 1e-3 * float(ref)


def test_decay_weighted_loss_is_the_hand_weighted_mean():
    L, C, T, D, seqs, feats, anchors = _pair()
    gamma = 3.0
    loss, _ = L.drafter_loss_multi(D, T, seqs, feats, anchors, gamma)
    num = den = 0.0
    for i in range(2):
        for j in range(4):
            a = int(anchors[i, j])
            lg = L.drafter_logits(D, T, feats[i:i + 1, :a].float(), seqs[i:i + 1, a], a)[0]
            for k in range(1, C.BLOCK_SIZE):      # label at block position k, weight exp(-(k-1)/gamma)
                ce = float(F.cross_entropy(lg[k - 1].float()[None], seqs[i, a + k][None]))
                w = math.exp(-(k - 1) / gamma)
                num, den = num + w * ce, den + w
    assert abs(float(loss) - num / den) < 1e-4 * (num / den)
    plain = float(L.drafter_loss_multi(D, T, seqs, feats, anchors)[0])
    assert abs(plain - num / den) > 1e-3 * plain     # control: the weighting changes the loss here
    # the single-anchor path takes the same weighting
    one = L.drafter_loss(D, T, seqs[:1], feats[:1], int(anchors[0, 0]), gamma)[0]
    two = L.drafter_loss_multi(D, T, seqs[:1], feats[:1], anchors[:1, :1], gamma)[0]
    assert abs(float(one) - float(two)) < 1e-4 * float(one)


def test_draw_anchors_are_distinct_and_span_the_range():
    import train as TR
    g = torch.Generator().manual_seed(0)
    lo, hi, n = 15, 24, 4
    seen = torch.zeros(hi + 2, dtype=torch.long)
    for _ in range(50):
        a = TR.draw_anchors(g, 8, n, lo, hi)
        assert a.shape == (8, n) and a.dtype == torch.long
        assert int(a.min()) >= lo and int(a.max()) <= hi
        assert all(len(set(r.tolist())) == n for r in a)
        seen += torch.bincount(a.flatten(), minlength=hi + 2)
    assert bool((seen[lo:hi + 1] > 0).all()) and int(seen[:lo].sum()) == 0
