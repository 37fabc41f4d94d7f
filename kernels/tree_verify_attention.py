"""Tree-verify attention over SGLang's paged KV (page size 1): prefix unmasked, tree tail from the
bit-packed ancestor mask, split-KV partials merged by their log-sum-exp.  GQA and absorbed MLA.

``tree_verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens,
mask_words, sm_scale, *, out=None, num_splits=None, max_prefix=None)`` -> ``[bs*N, Hq, Dv]``.

q ``[bs*N, Hq, D]`` (query ``i`` of request ``b`` is row ``b*N + i``); ``k_cache [S, Hkv, D]``,
``v_cache [S, Hkv, Dv]``; request ``b``'s KV slots are ``req_to_token[req_pool_indices[b],
0:prefix_lens[b]+N]``: the prefix, then the tree's own K/V at ``prefix .. prefix+N-1``.
``mask_words [bs, N, ceil(N/32)] int32`` is ``Tree.mask_words`` (bit ``j`` of word ``w`` = tree
column ``32w+j``).  Query ``i`` sees every prefix token and the tree columns whose bit is set.
GQA: ``Hq = G * Hkv``, query head ``h`` reads kv head ``h // G``.  Softmax and accumulation in
fp32, output in q's dtype.  A row that sees nothing (no bit set; never the case for a Tree,
whose rows always see themselves) gives 0.

``tree_verify_attention_mla(q_nope_absorbed, q_rope, kv_cache, ..., sm_scale, *, kv_lora_rank,
...)``: DeepseekV3 / Kimi K2's absorbed form as SGLang's triton backend runs it (``q = cat(q_nope
@ W_kc, q_pe)``, ``k = kv_cache [S, 1, kv_lora_rank + rope]``, ``v = k[..., :kv_lora_rank]``,
scale = ``layer.scaling``): score = ``sm_scale * (q_nope . kv[:, :lora] + q_rope . kv[:, lora:])``,
value = ``kv[:, :lora]``; returns ``[bs*N, H, kv_lora_rank]``.

Design.  Stage 1 (``_partial_kernel``), grid ``(bs * MB, Hkv, num_splits + 1)``: one program
holds ALL N queries x the G query heads of one kv head as one ``[BLOCK_M, D]`` tile (rows
``r = i*G + g``; ``MB = cdiv(N*G, BLOCK_M)`` tiles, 1 for the usual shapes) and runs flash
attention over one chunk of the request's prefix (no mask, slots gathered from req_to_token), so
each prefix KV block is read once per (request, kv head, tile).  The chunk is ``cdiv(cdiv(prefix,
num_splits), BLOCK_N) * BLOCK_N`` tokens, computed on the device; empty chunks (prefix 0, short
prefixes) write lse = -inf.  The last split index is the N x N tree tail, masked by the bits.
Each program writes its normalised partial output and base-2 LSE.  Stage 2 (``_merge_kernel``),
grid ``(bs*N, Hq)``: LSE-weighted merge of the ``num_splits + 1`` partials into ``out``.
Every shape and the grid depend only on (bs, N, heads, dims, num_splits): no host sync,
CUDA-graph capturable (the fp32 workspace is allocated per call unless ``workspace`` is given).

Launch rules (host): ``num_splits`` if given, else ``occupancy_num_splits``: ~2 programs per SM
(``bs * cdiv(N*G, BLOCK_M) * Hkv`` programs per split), at most ``clamp(cdiv(bound, 256), 1, 32)``
with ``bound = max_prefix`` if given, else the KV pool size ``S`` (an upper bound of every prefix).
Tiles and compile options: ``launch_config`` (overridable with ``config``).  The split count is a
runtime argument, not a constexpr: a server capturing verify graphs for ~27 batch sizes, whose
occupancy rule gives ~10 different counts, compiles the partial kernel at most three times (Triton
specialises ints equal to 1 and multiples of 16) instead of once per count (H200, Kimi-widths MLA:
the verify graph capture took 33 s with one compile per count, 7 s with SGLang's kernel).

Reference: ``tree_verify_attention_torch`` / ``tree_verify_attention_mla_torch`` (dense gather and
dense mask from the words, fp32 softmax).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MIN_CHUNK = 256
MAX_SPLITS = 32


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 accumulation; fp32 inputs exactly (no tf32).  UPCAST (interpreter only): Triton 3.6's
    interpreter multiplies bf16 bit patterns in tl.dot, so the (already rounded) operands go in as
    fp32 there, which is the same product the GPU's bf16 MMA accumulates in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _partial_kernel(
    q_ptr, qr_ptr, k_ptr, kr_ptr, v_ptr, r2t_ptr, rpi_ptr, plen_ptr, mw_ptr,
    mo_ptr, ml_ptr,
    qk_scale,
    s_qt, s_qh, s_qrt, s_qrh,
    s_ks, s_kh, s_krs, s_krh, s_vs, s_vh,
    s_r2t, s_mot, s_moh, s_mos, s_mlt, s_mlh,
    N, G, NW, M, MB, D1, D2, DV,
    NUM_SPLITS, HAS_ROPE: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, SHARED_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid0 = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid0 // MB
    mb = pid0 % MB
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    qi = rows // G
    head = kvh * G + rows % G
    tok = (b * N + qi).to(tl.int64)
    d1 = tl.arange(0, BLOCK_D1)
    dv = tl.arange(0, BLOCK_DV)
    q1 = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d1[None, :],
                 mask=row_ok[:, None] & (d1[None, :] < D1), other=0.0)
    if HAS_ROPE:
        d2 = tl.arange(0, BLOCK_D2)
        q2 = tl.load(qr_ptr + tok[:, None] * s_qrt + head[:, None] * s_qrh + d2[None, :],
                     mask=row_ok[:, None] & (d2[None, :] < D2), other=0.0)
    rpi = tl.load(rpi_ptr + b).to(tl.int64)
    plen = tl.load(plen_ptr + b).to(tl.int32)
    r2t_row = r2t_ptr + rpi * s_r2t
    k_base = k_ptr + kvh.to(tl.int64) * s_kh
    kr_base = kr_ptr + kvh.to(tl.int64) * s_krh
    v_base = v_ptr + kvh.to(tl.int64) * s_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    is_tail = split == NUM_SPLITS
    if is_tail:
        start = plen
        end = plen + N
    else:
        chunk = tl.cdiv(tl.cdiv(plen, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = tl.minimum(split * chunk, plen)
        end = tl.minimum(start + chunk, plen)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        slot = tl.load(r2t_row + cols, mask=col_ok, other=0).to(tl.int64)
        # K rows as [BLOCK_N, D] (each slot's row contiguous), used transposed in the dot
        k = tl.load(k_base + slot[:, None] * s_ks + d1[None, :],
                    mask=col_ok[:, None] & (d1[None, :] < D1), other=0.0)
        s = _dot(q1, tl.trans(k), IEEE, UPCAST)
        if HAS_ROPE:
            kr = tl.load(kr_base + slot[:, None] * s_krs + d2[None, :],
                         mask=col_ok[:, None] & (d2[None, :] < D2), other=0.0)
            s += _dot(q2, tl.trans(kr), IEEE, UPCAST)
        s = s * qk_scale
        vis = col_ok[None, :] & row_ok[:, None]
        if is_tail:
            tcol = cols - plen
            words = tl.load(mw_ptr + tok[:, None] * NW + (tcol // 32)[None, :], mask=vis, other=0)
            vis = vis & (((words >> (tcol % 32)[None, :]) & 1) != 0)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if SHARED_V:   # absorbed MLA: the values are the latent rows already loaded as K
            v = k
        else:
            v = tl.load(v_base + slot[:, None] * s_vs + dv[None, :],
                        mask=col_ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(mo_ptr + tok[:, None] * s_mot + head[:, None] * s_moh + split * s_mos + dv[None, :],
             o, mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(ml_ptr + tok * s_mlt + head * s_mlh + split, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    mo_ptr, ml_ptr, out_ptr,
    s_mot, s_moh, s_mos, s_mlt, s_mlh, s_ot, s_oh,
    NS, DV,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(ml_ptr + t * s_mlt + h * s_mlh + sp, mask=sp < NS, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    den = tl.sum(w, 0)
    o = tl.load(mo_ptr + t * s_mot + h * s_moh + sp[:, None] * s_mos + dv[None, :],
                mask=(sp[:, None] < NS) & (dv[None, :] < DV), other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + t * s_ot + h * s_oh + dv, o.to(out_ptr.dtype.element_ty), mask=dv < DV)


def default_num_splits(bound: int) -> int:
    """Prefix splits from an upper bound of the prefix length (host int, never a device value)."""
    return max(1, min(MAX_SPLITS, -(-int(bound) // MIN_CHUNK)))


def block_dim(d: int) -> int:
    """The tile width of a head dimension ``d``: next power of two, at least 16."""
    return max(16, triton.next_power_of_2(int(d)))


WAVES = 2            # target programs per SM of the partial kernel (H200 tuning, see occupancy_num_splits)
_NUM_SMS = {}


def num_sms(device=None) -> int:
    """The device's SM count (cached); 132 (an H100 / H200) without CUDA (the interpreter)."""
    if not torch.cuda.is_available():
        return 132
    idx = torch.cuda.current_device() if device is None else torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def occupancy_num_splits(bs: int, M: int, Hkv: int, bound: int, *, block_d1: int = 128,
                         block_dv: int = 128, config: Optional[dict] = None, sms: Optional[int] = None,
                         cap: Optional[int] = None) -> int:
    """Prefix splits for a launch of ``bs`` requests, ``M = N * G`` query rows per kv head: enough
    splits that the partial kernel has ~WAVES programs per SM, never more than the prefix bound
    allows (``default_num_splits(bound)``, chunks >= MIN_CHUNK) or ``cap``.  Host ints only, so a
    CUDA graph captured at one batch size keeps its grid.  Why (H200, bench/results/
    verify_attention_h200.md, tuning table): each split adds a partial write and a merge read of
    ``[bs*N, Hq, Dv]`` fp32; at bs 32 one split was 1.17-1.43x faster than 32, while bs 1 needs
    them (GQA 32k: 820 us with 1 split, 56 with 32)."""
    tiles = -(-M // launch_config(M, block_d1, block_dv, config)["BLOCK_M"])
    programs = max(1, bs * tiles * Hkv)
    want = -(-WAVES * (sms or num_sms()) // programs)
    n = min(default_num_splits(bound), max(1, want))
    return max(1, n if cap is None else min(n, int(cap)))


CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def launch_config(M: int, block_d1: int, block_dv: int, config: Optional[dict] = None) -> dict:
    """The partial kernel's tile and compile options: the defaults (BLOCK_M = next_pow2(N*G) in
    [16, 64]; BLOCK_N 64; head dims <= 128: 4 warps, Triton's default stages; wider (absorbed MLA's
    512 + 64): 8 warps, 2 stages, 1.2-1.3x faster than BLOCK_N 32 on the H200 tuning cells) with
    ``config``'s keys (CONFIG_KEYS) on top.  Tiles must be powers of two >= 16."""
    wide = max(block_d1, block_dv) > 128
    cfg = dict(BLOCK_M=max(16, min(64, triton.next_power_of_2(M))), BLOCK_N=64,
               num_warps=8 if wide else 4, num_stages=2 if wide else None)
    for k, v in (config or {}).items():
        if k not in CONFIG_KEYS:
            raise ValueError(f"unknown launch config key {k!r} (known: {', '.join(CONFIG_KEYS)})")
        cfg[k] = v
    for k in ("BLOCK_M", "BLOCK_N"):
        v = cfg[k]
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{k} must be a power of two >= 16, got {v!r}")
    if not isinstance(cfg["num_warps"], int) or cfg["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {cfg['num_warps']!r}")
    if cfg["num_stages"] is not None and (not isinstance(cfg["num_stages"], int) or cfg["num_stages"] < 1):
        raise ValueError(f"num_stages must be a positive int, got {cfg['num_stages']!r}")
    return cfg


def _compile_opts(cfg: dict) -> dict:
    opts = dict(num_warps=cfg["num_warps"])
    if cfg["num_stages"] is not None:
        opts["num_stages"] = cfg["num_stages"]
    return opts


def _check(name, t, ndim, dtypes=None):
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-d tensor")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} dtype {t.dtype} not in {dtypes}")


_INT = (torch.int32, torch.int64)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _launch(q1, q2, k1, k2, v, req_to_token, req_pool_indices, prefix_lens, mask_words, sm_scale,
            G, out, num_splits, max_prefix, workspace, shared_v=False, config=None):
    T, Hq, D1 = q1.shape
    bs, N, NW = mask_words.shape
    Hkv = k1.shape[1]
    DV = v.shape[2]
    D2 = 0 if q2 is None else q2.shape[2]
    if T != bs * N or prefix_lens.shape != (bs,) or req_pool_indices.shape != (bs,):
        raise ValueError(f"shapes disagree: q rows {T}, mask_words {tuple(mask_words.shape)}, "
                         f"prefix_lens {tuple(prefix_lens.shape)}, req_pool_indices "
                         f"{tuple(req_pool_indices.shape)}")
    if NW != (N + 31) // 32:
        raise ValueError(f"mask_words has {NW} words per row, need ceil({N}/32)")
    if out is None:
        out = torch.empty((T, Hq, DV), dtype=q1.dtype, device=q1.device)
    elif out.shape != (T, Hq, DV) or out.stride(2) != 1:
        raise ValueError(f"out must be [{T}, {Hq}, {DV}] with unit last stride")
    if T == 0:
        return out
    BLOCK_D1, BLOCK_DV = block_dim(D1), block_dim(DV)
    if num_splits is None:
        num_splits = occupancy_num_splits(bs, N * G, Hkv, k1.shape[0] if max_prefix is None else max_prefix,
                                          block_d1=BLOCK_D1, block_dv=BLOCK_DV, config=config,
                                          sms=num_sms(q1.device) if q1.is_cuda else None)
    num_splits = int(num_splits)
    if num_splits < 1:
        raise ValueError("num_splits must be >= 1")
    NS = num_splits + 1
    if workspace is None:
        mid_o = torch.empty((T, Hq, NS, DV), dtype=torch.float32, device=q1.device)
        mid_l = torch.empty((T, Hq, NS), dtype=torch.float32, device=q1.device)
    else:
        mid_o, mid_l = workspace
        if mid_o.shape != (T, Hq, NS, DV) or mid_l.shape != (T, Hq, NS):
            raise ValueError("workspace must be ([T, Hq, num_splits+1, Dv], [T, Hq, num_splits+1]) fp32")
    for name, t in (("q", q1), ("k_cache", k1), ("v_cache", v)) + (() if q2 is None else (("q_rope", q2), ("k_rope", k2))):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit last stride")
    req_to_token = req_to_token if req_to_token.stride(1) == 1 else req_to_token.contiguous()
    mask_words = mask_words.contiguous()
    M = N * G
    BLOCK_D2 = block_dim(max(D2, 1))
    cfg = launch_config(M, BLOCK_D1, BLOCK_DV, config)
    BLOCK_M, BLOCK_N = cfg["BLOCK_M"], cfg["BLOCK_N"]
    MB = triton.cdiv(M, BLOCK_M)
    shared_v = bool(shared_v) and D1 == DV
    has_rope = q2 is not None
    qr, kr = (q2, k2) if has_rope else (q1, k1)
    grid = (bs * MB, Hkv, NS)
    _partial_kernel[grid](
        q1, qr, k1, kr, v, req_to_token, req_pool_indices, prefix_lens, mask_words,
        mid_o, mid_l, float(sm_scale) * _LOG2E,
        q1.stride(0), q1.stride(1), qr.stride(0), qr.stride(1),
        k1.stride(0), k1.stride(1), kr.stride(0), kr.stride(1), v.stride(0), v.stride(1),
        req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_l.stride(0), mid_l.stride(1),
        N, G, NW, M, MB, D1, D2, DV,
        num_splits, HAS_ROPE=has_rope, IEEE=q1.dtype == torch.float32,
        UPCAST=_INTERPRET and q1.dtype != torch.float32, SHARED_V=shared_v,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D1=BLOCK_D1, BLOCK_D2=BLOCK_D2,
        BLOCK_DV=BLOCK_DV, **_compile_opts(cfg),
    )
    _merge_kernel[(T, Hq)](
        mid_o, mid_l, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_l.stride(0), mid_l.stride(1),
        out.stride(0), out.stride(1), NS, DV,
        BLOCK_S=max(2, triton.next_power_of_2(NS)), BLOCK_DV=BLOCK_DV, num_warps=4,
    )
    return out


def _check_index_args(req_to_token, req_pool_indices, prefix_lens, mask_words):
    _check("req_to_token", req_to_token, 2, _INT)
    _check("req_pool_indices", req_pool_indices, 1, _INT)
    _check("prefix_lens", prefix_lens, 1, _INT)
    _check("mask_words", mask_words, 3, (torch.int32,))


def tree_verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens,
                          mask_words, sm_scale, *, out=None, num_splits: Optional[int] = None,
                          max_prefix: Optional[int] = None, workspace=None, config: Optional[dict] = None):
    """See module docstring.  ``num_splits`` / ``max_prefix``: host ints fixing the prefix split
    count (default from the pool size); ``workspace``: optional preallocated fp32
    ``([bs*N, Hq, num_splits+1, Dv], [bs*N, Hq, num_splits+1])``; ``config``: launch overrides
    (``launch_config``; bench/verify_attention.py --tune)."""
    _check("q", q, 3, _FLOAT)
    _check("k_cache", k_cache, 3, (q.dtype,))
    _check("v_cache", v_cache, 3, (q.dtype,))
    _check_index_args(req_to_token, req_pool_indices, prefix_lens, mask_words)
    Hq, Hkv = q.shape[1], k_cache.shape[1]
    if (q.shape[2] != k_cache.shape[2] or v_cache.shape[:2] != k_cache.shape[:2]
            or Hkv == 0 or Hq % Hkv):
        raise ValueError(f"bad head shapes: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, "
                         f"v {tuple(v_cache.shape)}")
    return _launch(q, None, k_cache, None, v_cache, req_to_token, req_pool_indices, prefix_lens,
                   mask_words, sm_scale, Hq // Hkv, out, num_splits, max_prefix, workspace,
                   config=config)


def tree_verify_attention_mla(q_nope_absorbed, q_rope, kv_cache, req_to_token, req_pool_indices,
                              prefix_lens, mask_words, sm_scale, *, kv_lora_rank: int, out=None,
                              num_splits: Optional[int] = None, max_prefix: Optional[int] = None,
                              workspace=None, config: Optional[dict] = None):
    """See module docstring.  ``kv_cache [S, 1, kv_lora_rank + rope_dim]``; the latent tile
    loaded for the scores is the value tile too (one load per KV block)."""
    _check("q_nope_absorbed", q_nope_absorbed, 3, _FLOAT)
    _check("q_rope", q_rope, 3, (q_nope_absorbed.dtype,))
    _check("kv_cache", kv_cache, 3, (q_nope_absorbed.dtype,))
    _check_index_args(req_to_token, req_pool_indices, prefix_lens, mask_words)
    L = int(kv_lora_rank)
    T, H, _ = q_nope_absorbed.shape
    R = kv_cache.shape[2] - L
    if (kv_cache.shape[1] != 1 or q_nope_absorbed.shape[2] != L or R < 1
            or q_rope.shape != (T, H, R)):
        raise ValueError(f"bad MLA shapes: q_nope {tuple(q_nope_absorbed.shape)}, q_rope "
                         f"{tuple(q_rope.shape)}, kv_cache {tuple(kv_cache.shape)}, lora {L}")
    lat = kv_cache[:, :, :L]
    rope = kv_cache[:, :, L:]
    return _launch(q_nope_absorbed, q_rope, lat, rope, lat, req_to_token, req_pool_indices,
                   prefix_lens, mask_words, sm_scale, H, out, num_splits, max_prefix, workspace,
                   shared_v=True, config=config)


# ----------------------------------------------------------------------------- torch reference

def unpack_mask_words_torch(mask_words: torch.Tensor, N: int) -> torch.Tensor:
    """[..., NW] int32 -> [..., N] bool (bit j of word w = column 32w+j)."""
    bits = (mask_words.to(torch.int64)[..., None] >> torch.arange(32, device=mask_words.device)) & 1
    return bits.reshape(*mask_words.shape[:-1], -1)[..., :N].bool()


def _ref(score_fn, vals_fn, T, H, DV, req_to_token, req_pool_indices, prefix_lens, mask_words,
         sm_scale, dtype, device):
    bs, N, _ = mask_words.shape
    out = torch.zeros((T, H, DV), dtype=torch.float32, device=device)
    tree_vis = unpack_mask_words_torch(mask_words, N)
    for b in range(bs):
        L = int(prefix_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :L + N].long()
        rows = slice(b * N, (b + 1) * N)
        s = score_fn(rows, slots) * sm_scale                       # [H, N, L+N] fp32
        vis = torch.cat([torch.ones((N, L), dtype=torch.bool, device=device), tree_vis[b]], 1)
        s = s.masked_fill(~vis[None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)               # a row seeing nothing -> 0
        out[rows] = torch.einsum("hns,shd->nhd", p, vals_fn(slots))
    return out.to(dtype)


def tree_verify_attention_torch(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens,
                                mask_words, sm_scale):
    """Dense reference: gather each request's K/V rows, dense [N, prefix+N] mask, fp32 softmax."""
    T, Hq, _ = q.shape
    G = Hq // k_cache.shape[1]

    def score(rows, slots):
        k = k_cache[slots].float().repeat_interleave(G, dim=1)     # [L+N, Hq, D]
        return torch.einsum("nhd,shd->hns", q[rows].float(), k)

    def vals(slots):
        return v_cache[slots].float().repeat_interleave(G, dim=1)

    return _ref(score, vals, T, Hq, v_cache.shape[2], req_to_token, req_pool_indices, prefix_lens,
                mask_words, sm_scale, q.dtype, q.device)


def tree_verify_attention_mla_torch(q_nope_absorbed, q_rope, kv_cache, req_to_token,
                                    req_pool_indices, prefix_lens, mask_words, sm_scale, *,
                                    kv_lora_rank):
    """Dense reference of the absorbed MLA form (one latent KV head shared by every head)."""
    T, H, L = q_nope_absorbed.shape

    def score(rows, slots):
        kv = kv_cache[slots, 0].float()                            # [L+N, lora + rope]
        return (torch.einsum("nhd,sd->hns", q_nope_absorbed[rows].float(), kv[:, :kv_lora_rank])
                + torch.einsum("nhd,sd->hns", q_rope[rows].float(), kv[:, kv_lora_rank:]))

    def vals(slots):
        return kv_cache[slots, :, :kv_lora_rank].float().expand(-1, H, -1)

    return _ref(score, vals, T, H, kv_lora_rank, req_to_token, req_pool_indices, prefix_lens,
                mask_words, sm_scale, q_nope_absorbed.dtype, q_nope_absorbed.device)
