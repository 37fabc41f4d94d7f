"""bench/logprobs_check.py's parsing and comparison helpers (the GPU stage itself needs servers)."""
from helpers import load_bench

LC = load_bench("logprobs_check")


def test_out_tokens_reads_sglang_layout():
    resp = {"meta_info": {"output_token_logprobs": [[-0.5, 11, None], [-1.25, 7, None]],
                          "output_top_logprobs": [[[-0.5, 11, None], [-1.0, 3, None]],
                                                  [[-1.25, 7, None], [-1.5, 9, None]]]}}
    toks, tops = LC.out_tokens(resp)
    assert toks == [(11, -0.5), (7, -1.25)]
    assert tops[1] == [(7, -1.25), (9, -1.5)]


def test_compare_top_counts_value_and_id_mismatches():
    ref = [(1, -0.1), (2, -2.0), (3, -3.0)]
    assert LC.compare_top([(1, -0.12), (2, -2.03), (3, -2.98)], ref, 0.05) == 0
    assert LC.compare_top([(1, -0.3), (2, -2.0), (3, -3.0)], ref, 0.05) == 1       # value off
    assert LC.compare_top([(1, -0.1), (2, -2.0), (4, -3.01)], ref, 0.05) == 0      # edge near tie swap
    assert LC.compare_top([(1, -0.1), (2, -2.0), (4, -2.5)], ref, 0.05) == 1       # a real extra id
