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
