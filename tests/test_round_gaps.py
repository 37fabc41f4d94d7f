"""bench/scale/round_gaps.py: records of one server split into warm-up and (arm, level, repeat)
segments, by the A/B's repeat windows or sequentially by request-round counts, and summed."""
import importlib.util
import io
import json
import os
import random
import tarfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "round_gaps", os.path.join(os.path.dirname(HERE), "bench", "scale", "round_gaps.py"))
RG = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(RG)


def _rec(t0, rounds, bs, round_ms, width):
    """A profile record of ``rounds`` rounds at batch ``bs``, ``round_ms`` each, back to back from t0."""
    t_last = t0 + (rounds - 1) * round_ms / 1000.0
    return {"t_first": round(t0, 6), "t_last": round(t_last, 6), "rounds": rounds, "bs_mean": bs,
            "round_ms": {"mean": round_ms}, "host_ms": {"mean": round_ms / 2},
            "by_width": {str(width): {"rounds": rounds}}}


def _run(rng, with_windows):
    """A server serving arm 'auto' and its pin 'auto_pin15': warm-up burst + single, then two levels
    x two repeats per arm; the repeats of a level have the same records but for one that is a round
    longer or shorter (the level reports the last repeat's count; the sequential split's contract:
    repeats differ by less than half a record, as on the H200, where they differ by 1-4 %), and a
    pause after the first record of some repeats (a drained batch)."""
    recs, arms, t = [], [], 1000.0
    warm = {}
    for key, bs in (("burst", 8), ("single", 1)):
        n = rng.randint(2, 4)
        rr = 0
        for _ in range(n):
            r = _rec(t, 16, bs, 5.0, 16)
            recs.append(r)
            rr += 16 * bs
            t = r["t_last"] + 0.02
        warm[key] = {"spec_verify_ct": rr - 3, "completed": 3}
    truth = []
    for name in ("auto", "auto_pin15"):
        levels = []
        for c in (1, 4):
            tputs, wins = [], []
            shape = [rng.randint(8, 16) for _ in range(rng.randint(3, 5))]   # rounds per record
            for rep in range(2):
                odd = rng.randrange(len(shape))            # the one record that differs by a round
                t += 0.3                               # flush + sleep between repeats
                t_start, rr, mine = t, 0, []
                for k, n in enumerate(shape):
                    if k == 1 and rng.random() < 0.5:
                        t += 0.3                       # a mid-repeat drain
                    n = n + (rng.choice((-1, 1)) if k == odd else 0)
                    r = _rec(t, n, c, rng.uniform(4, 9), 16 if "pin" in name else 32)
                    recs.append(r)
                    mine.append(r)
                    rr += r["rounds"] * c
                    t = r["t_last"] + 0.01
                truth.append(mine)
                tputs.append(100.0 + rep)
                wins.append([t_start - 0.01, t + 0.01])
            lv = {"concurrency": c, "output_throughput": tputs[0], "output_throughput_repeats": tputs,
                  "spec_verify_ct": rr - c, "completed": c}
            if with_windows:
                lv["repeat_windows"] = wins
            levels.append(lv)
        arm = {"name": name, "levels": levels}
        if name == "auto":
            arm["warmup"] = warm
        else:
            arm["server_of"] = "auto"
        arms.append(arm)
    return {"arms": arms}, recs, truth


@pytest.mark.parametrize("with_windows", [True, False])
def test_segments_get_their_own_records(with_windows):
    rng = random.Random()
    doc, recs, truth = _run(rng, with_windows)
    segs = RG._segments(doc, "auto")
    assert [s["level"] for s in segs[:2]] == ["warm-up burst", "warm-up single"]
    RG.assign(segs, recs)
    got = [s["recs"] for s in segs[2:]]
    assert got == truth, "a repeat got another repeat's records"
    assert all(s["split"] == ("window" if with_windows else "sequential") for s in segs[2:])
    row = RG.summarize(segs[2])
    mine = truth[0]
    assert row["rounds"] == sum(r["rounds"] for r in mine)
    assert row["round_ms"] == pytest.approx(sum(r["rounds"] * r["round_ms"]["mean"] for r in mine), abs=0.1)
    span = (mine[-1]["t_last"] - mine[0]["t_first"]) * 1000
    assert row["span_ms"] == pytest.approx(span, abs=0.1)
    assert row["outside_ms"] == pytest.approx(span - row["round_ms"] + mine[0]["round_ms"]["mean"], abs=0.2)
    assert row["widths"] == {"32": row["rounds"]}


def test_main_reads_a_logs_tgz_and_refuses_merged_files(tmp_path):
    doc, recs, _ = _run(random.Random(1), True)
    (tmp_path / "ab.json").write_text(json.dumps(doc))
    data = "\n".join(json.dumps(r) for r in recs).encode()
    # the server log: warm-up prefills (before any flush: not counted), then per measured repeat a
    # cache flush and k prefill batches (8 repeats: 2 arms x 2 levels x 2)
    lines = ["[t] Prefill batch, #new-seq: 8, #new-token: 99, #cached-token: 0"]
    for k in range(8):
        lines.append("[t] Cache flushed successfully!")
        lines += [f"[t] Prefill batch, #new-seq: 2, #new-token: {10 + k}, #cached-token: 0"] * (k + 1)
        lines.append("[t] Decode batch, #running-req: 2")
    log = "\n".join(lines).encode()
    with tarfile.open(tmp_path / "logs.tgz", "w:gz") as tf:
        for name, blob in (("abw_x/profile_auto.jsonl", data), ("abw_x/server_auto.log", log)):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tf.addfile(info, io.BytesIO(blob))
    out = str(tmp_path / "gaps")
    assert RG.main([str(tmp_path / "ab.json"), str(tmp_path / "logs.tgz"), "--levels", "4", "--out", out]) == 0
    rows = json.load(open(out + ".json"))["rows"]
    assert [(r["arm"], r["level"], r["repeat"]) for r in rows] == [
        ("auto", 4, 1), ("auto", 4, 2), ("auto_pin15", 4, 1), ("auto_pin15", 4, 2)]
    assert "| auto_pin15 | 4 | 2 | window |" in open(out + ".md").read()
    # run order: auto c1 r1, r2, auto c4 r1, r2, pin15 c1 r1, r2, pin15 c4 r1, r2 -> flushes 2, 3, 6, 7
    assert [r["prefill_batches"] for r in rows] == [3, 4, 7, 8]
    assert [r["prefill_tokens"] for r in rows] == [3 * 12, 4 * 13, 7 * 16, 8 * 17]
    assert all(r["outside_per_prefill_ms"] == pytest.approx(r["outside_ms"] / r["prefill_batches"], abs=0.01)
               for r in rows)
    levels = json.load(open(out + ".json"))["levels"]
    assert [(x["arm"], x["level"], x["repeats"]) for x in levels] == [("auto", 4, 2), ("auto_pin15", 4, 2)]
    for x in levels:
        mine = [r for r in rows if (r["arm"], r["level"]) == (x["arm"], x["level"])]
        assert x["round_ms"] == pytest.approx(sum(r["round_ms"] for r in mine) / 2, abs=0.1)   # median of two
        calm = [r for r in mine if r["max_gap_ms"] < 250]
        assert x["calm"] == len(calm)
    (tmp_path / "m.json").write_text(json.dumps({"kind": "ab_serve_merged", "runs": []}))
    with pytest.raises(SystemExit, match="merged"):
        RG.main([str(tmp_path / "m.json"), str(tmp_path / "logs.tgz")])
