"""Scale a small trained Qwen3 / DFlash pair to a production shape that computes the same function.

The scaled target has the shape (and so the cost) of a production model but the trained pair's
greedy function, up to bf16 rounding; the scaled drafter proposes what the small drafter proposes.
Exact by construction (``tests/test_scale_transform.py`` checks it in fp32 against
``sglang_ddtree.reference_model`` on random pairs drawn fresh each run):

* **Residual stream, duplicated.** A small hidden vector x (size d) is stored as k = D / d copies
  ``[x, x, ..., x]``. The RMS of the copies is the RMS of x, so every RMSNorm keeps its weights
  (repeated k times) and its eps. Readers (q/k/v, gate/up, router, lm_head, the drafter's fc) read
  copy 0 (other columns zero); writers (embedding, o_proj, down_proj, fc) write every copy.
* **Heads.** Small q head j of kv group j // g_s goes to big q head (j // g_s) * g + j % g_s, so it
  keeps its kv head; the other heads have zero q (their attention output is then a mean of V, and
  o_proj reads none of it) and the other kv heads zero K / V.
* **Head dim** hd_s -> hd (r = hd / hd_s, an integer): neox RoPE pairs dim i with i + hd/2 at
  frequency theta^(-2i/hd), so small dim i sits at big dim r*i (and hd_s/2 + i at hd/2 + r*i) with
  the same frequency. q is zero elsewhere; k is repeated into the r dims of its group, so the k
  RMSNorm sees the same RMS, while q's RMSNorm over a zero-padded vector multiplies q by sqrt(r)
  -- exactly the factor that turns SGLang's softmax scale hd^-0.5 back into hd_s^-0.5. V is
  zero-padded; o_proj reads its first hd_s dims.
* **MLP** intermediate I_s -> I: zero rows in gate / up (silu(0) * 0 = 0), zero columns in down.
* **MoE** (Qwen3-MoE): every expert is the small MLP, zero-padded; the router is random (seeded),
  top-k weights are normalised (``norm_topk_prob``), so the MoE output is the MLP's whatever the
  router picks, while tokens spread over the experts as under a real router.
* **Layers** L_s -> L: small layer l sits at index l * (L // L_s); the others are copies of the
  layer before them with o_proj and down_proj zero (identity on the residual stream, full cost).
  The drafter's ``target_layer_ids`` map the same way (the hidden state after a real layer is
  unchanged by the identity layers after it). The drafter gets identity layers to its shape too.
* **Vocabulary** V_s -> V: the pair is first extended (:func:`extend_vocab`); ids the tokenizer
  never emits get learned-negative logits (``bench/scale/vocab.py``), so they never enter a tree.

    python bench/scale/transform.py write --shape qwen3-8b --out DIR [--weights DIR]
    python bench/scale/transform.py write --shape qwen3-8b --out DIR --pair code \
        --target-dir /tmp/models/code_target --drafter-dir /tmp/models/code_drafter \
        --junk /tmp/models/code_junk_head.json        # -> DIR/qwen3-8bcode_{target,drafter}

The code pair (bench/codepair, issue 42) comes as two Hugging Face folders; its junk rows are learned
for its own tokenizer and features (``vocab.py --pair code``), and the written folders carry its
tokenizer files and generation config.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch

SHAPES = {
    # Qwen3-8B (config.json of Qwen/Qwen3-8B); drafter: z-lab's DFlash b16 drafters for 8B-class
    # Qwen3 targets have 5 layers at the target's widths.
    "qwen3-8b": dict(kind="dense", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                     intermediate=12288, vocab=151936, drafter_layers=5, drafter_intermediate=12288,
                     max_position_embeddings=40960),
    # Qwen3-30B-A3B (48 layers; fewer when disk / memory need it: --layers)
    "qwen3-30b-a3b": dict(kind="moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                          experts=128, top_k=8, moe_intermediate=768, vocab=151936,
                          drafter_layers=5, drafter_intermediate=6144, max_position_embeddings=40960),
}


class ShapeError(ValueError):
    pass


def _ratio(big, small, what):
    if big < small or big % small:
        raise ShapeError(f"{what}: {big} is not a multiple of {small}")
    return big // small


def plan(small_cfg, shape):
    """Check that ``shape`` can hold the small config; return the index maps the transform uses."""
    d, D = small_cfg["hidden_size"], shape["hidden"]
    hd_s, hd = small_cfg["head_dim"], shape["head_dim"]
    nq_s, nkv_s = small_cfg["num_attention_heads"], small_cfg["num_key_value_heads"]
    nq, nkv = shape["heads"], shape["kv_heads"]
    copies = _ratio(D, d, "hidden size")
    r = _ratio(hd, hd_s, "head dim")
    g_s, g = nq_s // nkv_s, _ratio(nq, nkv, "q heads per kv head")
    if nkv < nkv_s or g < g_s:
        raise ShapeError(f"{nq} q / {nkv} kv heads cannot hold {nq_s} q / {nkv_s} kv heads")
    L_s, L = small_cfg["num_hidden_layers"], shape["layers"]
    if L < L_s:
        raise ShapeError(f"{L} layers < {L_s}")
    half_s, half = hd_s // 2, hd // 2
    q_dim = [r * i for i in range(half_s)] + [half + r * i for i in range(half_s)]
    k_src = [(j % half) // r + (half_s if j >= half else 0) for j in range(hd)]
    q_head = [(j // g_s) * g + j % g_s for j in range(nq_s)]
    return dict(d=d, D=D, copies=copies, hd_s=hd_s, hd=hd, nq_s=nq_s, nkv_s=nkv_s, nq=nq, nkv=nkv,
                q_dim=q_dim, k_src=k_src, q_head=q_head, g_s=g_s, layer_pos=[l * (L // L_s) for l in range(L_s)])


def check_fit(small_tcfg, small_dcfg, shape):
    """Raise ShapeError naming the first constraint ``shape`` breaks for this small pair (target and
    drafter): hidden / head dim multiples, heads, layers, MLP (or expert) width, vocabulary."""
    plan(small_tcfg, shape)
    moe = shape["kind"] == "moe"
    inter = shape["moe_intermediate"] if moe else shape["intermediate"]
    if inter < small_tcfg["intermediate_size"]:
        raise ShapeError(f"intermediate {inter} < {small_tcfg['intermediate_size']}"
                         + (" (every expert holds the whole small MLP)" if moe else ""))
    if shape["vocab"] < small_tcfg["vocab_size"]:
        raise ShapeError(f"vocab {shape['vocab']} < {small_tcfg['vocab_size']}")
    if small_dcfg is not None:
        plan(small_dcfg, dict(shape, layers=shape["drafter_layers"]))
        if shape["drafter_intermediate"] < small_dcfg["intermediate_size"]:
            raise ShapeError(f"drafter intermediate {shape['drafter_intermediate']} < {small_dcfg['intermediate_size']}")


# --- the pieces -------------------------------------------------------------------------------------
def _reader(w, D):
    """[out, d] -> [out, D]: reads copy 0 of the duplicated stream."""
    out = torch.zeros(w.shape[0], D, dtype=w.dtype)
    out[:, : w.shape[1]] = w
    return out


def _writer_rows(w, copies):
    """[d, in] -> [d * copies, in]: writes every copy."""
    return w.repeat(copies, 1)


def _attention(p, P, m):
    """Small attention tensors P (prefix p) -> big ones.  Returns a dict of the big tensors."""
    hd_s, hd, D = m["hd_s"], m["hd"], m["D"]
    Wq, Wk, Wv, Wo = (P[p + f"self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    dt = Wq.dtype
    q = torch.zeros(m["nq"] * hd, D, dtype=dt)
    k = torch.zeros(m["nkv"] * hd, D, dtype=dt)
    v = torch.zeros(m["nkv"] * hd, D, dtype=dt)
    o = torch.zeros(m["d"], m["nq"] * hd, dtype=dt)
    qd, ks = torch.tensor(m["q_dim"]), torch.tensor(m["k_src"])
    for j, J in enumerate(m["q_head"]):
        q[J * hd + qd, : m["d"]] = Wq[j * hd_s:(j + 1) * hd_s]
        o[:, J * hd:J * hd + hd_s] = Wo[:, j * hd_s:(j + 1) * hd_s]
    for kv in range(m["nkv_s"]):
        k[kv * hd:(kv + 1) * hd, : m["d"]] = Wk[kv * hd_s + ks]
        v[kv * hd:kv * hd + hd_s, : m["d"]] = Wv[kv * hd_s:(kv + 1) * hd_s]
    qn, kn = P[p + "self_attn.q_norm.weight"], P[p + "self_attn.k_norm.weight"]
    return {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": _writer_rows(o, m["copies"]),
            # q is zero outside q_dim, so its norm weight there is never used: repeat like k's
            "self_attn.q_norm.weight": qn[ks].clone(), "self_attn.k_norm.weight": kn[ks].clone()}


def _mlp(gate, up, down, inter, m):
    """Small SwiGLU (gate/up [I_s, d], down [d, I_s]) -> intermediate ``inter``, hidden D."""
    I_s = gate.shape[0]
    if inter < I_s:
        raise ShapeError(f"intermediate {inter} < {I_s}")
    G = torch.zeros(inter, m["D"], dtype=gate.dtype)
    U = torch.zeros_like(G)
    Dn = torch.zeros(m["d"], inter, dtype=down.dtype)
    G[:I_s, : m["d"]], U[:I_s, : m["d"]], Dn[:, :I_s] = gate, up, down
    return G, U, _writer_rows(Dn, m["copies"])


def _layer(P, p, m, shape, mlp_inter, moe, gen, identity):
    """One big decoder layer (dict of tensor suffix -> tensor) from small layer prefix p of P."""
    out = _attention(p, P, m)
    for n in ("input_layernorm", "post_attention_layernorm"):
        out[f"{n}.weight"] = P[p + f"{n}.weight"].repeat(m["copies"])
    G, U, Dn = _mlp(P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"],
                    P[p + "mlp.down_proj.weight"], mlp_inter, m)
    if identity:
        out["self_attn.o_proj.weight"].zero_()
        Dn = torch.zeros_like(Dn)
    if moe:
        out["mlp.gate.weight"] = (torch.randn(shape["experts"], m["D"], generator=gen) * 0.02).to(G.dtype)
        for e in range(shape["experts"]):
            # own storage per expert: safetensors refuses tensors that share memory
            out[f"mlp.experts.{e}.gate_proj.weight"] = G.clone()
            out[f"mlp.experts.{e}.up_proj.weight"] = U.clone()
            out[f"mlp.experts.{e}.down_proj.weight"] = Dn.clone()
    else:
        out.update({"mlp.gate_proj.weight": G, "mlp.up_proj.weight": U, "mlp.down_proj.weight": Dn})
    return out


# --- the models ---------------------------------------------------------------------------------------
def scaled_target_config(small_cfg, shape):
    cfg = copy.deepcopy(small_cfg)
    cfg.update(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
               num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
               head_dim=shape["head_dim"], vocab_size=shape["vocab"])
    if shape.get("max_position_embeddings"):   # Qwen3's own (long-context arms); RoPE needs no weights
        cfg["max_position_embeddings"] = shape["max_position_embeddings"]
    if shape["kind"] == "moe":
        cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                   num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                   moe_intermediate_size=shape["moe_intermediate"], norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                   router_aux_loss_coef=0.0, intermediate_size=shape["drafter_intermediate"])
    else:
        cfg["intermediate_size"] = shape["intermediate"]
    return cfg


def scale_target(sd, small_cfg, shape, seed=0, layers=None):
    """Small target state dict (untied lm_head, vocab already = shape['vocab']) -> (big sd, config).
    ``layers``: which big layers to build (ints, and "head" for embedding / final norm / lm_head);
    default all, so a writer can stream the checkpoint shard by shard."""
    m = plan(small_cfg, shape)
    if sd["lm_head.weight"].shape[0] != shape["vocab"]:
        raise ShapeError(f"vocab {sd['lm_head.weight'].shape[0]} != {shape['vocab']}: extend_vocab first")
    moe = shape["kind"] == "moe"
    inter = shape["moe_intermediate"] if moe else shape["intermediate"]
    src = _layer_sources(small_cfg["num_hidden_layers"], shape["layers"], m)
    out = {}
    want = list(range(shape["layers"])) + ["head"] if layers is None else list(layers)
    for i in want:
        if i == "head":
            out["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].repeat(1, m["copies"])
            out["model.norm.weight"] = sd["model.norm.weight"].repeat(m["copies"])
            out["lm_head.weight"] = _reader(sd["lm_head.weight"], m["D"])
            continue
        gen = torch.Generator().manual_seed(seed * 100003 + i)
        l, ident = src[i]
        for k, v in _layer(sd, f"model.layers.{l}.", m, shape, inter, moe, gen, ident).items():
            out[f"model.layers.{i}.{k}"] = v
    return out, scaled_target_config(small_cfg, shape)


def _layer_sources(L_s, L, m):
    """Big layer index -> (small layer it copies, identity?)."""
    pos = m["layer_pos"]
    src, cur = [], 0
    for i in range(L):
        if cur + 1 < L_s and i == pos[cur + 1]:
            cur += 1
        src.append((cur, i != pos[cur]))
    return src


def scale_drafter(P, small_dcfg, small_tcfg, shape):
    """Small DFlash drafter (no embeddings / lm_head: it borrows the target's) -> (big P, config)."""
    dshape = dict(shape, layers=shape["drafter_layers"], kind="dense",
                  intermediate=shape["drafter_intermediate"])
    m = plan(small_dcfg, dshape)
    mt = plan(small_tcfg, shape)
    ids = small_dcfg["dflash_config"]["target_layer_ids"]
    d, D = m["d"], m["D"]
    fc = P["fc.weight"]                                  # [d, len(ids) * d]
    big_fc = torch.zeros(d, len(ids) * D, dtype=fc.dtype)
    for t in range(len(ids)):
        big_fc[:, t * D:t * D + d] = fc[:, t * d:(t + 1) * d]
    out = {"fc.weight": _writer_rows(big_fc, m["copies"]),
           "hidden_norm.weight": P["hidden_norm.weight"].repeat(m["copies"]),
           "norm.weight": P["norm.weight"].repeat(m["copies"])}
    src = _layer_sources(small_dcfg["num_hidden_layers"], dshape["layers"], m)
    for i, (l, ident) in enumerate(src):
        for k, v in _layer(P, f"layers.{l}.", m, dshape, dshape["intermediate"], False, None, ident).items():
            out[f"layers.{i}.{k}"] = v
    known = set(k for k in P)
    used = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        k for k in known if k.startswith("layers.")}
    if known - used:
        raise ShapeError(f"drafter tensors the transform does not know: {sorted(known - used)}")
    cfg = copy.deepcopy(small_dcfg)
    new_ids = [mt["layer_pos"][t] for t in ids]
    cfg.update(hidden_size=D, num_hidden_layers=dshape["layers"], num_attention_heads=shape["heads"],
               num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
               intermediate_size=dshape["intermediate"], vocab_size=shape["vocab"],
               num_target_layers=shape["layers"])
    if shape.get("max_position_embeddings"):
        cfg["max_position_embeddings"] = shape["max_position_embeddings"]
    cfg["dflash_config"] = dict(cfg["dflash_config"], target_layer_ids=new_ids,
                                num_target_layers=shape["layers"])
    return out, cfg


# --- the vocabulary ---------------------------------------------------------------------------------------
def junk_rows(n, d, direction, seed, std=0.02, dtype=torch.float32):
    """lm_head rows of the ids the tokenizer never emits: ``direction + std * N(0, 1)`` (seeded on
    the CPU, so every machine builds the same rows).  ``direction`` [d] is learned (vocab.py)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.as_tensor(direction, dtype=torch.float32)[None, :]
            + std * torch.randn(n, d, generator=gen)).to(dtype)


def extend_vocab(sd, vocab, direction, seed):
    """Target state dict with vocab V_s -> one with ``vocab`` ids (a new dict; real rows untouched).
    New embedding rows: N(0, 0.02) (never looked up: no prompt or output holds such an id)."""
    E, W = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    V_s, d = W.shape
    if vocab < V_s:
        raise ShapeError(f"vocab {vocab} < {V_s}")
    out = dict(sd)
    gen = torch.Generator().manual_seed(seed + 1)
    out["model.embed_tokens.weight"] = torch.cat(
        [E, (0.02 * torch.randn(vocab - V_s, d, generator=gen)).to(E.dtype)])
    out["lm_head.weight"] = torch.cat([W, junk_rows(vocab - V_s, d, direction, seed, dtype=W.dtype)])
    return out


JUNK_HEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "junk_head.json")


def extended_text_target(weights_dir=None, vocab=None, float32=False):
    """The shipped text pair with its target's vocabulary extended by the learned rows of
    ``junk_head.json``: (target state dict, its config, drafter state dict).  ``float32``: convert
    the pair before the extension (the fp32 reference); else the files' bf16."""
    from sglang_ddtree import textpair as TP  # the installed package (never the checkout root)
    with open(JUNK_HEAD) as f:
        junk = json.load(f)
    vocab = vocab or junk["vocab"]
    T, P = TP.load_pair(weights_dir) if weights_dir else TP.load_pair()
    if float32:
        T = {k: v.float() for k, v in T.items()}
    return extend_vocab(T, vocab, junk["direction"], junk["seed"]), dict(TP.TARGET, vocab_size=vocab), P


def load_folder(model_path, device="cpu", dtype=torch.float32):
    """A Hugging Face folder (safetensors shards) -> (state dict on ``device`` in ``dtype``, or the
    files' dtype when None; config dict), one tensor at a time."""
    import glob
    from safetensors import safe_open
    sd = {}
    for f in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(f, framework="pt", device="cpu") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                sd[k] = t.to(device=device, dtype=dtype or t.dtype)
    if not sd:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    with open(os.path.join(model_path, "config.json")) as f:
        return sd, json.load(f)


def extended_folder_target(target_dir, junk_path, vocab=None, float32=False):
    """A small target given as a Hugging Face folder (the code pair's ``code_target``) with its
    vocabulary extended by ``junk_path``'s learned rows (``vocab.py --pair code``, fit to this
    target): (state dict, its config).  ``float32``: the fp32 reference; else the files' bf16."""
    with open(junk_path) as f:
        junk = json.load(f)
    sd, cfg = load_folder(target_dir, "cpu", torch.float32 if float32 else None)
    V_s = sd["lm_head.weight"].shape[0]
    if junk.get("real_vocab", V_s) != V_s or len(junk["direction"]) != sd["lm_head.weight"].shape[1]:
        raise ShapeError(f"{junk_path} was learned for vocab {junk.get('real_vocab')} x {len(junk['direction'])}, "
                         f"{target_dir} is {V_s} x {sd['lm_head.weight'].shape[1]}")
    vocab = vocab or junk["vocab"]
    return extend_vocab(sd, vocab, junk["direction"], junk["seed"]), dict(cfg, vocab_size=vocab)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def small_pair_source(pair="text", weights_dir=None, drafter_run=None, target_dir=None, drafter_dir=None,
                      junk=None, vocab=None):
    """The small pair a ``write`` scales: (target sd with the vocabulary extended, its config, drafter
    sd, drafter config, tokenizer files to copy, generation config, folder-name tag).
    ``pair="text"``: the shipped text pair (``weights_dir``, ``drafter_run``), junk_head.json, the text
    tokenizer; ``pair="code"``: the HF folders ``target_dir`` / ``drafter_dir``, the rows of ``junk``,
    the tokenizer files and generation config found in ``target_dir``."""
    if pair == "text":
        from sglang_ddtree import textpair as TP  # the installed package (never the checkout root)
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        T, tcfg, P = extended_text_target(weights_dir, vocab)
        dcfg = dict(TP.DRAFTER)
        if drafter_run:  # a drafter trained against the shipped target (bench/textpair/train.py output)
            P, dcfg = TP.load_drafter_run(drafter_run)
        tok_dir = os.path.join(repo, "bench", "textpair", "tokenizer")
        toks = [os.path.join(tok_dir, n) for n in TOKENIZER_FILES]
        gen_cfg = {"bos_token_id": TP.BOS, "eos_token_id": TP.EOS, "pad_token_id": TP.PAD, "do_sample": False}
        return T, tcfg, P, dcfg, toks, gen_cfg, ""
    if pair != "code":
        raise ValueError(f"pair {pair!r}: text or code")
    if not (target_dir and drafter_dir and junk):
        raise ValueError("pair code needs target_dir, drafter_dir and junk")
    T, tcfg = extended_folder_target(target_dir, junk, vocab)
    P, dcfg = load_folder(drafter_dir, "cpu", None)
    toks = [os.path.join(target_dir, n) for n in TOKENIZER_FILES if os.path.exists(os.path.join(target_dir, n))]
    if not any(t.endswith("tokenizer.json") for t in toks):
        raise FileNotFoundError(f"{target_dir} has no tokenizer.json (the code pair's own tokenizer)")
    gp = os.path.join(target_dir, "generation_config.json")
    gen_cfg = json.load(open(gp)) if os.path.exists(gp) else None
    return T, tcfg, P, dcfg, toks, gen_cfg, "code"


# --- writing a checkpoint -------------------------------------------------------------------------------
class _FolderWriter:
    """A Hugging Face model folder written shard by shard (never the whole model in memory)."""

    def __init__(self, path, n_shards):
        self.path, self.n, self.i, self.weight_map = path, n_shards, 0, {}
        os.makedirs(path, exist_ok=True)

    def shard(self, tensors):
        from safetensors.torch import save_file
        self.i += 1
        name = f"model-{self.i:05d}-of-{self.n:05d}.safetensors"
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
                  os.path.join(self.path, name), metadata={"format": "pt"})
        self.weight_map.update({k: name for k in tensors})
        return sum(v.numel() for v in tensors.values())

    def close(self, cfg, extra_files=(), generation_config=None):
        import shutil
        if self.i != self.n:
            raise RuntimeError(f"wrote {self.i} of {self.n} shards")
        with open(os.path.join(self.path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": self.weight_map}, f)
        if generation_config:
            with open(os.path.join(self.path, "generation_config.json"), "w") as f:
                json.dump(generation_config, f)
        for src in extra_files:
            shutil.copy(src, os.path.join(self.path, os.path.basename(src)))


def write(out_dir, shape_name, weights_dir=None, layers=None, seed=0, drafter_run=None, pair="text",
          target_dir=None, drafter_dir=None, junk=None):
    """Write OUT/<shape>_target and OUT/<shape>_drafter (HF folders SGLang 0.5.16 loads) from the
    shipped text pair, vocabulary extended with bench/scale/junk_head.json; ``pair="code"``:
    OUT/<shape>code_target and OUT/<shape>code_drafter from the folders ``target_dir`` /
    ``drafter_dir`` with ``junk``'s rows (:func:`small_pair_source`).  Returns the paths and the
    sizes written."""
    shape = dict(SHAPES[shape_name])
    if layers:
        shape["layers"] = layers
    T, tcfg_small, P, dcfg_small, toks, gen_cfg, tag = small_pair_source(
        pair, weights_dir, drafter_run, target_dir, drafter_dir, junk, shape["vocab"])
    check_fit(dict(tcfg_small, vocab_size=T["lm_head.weight"].shape[0]), dcfg_small, shape)  # before any file
    tgt, dr = (os.path.join(out_dir, f"{shape_name}{tag}_{w}") for w in ("target", "drafter"))
    per = 1 if shape["kind"] == "moe" else 3
    groups = [list(range(a, min(a + per, shape["layers"]))) for a in range(0, shape["layers"], per)] + [["head"]]
    wt, n_params, cfg = _FolderWriter(tgt, len(groups)), 0, None
    for g in groups:
        part, cfg = scale_target(T, tcfg_small, shape, seed=seed, layers=g)
        n_params += wt.shard(part)
        del part
    wt.close(cfg, toks, gen_cfg)
    dsd, dcfg = scale_drafter(P, dcfg_small, tcfg_small, shape)
    wd = _FolderWriter(dr, 1)
    n_draft = wd.shard(dsd)
    wd.close(dcfg, toks, gen_cfg)
    return {"target": tgt, "drafter": dr, "shape": shape_name, "pair": pair, "layers": shape["layers"],
            "target_params": n_params, "drafter_params": n_draft,
            "target_layer_ids": dcfg["dflash_config"]["target_layer_ids"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--shape", choices=sorted(SHAPES), required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--weights", default=None)
    w.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (disk / memory)")
    w.add_argument("--drafter-run", default=None, help="a bench/textpair/train.py output: scale its drafter")
    w.add_argument("--pair", choices=("text", "code"), default="text")
    w.add_argument("--target-dir", default=None, help="--pair code: the small target's HF folder")
    w.add_argument("--drafter-dir", default=None, help="--pair code: the small drafter's HF folder")
    w.add_argument("--junk", default=None, help="--pair code: its junk rows (vocab.py --pair code --out)")
    a = ap.parse_args()
    print(json.dumps(write(a.out, a.shape, a.weights, a.layers, drafter_run=a.drafter_run, pair=a.pair,
                           target_dir=a.target_dir, drafter_dir=a.drafter_dir, junk=a.junk)))


if __name__ == "__main__":
    main()
