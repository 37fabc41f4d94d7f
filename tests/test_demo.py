"""The README's main job runs end to end (small settings) and reports a lossless result."""
import json

from sglang_ddtree import demo


def test_demo_main_job(tmp_path):
    out = tmp_path / "report.json"
    rc = demo.main(["--budget", "8", "--new-tokens", "6", "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["ok"]
    assert rep["pipeline"]["identical_to_greedy"]
    assert all(r["identical"] for r in rep["fixtures"])
    assert rep["pipeline"]["mean_tokens_per_round"] >= 1.0
    assert rep["pipeline"]["pair"] == "text"  # the default pair is the text-trained one


def test_demo_gqa_pair(tmp_path):
    """The permutation-chain pair (own process: one pair's configs per process)."""
    import subprocess
    import sys
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "sglang_ddtree.demo", "--pair", "gqa", "--budget", "8",
                        "--new-tokens", "5", "--json", str(out)], cwd="/", capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["pipeline"]["identical_to_greedy"] and rep["pipeline"]["pair"] == "gqa"
