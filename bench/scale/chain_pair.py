"""The test bed's permutation-chain GQA pair at a production Qwen3 shape, with a block-16 drafter.

    python bench/scale/chain_pair.py write --shape qwen3-8b --out DIR [--layers L] [--drafter F]
    python bench/scale/chain_pair.py check-outputs AB.json PERM.json [--arm base|all] [--record]

Why: the text pair (``transform.py``) gives production cost but its drafter accepts 1.2 tokens a
round, so every speculative arm loses to plain decoding there.  This pair has the same production
cost and the acceptance of the test bed's chain pairs (DFLASH 3.3 with the block-8 toy drafter on
chain prompts, ``bench/results/ab_h200_mla_commit.md``), as ``bench/device/mk_kimi_cost.py`` does for
MLA + INT4 MoE at Kimi K2's widths.  Dense (Qwen3-8B) and MoE (Qwen3-30B-A3B: every expert the toy
MLP, a random router, top-8 of 128 normalised) shapes, vocabulary 151,936.

Construction (``OUT/<shape>chain_target``, ``OUT/<shape>chain_drafter``):
* the layers: ``transform.scale_target`` / ``scale_drafter`` on the toy GQA target of
  ``bench/device/mk_models.py`` (4 layers, hidden 256, 4 q / 2 kv heads x 64, vocab 1024) and a toy
  drafter trained by ``bench/device/train_drafter.py`` (default: the committed block-16 one,
  ``bench/device/weights/drafter_b16.safetensors.xz``, ``--block-size 16``): the same function up to
  bf16 rounding (tests/test_scale_transform.py), identity layers to the shape's depth;
* the vocabulary (as mk_kimi_cost.py's ``head``): ids 0..1023 are the chain tokens; an id >= 1024
  embeds as id % 1024; its lm_head row is :func:`junk_row` (learned for this drafter) on copy 1 of
  the duplicated stream, and the target's final norm is zero outside copy 0, so the
  target's logit for it is exactly 0 (the greedy token's is ~+240) while the drafter, whose own final
  norm keeps every copy, sees junk_row . h < 0: the 150,912 extra ids cost the lm_head, the
  logsumexp and the top-K what a real vocabulary costs, and stay out of the trees.
The greedy next token is perm[last token % 1024] with a margin of ~200 logits: every correct decoding
path emits exactly the chain, which ``check-outputs`` verifies on an A/B's saved outputs.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import shutil
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE_DIR = os.path.join(os.path.dirname(HERE), "device")
DEFAULT_BLOCK = 16


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


T = _load("_transform_for_chain", os.path.join(HERE, "transform.py"))
K = _load("_mk_kimi_cost_for_chain", os.path.join(DEVICE_DIR, "mk_kimi_cost.py"))
M = K.M  # mk_kimi_cost's private mk_models (junk_row reads its constants)
# committed as weights/drafter_b16.safetensors.xz: a plain copy (same base name) from mk_models
DEFAULT_DRAFTER = M.committed_weights("drafter_b16")
RAWIO = _load("_rawio_for_chain", os.path.join(os.path.dirname(HERE), "rawio.py"))


def small_pair(drafter_path=DEFAULT_DRAFTER, block_size=DEFAULT_BLOCK):
    """(toy target state dict fp32, its config, drafter state dict fp32, drafter config, perm)."""
    from safetensors.torch import load_file
    tsd, perm = M.qwen3_target_state()
    P = {k: v.float() for k, v in load_file(drafter_path).items()}
    return tsd, M.QWEN3, P, M.drafter_config(block_size), perm


JUNK_MARGIN = 12.0   # learned junk row: log(#junk ids) + junk logit <= log-sum-exp of the real ids - this
JUNK_SEEDS = (K.SEED + 7, K.SEED + 8)  # train / held-out chain contexts


@functools.lru_cache(maxsize=None)
def junk_row(drafter_path=DEFAULT_DRAFTER, block_size=DEFAULT_BLOCK, vocab=T.SHAPES["qwen3-8b"]["vocab"],
             steps=300):
    """The lm_head row [256] of the ids >= 1024, learned for this drafter.  mk_kimi_cost's row (-40 x
    the mean direction of the drafter's normed hidden state) lets the block-16 drafter's junk ids,
    which all share one logit, beat its 16th real logit at ~2.4 % of positions and hold up to ~99 %
    of its probability there at 151,936 ids.  Here the row w minimises, over the drafter's normed
    hidden states h on chain contexts, mean softplus(log(V - 1024) + w . h - LSE(real logits) +
    JUNK_MARGIN) + 1e-4 |w|^2 (Adam, from mk_kimi_cost's row): the junk ids' total share pushed
    below e^-JUNK_MARGIN wherever a direction allows.  -> (row [256], held-out stats)."""
    tsd, _ = M.qwen3_target_state()
    W = tsd["lm_head.weight"]
    log_nj = math.log(vocab - W.shape[0])

    def data(seed):
        h = K.drafter_normed_hidden(seed=seed, drafter_path=drafter_path, block_size=block_size)
        return h, (h @ W.T).logsumexp(-1)

    (h, lse), (hv, lsev) = data(JUNK_SEEDS[0]), data(JUNK_SEEDS[1])
    mu = h.mean(0)
    w = (-K.JUNK_SCALE * mu / mu.norm()).clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=0.5)
    for _ in range(steps):
        loss = F.softplus(log_nj + h @ w - lse + JUNK_MARGIN).mean() + 1e-4 * w.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = w.detach()
    with torch.no_grad():
        real_v = hv @ W.T
        gap = log_nj + hv @ w - lsev
        stats = {"vocab": vocab, "positions": int(hv.shape[0]),
                 "junk_share_mean": float(torch.sigmoid(gap).mean()),
                 "junk_share_p99": float(torch.sigmoid(gap).quantile(0.99)),
                 "junk_above_16th_real": float((hv @ w > real_v.topk(16, -1).values[:, -1]).float().mean()),
                 "norm": float(w.norm())}
    return w, stats


def chain_head(tsd, m, vocab, junk, dtype=torch.bfloat16):
    """Embedding / final norm / lm_head of the big target (see the module docstring)."""
    E, W = tsd["model.embed_tokens.weight"], tsd["lm_head.weight"]
    V_s, d = W.shape
    if m["copies"] < 2:
        raise T.ShapeError("the chain head needs >= 2 copies of the stream (copy 1 holds the junk rows)")
    ids = torch.arange(vocab) % V_s
    lm = torch.zeros(vocab, m["D"], dtype=dtype)
    lm[:V_s, :d] = W.to(dtype)
    lm[V_s:, d:2 * d] = junk.to(dtype)
    norm = torch.zeros(m["D"], dtype=dtype)
    norm[:d] = tsd["model.norm.weight"].to(dtype)
    return {"model.embed_tokens.weight": E[ids].to(dtype).repeat(1, m["copies"]),
            "model.norm.weight": norm, "lm_head.weight": lm}


def target_parts(tsd, tcfg, shape, junk, parts, seed=0, head_dtype=torch.bfloat16):
    """Big target tensors for ``parts`` (layer indices and/or "head"; the head in ``head_dtype``: bf16
    when writing, as the shards are; the layers in the toy's dtype)."""
    small = dict(shape, vocab=tsd["lm_head.weight"].shape[0])  # the layers never read the vocab
    layers = [p for p in parts if p != "head"]
    out = {}
    if layers:
        out, _ = T.scale_target(tsd, tcfg, small, seed=seed, layers=layers)
    if "head" in parts:
        out.update(chain_head(tsd, T.plan(tcfg, shape), shape["vocab"], junk, dtype=head_dtype))
    return out


def build_state(shape, drafter_path=DEFAULT_DRAFTER, block_size=DEFAULT_BLOCK, seed=0):
    """The whole pair in memory, fp32 (small shapes: tests) -> (target sd, target cfg, drafter sd,
    drafter cfg, perm)."""
    tsd, tcfg, P, dcfg, perm = small_pair(drafter_path, block_size)
    junk, _ = junk_row(drafter_path, block_size, shape["vocab"])
    big = target_parts(tsd, tcfg, shape, junk, list(range(shape["layers"])) + ["head"], seed=seed,
                       head_dtype=torch.float32)
    dsd, dcfg_big = T.scale_drafter(P, dcfg, tcfg, shape)
    return big, T.scaled_target_config(tcfg, shape), dsd, dcfg_big, perm


def write(out_dir, shape_name, layers=None, drafter_path=DEFAULT_DRAFTER, block_size=DEFAULT_BLOCK, seed=0,
          force=False, log=print):
    """Write OUT/<shape>chain_target and OUT/<shape>chain_drafter (HF folders SGLang 0.5.16 loads);
    reuse them when chain.json says the same build is there."""
    shape = dict(T.SHAPES[shape_name])
    if layers:
        shape["layers"] = int(layers)
    tgt, dr = (os.path.join(out_dir, f"{shape_name}chain_{w}") for w in ("target", "drafter"))
    build = {"shape": shape, "drafter": os.path.basename(drafter_path), "block_size": block_size, "seed": seed}
    marker = os.path.join(tgt, "chain.json")
    old = None if force else K.built_before(marker, build)
    if old is not None:
        return dict(old, reused=True, target=tgt, drafter=dr)
    for d in (tgt, dr):
        if os.path.exists(d):
            shutil.rmtree(d)
    t0 = time.time()
    tsd, tcfg, P, dcfg, perm = small_pair(drafter_path, block_size)
    junk, junk_stats = junk_row(drafter_path, block_size, shape["vocab"])
    per = 1 if shape["kind"] == "moe" else 3
    groups = [list(range(a, min(a + per, shape["layers"]))) for a in range(0, shape["layers"], per)] + [["head"]]
    wt = T._FolderWriter(tgt, len(groups))
    n_params = 0
    for g in groups:
        n_params += wt.shard(target_parts(tsd, tcfg, shape, junk, g, seed=seed))
        log(f"chain {shape_name}: shard {wt.i}/{len(groups)} at {time.time() - t0:.0f}s", flush=True)
    wt.close(T.scaled_target_config(tcfg, shape), generation_config={"bos_token_id": M.BOS, "eos_token_id": M.EOS,
                                                             "do_sample": False})
    M.write_tokenizer(tgt)
    with open(os.path.join(tgt, "perm.json"), "w") as f:
        json.dump(perm.tolist(), f)
    dsd, dcfg_big = T.scale_drafter(P, dcfg, tcfg, shape)
    wd = T._FolderWriter(dr, 1)
    n_draft = wd.shard(dsd)
    wd.close(dcfg_big)
    M.write_tokenizer(dr)
    build.update(target_params=n_params, drafter_params=n_draft, write_s=round(time.time() - t0, 1), junk=junk_stats,
                 target_layer_ids=dcfg_big["dflash_config"]["target_layer_ids"])
    with open(marker, "w") as f:
        json.dump(build, f, indent=1)
    return dict(build, reused=False, target=tgt, drafter=dr)


def chain_of(perm, last, n):
    out, t = [], int(last)
    for _ in range(n):
        t = int(perm[t % len(perm)])
        out.append(t)
    return out


def _loaded(obj):
    """A JSON file's content: ``obj`` itself when already loaded, else the file at that path (plain or
    gzipped: the committed raw records are ``.json.gz``)."""
    if isinstance(obj, (dict, list)):
        return obj
    with RAWIO.open_maybe_gz(obj) as f:
        return json.load(f)


def prompt_ids_of(doc):
    """The token-id prompts of an A/B run: its ``prompt_ids``, or, in a committed long-prompt run whose
    ids were dropped (``prompt_ids_regen``: the generator's arguments), the prompts rebuilt by
    ``bench/device/mk_chain_prompts.py`` and checked against the run's sha256.  None when neither."""
    if doc.get("prompt_ids"):
        return doc["prompt_ids"]
    regen = doc.get("prompt_ids_regen")
    if not regen:
        return None
    from sglang_ddtree.ab.prompts import prompt_digest
    gen = _load("_mk_chain_prompts_for_chain", os.path.join(DEVICE_DIR, "mk_chain_prompts.py"))
    lo, hi = (int(x) for x in regen["len"].split("-"))
    ids = gen.chain_prompts(regen["n"], regen["seed"], lo, hi)[: doc["settings"]["num_prompts"]]
    got = prompt_digest([{"input_ids": x} for x in ids])
    if got != doc["prompts"]["sha256_16"]:
        raise SystemExit(f"prompts rebuilt from {regen} have sha256 {got}, the run's {doc['prompts']['sha256_16']}")
    return ids


def check_outputs(ab_json, perm_json, arm="base", name=None):
    """Every saved output of ``arm`` in an A/B run (``--save-output-ids``, token-id prompts) is the
    chain of its prompt's last token.  ``ab_json`` / ``perm_json``: paths, or their loaded content
    (``name``: the A/B file's name for errors).  -> {"checked", "wrong": [(c, prompt index, first bad position)]}."""
    doc, perm = _loaded(ab_json), _loaded(perm_json)
    prompts = prompt_ids_of(doc)
    outs = (doc.get("output_ids") or {}).get(arm)
    if not prompts or outs is None:
        name = name or (ab_json if isinstance(ab_json, str) else "the A/B JSON")
        raise SystemExit(f"{name}: no prompt_ids / output_ids of arm {arm!r} (run the A/B with "
                         "--save-output-ids and token-id prompts)")
    checked, wrong = 0, []
    for c, lst in outs.items():
        for i, ids in enumerate(lst):
            if ids is None:
                continue
            want = chain_of(perm, prompts[i][-1], len(ids))
            checked += 1
            if ids != want:
                wrong.append((c, i, next(k for k, (a, b) in enumerate(zip(ids, want)) if a != b)))
    return {"arm": arm, "checked": checked, "wrong": wrong}


CHAIN = "chain"


def identity_record(doc, perm, arms):
    """Write each arm's identity against the chain into an A/B document (``--save-output-ids``, token-id
    prompts), in the A/B's own format (``sglang_ddtree.ab.stats.identity_check`` with the chain of each
    saved output's length as the reference; a failed request counts as an error): under
    ``identity["chain"]`` always, and as the run's identity (reference ``chain``) when the run measured
    no reference arm (runs of the adaptive server only), whose identity would otherwise say nothing.
    Returns ``doc``."""
    from sglang_ddtree.ab.stats import identity_check
    prompts, saved = prompt_ids_of(doc) or [], doc.get("output_ids") or {}
    checked = {}
    for arm in arms:
        outs = saved[arm]
        chain = {c: [None if x is None else chain_of(perm, prompts[i][-1], len(x)) for i, x in enumerate(lst)]
                 for c, lst in outs.items()}
        checked.update(identity_check({arm: outs, CHAIN: chain}, CHAIN)["arms"])
    idn = doc.setdefault("identity", {})
    idn[CHAIN] = {"note": "every saved output compared with the chain of its prompt's last token "
                          "(bench/scale/chain_pair.py check-outputs)", "arms": checked}
    if not idn.get("arms"):
        idn.update(reference=CHAIN, arms=checked,
                   note="no reference arm in this run: outputs checked against the permutation chain, "
                        "the target's greedy output by construction (bench/scale/chain_pair.py)")
    return doc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--shape", choices=sorted(T.SHAPES), required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (disk / memory)")
    w.add_argument("--drafter", default=DEFAULT_DRAFTER, help="a toy drafter from train_drafter.py")
    w.add_argument("--block-size", type=int, default=DEFAULT_BLOCK, help="that drafter's block size")
    w.add_argument("--force", action="store_true")
    c = sub.add_parser("check-outputs")
    c.add_argument("ab_json")
    c.add_argument("perm_json")
    c.add_argument("--arm", default="base", help="an arm, or 'all': every arm with saved outputs")
    c.add_argument("--record", action="store_true", help="write the verdicts into AB.json's identity "
                   "(identity_record) and re-render its .md next to it")
    a = ap.parse_args()
    if a.cmd == "write":
        print(json.dumps(write(a.out, a.shape, a.layers, a.drafter, a.block_size, force=a.force)))
        return 0
    doc, perm = _loaded(a.ab_json), _loaded(a.perm_json)     # read once, checked per arm
    arms = [a.arm]
    if a.arm == "all":   # every arm whose outputs the A/B saved (runs without a base arm too)
        arms = sorted(doc.get("output_ids") or {})
        if not arms:
            raise SystemExit(f"{a.ab_json}: no output_ids (run the A/B with --save-output-ids)")
    bad = 0
    for arm in arms:
        r = check_outputs(doc, perm, arm, name=a.ab_json)
        print(json.dumps(dict(r, wrong=r["wrong"][:10], n_wrong=len(r["wrong"]))))
        bad += bool(r["wrong"] or not r["checked"])
    if a.record:
        from sglang_ddtree.ab.report import write_outputs
        stem = a.ab_json[:-3] if a.ab_json.endswith(".gz") else a.ab_json
        write_outputs(identity_record(doc, perm, arms), os.path.splitext(stem)[0], plot=False)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
