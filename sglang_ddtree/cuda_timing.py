"""GPU time of calls as a CUDA graph replays them (the benchmarks' timer; no host launch overhead).

``graph_time_us(fn_list, replays)``: warm the calls up on a side stream (compiles, allocator),
capture them back to back in one graph, replay it 5 times, then time ``replays`` replays with CUDA
events.  Returns (median, min, max) microseconds per call (replay time / ``len(fn_list)``).
Rotating input sets go in as one call each, so a small working set does not sit in L2.
"""
from __future__ import annotations

import statistics


def graph_time_us(fn_list, replays=50):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fn_list:  # warm-up / compile outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fn_list:
            fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        st, en = torch.cuda.Event(True), torch.cuda.Event(True)
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        ts.append(st.elapsed_time(en) * 1e3 / len(fn_list))
    return statistics.median(ts), min(ts), max(ts)
