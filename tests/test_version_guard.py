"""The SGLang version guard (``plugin.version_refusal`` / ``register``): on an SGLang version the hooks
were not checked against, DDTREE-GPU is refused at argument checking with one line naming the
checked versions and no hook is installed; ``SGLANG_DDTREE_ALLOW_UNCHECKED_SGLANG=1`` lets it run
(with a warning).  Fresh processes with SGLang's version string changed before ``load_plugins()``."""
import json
import subprocess
import sys

import pytest

from sglang_ddtree import plugin
from helpers import env_without_checkout

pytest.importorskip("sglang.srt.plugins")


def test_checked_versions_come_from_the_patches():
    from sglang_ddtree.patches import ALL
    assert plugin.checked_sglang_versions() == ("0.5.16",)
    for mod in ALL:
        assert "0.5.16" in mod.CHECKED_SGLANG_VERSIONS


def test_version_refusal_paths():
    assert plugin.version_refusal("0.5.16", env={}) is None
    msg = plugin.version_refusal("0.6.1", env={})
    assert "checked against SGLang 0.5.16 only; this is SGLang 0.6.1" in msg
    assert plugin.ENV_ALLOW_UNCHECKED in msg and "\n" not in msg
    assert plugin.version_refusal("0.6.1", env={plugin.ENV_ALLOW_UNCHECKED: "1"}) is None
    assert plugin.version_refusal("0.6.1", env={plugin.ENV_ALLOW_UNCHECKED: "0"}) is not None


CODE = r'''
import json, sys
import sglang
sglang.__version__ = sys.argv[1]
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_ddtree.spec_algo import GPU_NAME
spec = SpeculativeAlgorithm.from_string(GPU_NAME)
out = {"patched": sorted(t for t in HookRegistry._patched if "tokenizer_manager" in t or "decode_cuda_graph" in t)}
try:
    spec.validate_server_args(object()) if hasattr(spec, "validate_server_args") else None
    out["validate"] = "ok"
except ValueError as e:
    out["validate"] = "ValueError: " + str(e)
except Exception as e:
    out["validate"] = type(e).__name__
print("RESULT" + json.dumps(out))
'''


def _run(version, env_extra=None):
    e = env_without_checkout(**(env_extra or {}))
    r = subprocess.run([sys.executable, "-c", CODE, version], cwd="/", env=e, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("RESULT", 1)[1]), r.stderr


def test_unchecked_version_refuses_and_installs_no_hook():
    out, err = _run("0.9.0")
    assert out["patched"] == []
    assert out["validate"].startswith("ValueError: sglang-ddtree was checked against SGLang 0.5.16 only; "
                                      "this is SGLang 0.9.0")
    assert "checked against SGLang 0.5.16 only" in err       # logged once, as an error line


def test_unchecked_version_allowed_by_the_environment():
    out, err = _run("0.9.0", {plugin.ENV_ALLOW_UNCHECKED: "1"})
    assert len(out["patched"]) == 2
    assert not out["validate"].startswith("ValueError: sglang-ddtree was checked")
    assert "trying anyway" in err
