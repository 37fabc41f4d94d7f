"""What `pip install` gives a user: the built wheel alone runs the main job (issue 15 item 2).

The wheel is built from a copy of the package sources (nothing is written into the checkout),
installed into a fresh virtual environment that sees only this environment's third-party packages
(torch, triton, numpy, safetensors, SGLang) and never the checkout, and runs
``python -m sglang_ddtree.demo`` there: the captured top-k and the text pair come from the wheel's
package data, the kernels from ``sglang_ddtree.kernels`` inside it.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
import torch

from helpers import env_without_checkout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("pyproject.toml", "README.md", "sglang_ddtree", "kernels", "patches")


def _build_wheel(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        p = os.path.join(REPO, name)
        if os.path.isdir(p):
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(p, src / name)
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(dist), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wheels = list(dist.glob("sglang_ddtree-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _fresh_venv(tmp_path):
    """A venv whose only third-party packages are this environment's site-packages, added as plain
    directories: the .pth files there (this environment's editable install of the checkout) are
    not processed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = {os.path.dirname(os.path.dirname(torch.__file__)), sysconfig.get_paths()["purelib"],
            sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "_third_party.pth"), "w") as f:
        f.write("\n".join(sorted(deps)) + "\n")
    return py, site


def test_the_main_job_runs_from_the_wheel_alone(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "sglang_ddtree/kernels/topk_logprobs.py" in names and "sglang_ddtree/patches/__init__.py" in names
    assert not any(n.startswith(("kernels/", "patches/", "bench/", "tests/")) for n in names), \
        "a top-level kernels package would shadow Hugging Face's, which SGLang imports"
    for data in ("data/fixtures/topk_text_dflash_r01.npz", "data/textpair/target.safetensors",
                 "data/textpair/drafter.safetensors", "data/textpair/heldout_prompts.json"):
        assert "sglang_ddtree/" + data in names, data
    entry = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry[0]).decode()
    assert "ddtree = sglang_ddtree.plugin:register" in text and "sglang-ddtree-ab" in text

    py, site = _fresh_venv(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = env_without_checkout()
    env.pop("PYTHONPATH", None)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    where = subprocess.run([str(py), "-c", "import sglang_ddtree.kernels as k, sglang_ddtree as p; "
                            "print(p.__file__); print(k.__file__)"], cwd=run_dir, env=env,
                           capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(line.startswith(site) for line in where.stdout.split()), (where.stdout, site)
    out = run_dir / "demo.json"
    r = subprocess.run([str(py), "-m", "sglang_ddtree.demo", "--budget", "8", "--new-tokens", "4",
                        "--json", str(out)], cwd=run_dir, env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["fixtures"] and all(f["identical"] for f in rep["fixtures"])
    assert rep["pipeline"]["pair"] == "text" and rep["pipeline"]["identical_to_greedy"]
    gqa = subprocess.run([str(py), "-m", "sglang_ddtree.demo", "--pair", "gqa"], cwd=run_dir, env=env,
                         capture_output=True, text=True, timeout=600)
    assert gqa.returncode != 0 and "--pair gqa needs the sglang-ddtree checkout" in gqa.stderr
