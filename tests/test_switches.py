"""sglang_ddtree/switches.py: the A/B's and the test bed's switches are not server settings (issue 40
item 3).  A server gets them only through the switches plugin that the A/B / test bed put on its
PYTHONPATH; SGLang's own plugin loader runs it in a fresh process here, with and without it."""
import json
import os
import subprocess
import sys

import pytest

from helpers import env_without_checkout
from sglang_ddtree import switches as S
from sglang_ddtree.ab import servers

# a fresh process: SGLang loads every plugin it finds, then the launcher's check runs
PROBE = r'''
import json
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_ddtree import env_vars, switches
try:
    env_vars.check({}, algo="DDTREE-GPU", budget=15)
    err = None
except ValueError as e:
    err = str(e)
print("RESULT" + json.dumps({"current": switches.describe(), "error": err}))
'''


def _probe(env):
    r = subprocess.run([sys.executable, "-c", PROBE], cwd="/", env=env_without_checkout(**env),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("RESULT", 1)[1])


def test_values_are_checked_where_they_are_made():
    assert S.describe(S.Switches()) is None
    sw = S.parse('{"budget_cycle": [15, 0], "kv_commit": "move", "graph_mask_cap": 64}')
    assert sw.budget_cycle == (15, 0) and sw.kv_commit == "move" and sw.graph_mask_cap == 64
    assert S.describe(sw) == "budget_cycle=(15, 0), kv_commit='move', graph_mask_cap=64"
    for text, says in (('{"budget_cycle": []}', "non-empty"), ('{"budget_cycle": [3, -1]}', ">= 0"),
                       ('{"budget_cycle": [true]}', "integers"), ('{"kv_commit": "copy"}', "'remap' or 'move'"),
                       ('{"commit_ops": "triton"}', "'fused' or 'torch'"), ('{"round_overhead": "off"}', "true or false"),
                       ('{"graph_mask_cap": 0}', ">= 1"), ('{"budget_cyle": [0]}', "unknown switch 'budget_cyle'"),
                       ('[0]', "JSON object"), ('{budget_cycle: 0}', "not JSON")):
        with pytest.raises(ValueError, match=None) as ei:
            S.parse(text)
        assert says in str(ei.value) and str(ei.value).startswith(S.ENV), (text, str(ei.value))
    assert json.loads(S.to_env(budget_cycle=(0,), round_overhead=False)) == {"budget_cycle": [0], "round_overhead": False}
    with pytest.raises(ValueError):
        S.to_env(kv_commit="copy")


def test_a_server_without_the_plugin_ignores_DDTREE_SWITCHES():
    """What a user's pip-installed server does: no entry point loads the switches, so the variable
    changes nothing (and is not one of the plugin's SGLANG_DDTREE_* settings either)."""
    got = _probe({S.ENV: '{"budget_cycle": [0]}'})
    assert got == {"current": None, "error": None}


def test_the_plugin_sets_them_in_the_process_and_a_bad_value_is_refused_by_the_launcher(tmp_path):
    folder = S.write_plugin(str(tmp_path / "plugin"))
    path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    got = _probe({S.ENV: '{"budget_cycle": [0], "commit_ops": "torch"}', "PYTHONPATH": path})
    assert got == {"current": "budget_cycle=(0,), commit_ops='torch'", "error": None}
    # SGLang's loader logs a plugin's exception and goes on: the launcher's check refuses instead
    bad = _probe({S.ENV: '{"kv_commit": "copy"}', "PYTHONPATH": path})
    assert bad["current"] is None and bad["error"].startswith("DDTREE-GPU: DDTREE_SWITCHES: kv_commit must be")


class _Log:
    def __init__(self, path, switches_expected):
        self.log_path, self.switches_expected = path, switches_expected

    def poll(self):
        return None


def test_the_ab_fails_an_arm_whose_server_did_not_log_its_switches(tmp_path, monkeypatch):
    """An arm with switches whose plugin did not load would measure the defaults under its name:
    wait_healthy turns the missing log line into the arm's failure."""
    monkeypatch.setattr(servers, "http_json", lambda *a, **k: (200, {}))
    log = tmp_path / "server.log"
    log.write_text("server started\n")
    why = servers.wait_healthy("http://x", _Log(str(log), '{"budget_cycle": [0]}'), 5)
    assert why and "did not load" in why
    log.write_text(f"... {S.LOG_TAG} budget_cycle=(0,)\n")
    assert servers.wait_healthy("http://x", _Log(str(log), '{"budget_cycle": [0]}'), 5) is None
    assert servers.wait_healthy("http://x", _Log(str(log), None), 5) is None


def test_popen_server_puts_the_plugin_first_on_the_path(tmp_path, monkeypatch):
    seen = {}

    class FakePopen:
        def __init__(self, cmd, env=None, **kw):
            seen["env"] = env
            self.pid = 1

    monkeypatch.setattr(servers.subprocess, "Popen", FakePopen)
    env = dict(os.environ, PYTHONPATH="/other", **servers.parse_arm("ddtree_nospec")["env"])
    srv = servers.PopenServer(["x"], env, str(tmp_path / "server.log"))
    first = seen["env"]["PYTHONPATH"].split(os.pathsep)
    assert first[1:] == ["/other"] and srv.switches_expected == '{"budget_cycle": [0]}'
    eps = open(os.path.join(first[0], "ddtree_switches-0.0.0.dist-info", "entry_points.txt")).read()
    assert "ddtree_switches = sglang_ddtree.switches:register_from_environment" in eps
    srv.log.close()
    plain = servers.PopenServer(["x"], dict(os.environ, PYTHONPATH="/other"), str(tmp_path / "b.log"))
    assert seen["env"]["PYTHONPATH"] == "/other" and plain.switches_expected is None
    plain.log.close()
