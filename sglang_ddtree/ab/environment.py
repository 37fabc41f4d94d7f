"""The run's environment: GPU, package versions as the server's interpreter sees them, git commit."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from typing import Optional

from . import checkout


# ------------------------------------------------------------------------------------------ environment
def git_info():
    """(commit, dirty) of the checkout (DDTREE_COMMIT wins); ("unknown", False) without a checkout."""
    repo = checkout.root()

    def g(*a):
        if repo is None:  # an installed package: never the git state of whatever folder we run in
            return ""
        try:
            return subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001
            return ""
    commit = os.environ.get("DDTREE_COMMIT") or g("rev-parse", "--short", "HEAD") or "unknown"  # the device copy may carry a stale .git
    dirty = bool(g("status", "--porcelain", "--untracked-files=no"))
    return commit, dirty


def pkg_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        pass
    try:  # a site-packages overlay without dist-info (the GPU host's kit): read version.py, no import
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec and spec.submodule_search_locations:
            vf = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", open(vf).read())
            return m.group(1) if m else None
    except Exception:  # noqa: BLE001
        return None
    return None


def env_info(python: str) -> dict:
    gpu = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        gpu = out.splitlines() or None
    except Exception:  # noqa: BLE001
        pass
    commit, dirty = git_info()
    vers = {}
    try:  # versions as the server's interpreter sees them (no sglang import: it takes 10+ s)
        code = ("import json,importlib.metadata as m\nd={}\nfor n in ('torch','triton','sglang','transformers',"
                "'sglang-kernel','flashinfer-python'):\n  try: d[n]=m.version(n)\n  except Exception: d[n]=None\n"
                "print(json.dumps(d))")
        vers = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout)
    except Exception:  # noqa: BLE001
        vers = {}
    for n in ("torch", "triton", "sglang"):
        vers[n] = vers.get(n) or pkg_version(n)
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                git_commit=commit, git_dirty=dirty, gpu=gpu, python=platform.python_version(),
                host=platform.node(), versions=vers, argv=sys.argv)

