"""CPU check of a trimmed SGLang kit (bench/device/kit_trim.sh): what the H200 host imports still imports.

    python bench/device/check_kit.py SITE [--pytest tests/test_configs.py ...]

SITE is an unpacked kit (``tar -xJf .kit/site.tar.xz -C /tmp`` gives /tmp/site).  The kit is built
for the host's Python 3.12, so its compiled modules do not load here; its pure-Python packages do.
This runs, in a child process of the running Python (the project's venv: SGLang 0.5.16 with the
kit's transformers and flashinfer versions):
  * the kit's ``sglang``, ``transformers`` and ``flashinfer`` on sys.path ahead of the venv's (their
    versions must equal the venv's), so a module the trim removed from them is missing here too;
  * the top-level packages the trim removed whole (zstandard, torchao) blocked: importing them
    raises ImportError, as on the host, which has none;
  * the imports of the server (``sglang.launch_server`` -> http_server, the engine, scheduler,
    tp_worker, model_runner, detokenizer, tokenizer_manager), the triton / flashinfer / flashinfer-MLA
    attention backends, the DFLASH worker, ``sglang.bench_serving``; the model registry, which must
    resolve every architecture the test bed serves (Qwen3 dense and MoE, DeepSeek-V3, DFlash, Llama);
  * ModelConfig and SGLang's tokenizer loader on each of the test bed's model folders
    (mk_models.py --configs-only, the text pair's config and tokenizer, a Qwen3-MoE config);
  * with ``--pytest``: the given test files, in the same environment;
  * and, in this process: every distribution of the kit still names its import names (what
    importlib.metadata.packages_distributions() reads; transformers maps versions with it).
Prints one line per check and exits non-zero on the first failure.  What it cannot see: compiled
code (tokenizers, pydantic_core, sgl_kernel...), which is only loaded on the host, and modules
imported only on code paths the CPU never runs (the GPU run of the kit is the final check).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OVERLAID = ("sglang", "transformers", "flashinfer")      # pure-Python packages of the kit
WHOLE = ("zstandard", "torchao")                         # packages kit_trim.sh may remove whole

SERVER_MODULES = [
    "sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.layers.attention.flashinfer_mla_backend",
    "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.model_loader.loader", "sglang.bench_serving",
    "sglang.srt.models.qwen3", "sglang.srt.models.qwen3_moe", "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.dflash", "sglang.srt.models.llama", "sglang.srt.models.registry",
]
ARCHS = ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "DFlashDraftModel",
         "LlamaForCausalLM"]

SITECUSTOMIZE = r'''
import os, sys
# a name mapped to None in sys.modules is what "not installed" looks like to both `import` (raises
# ModuleNotFoundError) and importlib.util.find_spec (returns None: optional imports skip it)
for _name in filter(None, os.environ.get("CHECK_KIT_BLOCK", "").split(",")):
    sys.modules[_name] = None
'''


def _version(site, dist):
    for d in os.listdir(site):
        if d.lower().startswith(dist.lower() + "-") and d.endswith(".dist-info"):
            return d[len(dist) + 1:-len(".dist-info")]
    return None


def prepare(site, work):
    """The overlay folder (symlinks to the kit's pure-Python packages + the import blocker) and the
    blocked names."""
    from importlib import metadata
    overlay = os.path.join(work, "overlay")
    os.makedirs(overlay)
    for pkg, dist in (("sglang", "sglang"), ("transformers", "transformers"), ("flashinfer", "flashinfer_python")):
        kv, vv = _version(site, dist), metadata.version(dist.replace("_", "-"))
        if kv != vv:
            raise SystemExit(f"kit {dist} {kv} != this venv's {vv}: the check needs the same versions")
        os.symlink(os.path.join(site, pkg), os.path.join(overlay, pkg))
    with open(os.path.join(overlay, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    block = [p for p in WHOLE if not os.path.exists(os.path.join(site, p))]
    return overlay, block


def _lib_key(rel):
    """A compiled file's site-relative path without its Python tag: 'a/b.cpython-311-x86_64-linux-gnu.so'
    and the kit's 'a/b.cpython-312-x86_64-linux-gnu.so' or 'a/b.abi3.so' are one key."""
    return re.sub(r"\.(cpython-3\d+-[^.]*|abi3)\.so$", ".so", rel)


def missing_libs(site, mapped):
    """The compiled files this process mapped from the venv's site-packages (``mapped``: absolute
    paths) that the kit lacks, for packages the kit holds.  The kit's compiled code cannot load here,
    but the venv's copy of the same package loads the same libraries: a library the trim removed
    that the CPU import maps (tvm_ffi's testing library, which the H200 import loads without
    ``import tvm_ffi.testing``) fails here instead of on the host."""
    have = set()
    for root, _, files in os.walk(site):
        for f in files:
            if ".so" in f:
                have.add(_lib_key(os.path.relpath(os.path.join(root, f), site)))
    out = []
    for path in sorted(set(mapped)):
        if "site-packages/" not in path:
            continue
        rel = path.split("site-packages/", 1)[1]
        if os.path.isdir(os.path.join(site, rel.split("/")[0])) and _lib_key(rel) not in have:
            out.append(rel)
    return out


def child(site, models):
    """Runs inside the overlay environment."""
    import importlib
    real_site = os.path.realpath(site)
    for pkg in OVERLAID:
        m = importlib.import_module(pkg)
        assert os.path.realpath(m.__file__).startswith(real_site), (pkg, m.__file__)
    print(f"ok  overlay: {', '.join(OVERLAID)} from {site}; blocked: {os.environ.get('CHECK_KIT_BLOCK')}", flush=True)
    for name in SERVER_MODULES:
        importlib.import_module(name)
        print(f"ok  import {name}", flush=True)
    from sglang.srt.models.registry import ModelRegistry
    for arch in ARCHS:
        cls, _ = ModelRegistry.resolve_model_cls([arch])
        print(f"ok  registry {arch} -> {cls.__module__}.{cls.__name__}", flush=True)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer
    for path in models:
        mc = ModelConfig(path)
        line = f"ok  ModelConfig {os.path.basename(path)}: {mc.hf_config.architectures[0]} ({mc.hf_config.model_type})"
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            tok = get_tokenizer(path)
            ids = tok.encode("def f(x):\n    return x")
            assert tok.decode(ids, skip_special_tokens=True).endswith("return x"), ids
            line += f", tokenizer {type(tok).__name__}"
        print(line, flush=True)
    leaked = sorted(k for k in os.environ.get("CHECK_KIT_BLOCK", "").split(",") if k and sys.modules.get(k))
    assert not leaked, f"blocked packages were imported: {leaked}"
    with open("/proc/self/maps") as f:
        mapped = [line.split()[-1] for line in f if ".so" in line]
    lost = missing_libs(site, mapped)
    assert not lost, f"compiled libraries the server import loads but the kit lacks: {lost}"
    print(f"ok  every compiled library the import mapped from a kit package is in the kit", flush=True)


def dist_import_names(site):
    """{distribution: import names} as importlib.metadata.packages_distributions() sees the kit's
    dist-info folders (top_level.txt, else the files RECORD lists; kit_trim's records rule swaps the
    RECORD for the top_level.txt it implies): a distribution with none would hide its version from
    transformers' import_utils."""
    import inspect
    from importlib import metadata
    from pathlib import PurePosixPath
    out = {}
    for d in metadata.distributions(path=[site]):
        names = set((d.read_text("top_level.txt") or "").split())
        if not names:
            for f in d.files or []:
                parts = PurePosixPath(str(f)).parts
                names.add(parts[0] if len(parts) > 1 else (inspect.getmodulename(parts[0]) or parts[0]))
            names = {n for n in names if "." not in n}
        out[d.metadata["Name"]] = sorted(names)
    return out


def model_dirs(work):
    """The test bed's model folders, configs and tokenizers only."""
    out = os.path.join(work, "models")
    subprocess.run([sys.executable, os.path.join(HERE, "mk_models.py"), out, "--configs-only"], check=True,
                   stdout=subprocess.DEVNULL)
    dirs = [os.path.join(out, n) for n in ("gqa_target", "mla_target", "drafter")]
    sys.path.insert(0, REPO)
    from sglang_ddtree import textpair as TP
    text = os.path.join(out, "text_target")
    os.makedirs(text)
    with open(os.path.join(text, "config.json"), "w") as f:
        json.dump(TP.TARGET, f)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = os.path.join(REPO, "bench", "textpair", "tokenizer", name)
        if os.path.exists(src):
            with open(src) as fi, open(os.path.join(text, name), "w") as fo:
                fo.write(fi.read())
    moe = os.path.join(out, "qwen3_moe_target")
    os.makedirs(moe)
    with open(os.path.join(dirs[0], "config.json")) as f:
        cfg = json.load(f)
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1, norm_topk_prob=True,
               mlp_only_layers=[])
    with open(os.path.join(moe, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dirs + [text, moe]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("site")
    ap.add_argument("--pytest", nargs="*", default=[], help="test files to run in the same environment")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="*", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    site = os.path.abspath(a.site)
    if a.child:
        child(site, a.models)
        return 0
    names = dist_import_names(site)
    missing = sorted(k for k, v in names.items() if not v)
    if missing:
        print(f"FAILED: kit distributions with no import name (no top_level.txt, no RECORD): {missing}")
        return 1
    print(f"ok  {len(names)} distributions, each with its import names (top_level.txt / RECORD)")
    with tempfile.TemporaryDirectory(prefix="check_kit_") as work:
        overlay, block = prepare(site, work)
        models = model_dirs(work)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([overlay] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   CHECK_KIT_BLOCK=",".join(block))
        r = subprocess.run([sys.executable, os.path.abspath(__file__), site, "--child", "--models", *models], env=env)
        if r.returncode != 0:
            print("FAILED: the trimmed kit misses something the server imports (above)")
            return r.returncode
        if a.pytest:
            r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *a.pytest],
                               env=env, cwd=REPO)
            if r.returncode != 0:
                print("FAILED: tests under the trimmed kit")
                return r.returncode
    print("kit check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
