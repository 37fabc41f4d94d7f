"""bench/device/stage.py's stage names: each suffix sets the switch the GPU stage is meant to test."""
import json
import os

import pytest

from helpers import load_bench
from sglang_ddtree import switches

ST = load_bench("device/stage")
KEYS = ("SGLANG_DDTREE_BUDGETS", switches.ENV,
        "SGLANG_DDTREE_VERIFY_ATTN", "DDTREE_STAGE_MOE_BACKEND", "DDTREE_STAGE_UNCAPPED",
        "DDTREE_STAGE_REGIME_PLAIN", "DDTREE_STAGE_REGIME_SWITCHES",
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY", "SGLANG_DDTREE_SYNC_CHECK_FILE")
SET_BY_EVERY_NAME = ("SGLANG_DDTREE_ADAPTIVE", "DDTREE_STAGE_DEFAULT_BUDGET")   # cleaned up as well


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Absent during the test and restored after it: parse_name sets os.environ directly, and a
    delenv of an absent key records nothing to undo (the switches leaked into later test files)."""
    for k in KEYS + SET_BY_EVERY_NAME:
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    monkeypatch.setattr(switches, "CURRENT", switches.Switches())   # parse_name applies switches here
    monkeypatch.setattr(switches, "ERROR", None)


def _switches():
    return json.loads(os.environ[switches.ENV])


def test_plain_name_sets_no_switch():
    assert ST.parse_name("text_ddtree_graph_b16") == ("text", "ddtree", "graph", 16, "triton")
    assert not any(k in os.environ for k in KEYS)


def test_cycle_and_vattn_suffixes():
    ST.parse_name("gqa_ddtree_graph_b31_cycle_vattn")
    assert os.environ["SGLANG_DDTREE_BUDGETS"] == "0,3,7,31"            # 0: no speculation
    cyc = _switches()["budget_cycle"]
    assert cyc[0] == 31 and 0 in cyc and set(cyc) <= {0, 3, 7, 31}
    assert switches.CURRENT.budget_cycle == tuple(cyc)     # applied in the stage's own process too
    assert os.environ["SGLANG_DDTREE_VERIFY_ATTN"] == "ddtree"


def test_auto_has_no_forced_cycle():
    ST.parse_name("mla_ddtree_graph_b16_auto")
    assert os.environ["SGLANG_DDTREE_BUDGETS"] == "0,3,7,16" and switches.ENV not in os.environ


def test_test_switch_suffixes():
    """nospec, nomaskpatch and maskcap<N> are switches (sglang_ddtree/switches.py), not variables a
    server reads: one DDTREE_SWITCHES object, merged across suffixes."""
    ST.parse_name("text_ddtree_graph_b16_nomaskpatch_maskcap4096")
    assert _switches() == {"graph_mask_patch": False, "graph_mask_cap": 4096}
    assert switches.CURRENT == switches.Switches(graph_mask_patch=False, graph_mask_cap=4096)
    assert os.environ.pop("SGLANG_DDTREE_ADAPTIVE") == "0"        # b16 alone: a fixed budget
    os.environ.pop(switches.ENV)
    ST.parse_name("gqa_ddtree_graph_nospec_flashinfer")
    assert _switches() == {"budget_cycle": [0]} and "SGLANG_DDTREE_ADAPTIVE" not in os.environ


@pytest.mark.parametrize("bad", ["gqa_dflash_graph_cycle", "gqa_ddtree_graph_b4_cycle", "zzz_ddtree_graph_b16"])
def test_bad_names(bad):
    with pytest.raises(ValueError):
        ST.parse_name(bad)


def test_sglattn_suffix_selects_sglangs_verify_kernel():
    ST.parse_name("mla_ddtree_graph_b16_sglattn")
    assert os.environ["SGLANG_DDTREE_VERIFY_ATTN"] == "sglang"


def test_uncapped_default_leaves_the_running_requests_to_the_server():
    """``uncapped`` (with ``default`` only): no --max-running-requests and decode graphs up to bs 96,
    so the tree widths' graphs stop at 64 and the plain state's go on (spec_algo.plain_floor_graphs)."""
    pair, algo, mode, budget, kw = ST.stage_kwargs("gqa_ddtree_graph_default_uncapped", "/m", 30000)
    assert "max_running_requests" not in kw and kw["cuda_graph_max_bs_decode"] == 96
    assert "SGLANG_DDTREE_ADAPTIVE" not in os.environ and "speculative_num_draft_tokens" not in kw
    os.environ.pop("DDTREE_STAGE_UNCAPPED")
    *_, kw = ST.stage_kwargs("gqa_ddtree_graph_default", "/m", 30000)
    assert kw["max_running_requests"] == 16 and kw["cuda_graph_max_bs_decode"] == 16
    for bad in ("gqa_ddtree_graph_b16_uncapped", "gqa_ddtree_graph_nospec_uncapped"):
        os.environ.pop("DDTREE_STAGE_UNCAPPED", None)
        with pytest.raises(ValueError, match="uncapped"):
            ST.parse_name(bad)


def test_mem_fraction_override_for_a_shared_gpu(monkeypatch):
    """A trainer in the same group (run_stages.sh exports DDTREE_STAGE_MEM_FRACTION=0.9): the engines'
    memory fraction follows it; without it the test bed's 0.5 stays (control)."""
    monkeypatch.delenv("DDTREE_STAGE_MEM_FRACTION", raising=False)
    *_, kw = ST.stage_kwargs("gqa_ddtree_graph_default", "/m", 30000)
    assert kw["mem_fraction_static"] == 0.5
    monkeypatch.setenv("DDTREE_STAGE_MEM_FRACTION", "0.9")
    *_, kw = ST.stage_kwargs("gqa_ddtree_graph_default", "/m", 30000)
    assert kw["mem_fraction_static"] == 0.9 and kw["max_total_tokens"] == 32768
    sh = open(os.path.join(os.path.dirname(ST.__file__), "run_stages.sh")).read()
    assert 'export DDTREE_STAGE_MEM_FRACTION=0.9' in sh and '*" codepair_train "*' in sh


def test_regimeplain_forces_the_plain_regime_on_the_default():
    ST.parse_name("gqa_ddtree_graph_default_regimeplain_flashinfer")
    assert _switches() == {"regime": "plain"} and os.environ["DDTREE_STAGE_REGIME_PLAIN"] == "1"
    assert switches.CURRENT.regime == "plain"
    with pytest.raises(ValueError, match="regimecycle need default"):
        ST.parse_name("gqa_ddtree_graph_b16_regimeplain")


def test_regimecycle_flips_the_regime_on_the_default():
    ST.parse_name("mla_ddtree_graph_default_regimecycle_memcheck")
    assert _switches() == {"regime": "cycle7"} and switches.CURRENT.regime == "cycle7"
    assert os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] == "1"
    with pytest.raises(ValueError, match="regimecycle need default"):
        ST.parse_name("gqa_ddtree_graph_b16_regimecycle")
    ST.parse_name("gqa_ddtree_graph_default_regimeauto")
    assert switches.CURRENT.regime == "auto"


def test_dfastplan_sets_the_draft_fast_plan_switch():
    """dfastplan: the drafter's flashinfer graphs re-plan from host lengths (switch draft_fast_plan);
    with synccheck the stage also counts the rounds' host syncs."""
    assert ST.parse_name("gqa_ddtree_graph_default_dfastplan_synccheck_flashinfer")[4] == "flashinfer"
    assert _switches() == {"draft_fast_plan": True}
    assert switches.CURRENT.draft_fast_plan
    assert os.environ["SGLANG_DDTREE_SYNC_CHECK_FILE"].endswith("dfastplan_synccheck_flashinfer.jsonl")
