"""HTTP stage client: wait for an SGLang server, then check it end to end.

usage: python bench/device/http_client.py BASE_URL LIMIT_S SERVER_PID PERM_JSON STAGE RESULTS_JSONL
STAGE = http_<pair>[_<algo>].  Checks (all must pass):
  * /generate with token ids returns exactly the toy target's greedy chain (perm^k);
  * the text form of /generate and /v1/completions answer 200 with text;
  * 16 concurrent requests with staggered starts (requests join a running batch mid-flight) and
    different lengths all return their exact chains;
  * a long request aborted through /abort_request ends with finish_reason abort, and the server
    still answers exactly afterwards;
  * streaming returns the same tokens;
  * bad input gets a 4xx or an abort with a message (return_logprob, which the DFlash family does
    not support; a negative temperature), never a dead server;
  * DDTREE servers: a request pinning the fixed budget (custom_params.ddtree_budget) gets its exact
    chain, one pinning a budget the server does not run is refused.
One JSON record is appended to RESULTS_JSONL; exit 0 only when everything passed.
"""
import json
import os
import sys
import time

import requests

EXTRA_KEYS = ("concurrent_match", "abort_ok", "after_abort_match", "stream_match", "logprob_handled",
              "bad_temperature_rejected", "healthy_after_bad_input", "budget_pin_ok")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stage import expected_chain as chain  # noqa: E402  (perm^k of the prompt's last token)


def pin_checks(base, perm, p, num_draft):
    """A DDTREE request pinning the server's fixed budget gets its exact chain; one pinning a budget
    the server does not run is refused (abort or 4xx) and the server keeps answering exactly."""
    r = {}
    budget = int(num_draft) - 1 if num_draft else None

    def gen(pin):
        return requests.post(base + "/generate", json={"input_ids": p, "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True,
            "custom_params": {"ddtree_budget": pin}}}, timeout=120)
    ok = budget is not None
    if ok:
        g = gen(budget)
        r["pin_fixed"] = {"budget": budget, "status": g.status_code}
        ok = g.status_code == 200 and g.json().get("output_ids") == chain(perm, p, 24)
    b = gen(9999)
    jb = b.json() if b.headers.get("content-type", "").startswith("application/json") else {}
    frb = (jb.get("meta_info") or {}).get("finish_reason") or {}
    r["pin_bad"] = {"status": b.status_code, "finish": frb, "body": b.text[:200]}
    refused = b.status_code >= 400 or (frb.get("type") == "abort" and "ddtree_budget" in json.dumps(frb))
    d = requests.post(base + "/generate", json={"input_ids": p, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=120).json()
    r["budget_pin_ok"] = bool(ok and refused and d.get("output_ids") == chain(perm, p, 40))
    return r


def extra_checks(base, perm, serves_logprobs, num_draft=None):
    """Concurrency with mid-flight joins, abort, streaming, bad input; ``return_logprob``: a DDTREE
    server serves it (sglang_ddtree/logprobs.py, on by default), a DFLASH one refuses it."""
    import threading
    r = {}
    prompts = [[1] + [(13 * i + 7 * j) % 1000 + 3 for j in range(1 + 3 * i)] for i in range(16)]
    lens = [8 + 11 * i for i in range(16)]
    outs = [None] * 16

    def one(i):
        time.sleep(0.02 * i)  # staggered: later requests join a batch already decoding
        try:
            d = requests.post(base + "/generate", json={"input_ids": prompts[i], "sampling_params": {
                "max_new_tokens": lens[i], "temperature": 0, "ignore_eos": True}}, timeout=300).json()
            outs[i] = d.get("output_ids")
        except Exception as e:  # noqa
            outs[i] = repr(e)
    th = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    [t.start() for t in th]
    [t.join() for t in th]
    exp = [chain(perm, p, n) for p, n in zip(prompts, lens)]
    r["concurrent_match"] = outs == exp
    if outs != exp:
        r["concurrent_mismatch"] = [i for i in range(16) if outs[i] != exp[i]]
    # abort a long request mid-flight
    res = {}

    def long_req():
        try:
            res["d"] = requests.post(base + "/generate", json={"rid": "ddtree-abort-me", "input_ids": [1, 5, 6],
                                     "sampling_params": {"max_new_tokens": 1900, "temperature": 0,
                                                         "ignore_eos": True}}, timeout=300).json()
        except Exception as e:  # noqa
            res["d"] = {"error": repr(e)}
    t = threading.Thread(target=long_req)
    t.start()
    time.sleep(0.4)
    a = requests.post(base + "/abort_request", json={"rid": "ddtree-abort-me"}, timeout=30)
    t.join(120)
    d = res.get("d", {})
    fr = (d.get("meta_info") or {}).get("finish_reason") or {}
    r["abort_status"] = a.status_code
    r["abort_finish"] = fr
    n_out = len(d.get("output_ids") or [])
    r["abort_ok"] = a.status_code == 200 and fr.get("type") == "abort" and n_out < 1900
    r["abort_prefix_exact"] = (d.get("output_ids") or []) == chain(perm, [1, 5, 6], n_out)
    r["abort_ok"] = r["abort_ok"] and r["abort_prefix_exact"]
    p = [1, 77, 78]
    d = requests.post(base + "/generate", json={"input_ids": p, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=120).json()
    r["after_abort_match"] = d.get("output_ids") == chain(perm, p, 40)
    # streaming
    toks = []
    with requests.post(base + "/generate", json={"input_ids": p, "stream": True, "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=120, stream=True) as s:
        last = None
        for line in s.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                last = json.loads(line[5:])
        toks = (last or {}).get("output_ids") or []
    r["stream_match"] = toks == chain(perm, p, 40)
    # bad input
    b1 = requests.post(base + "/generate", json={"input_ids": p, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0}}, timeout=60)
    j1 = b1.json() if b1.headers.get("content-type", "").startswith("application/json") else {}
    fr1 = (j1.get("meta_info") or {}).get("finish_reason") or {}
    r["bad_logprob"] = {"status": b1.status_code, "finish": fr1, "body": b1.text[:200]}
    r["bad_logprob_rejected"] = b1.status_code >= 400 or fr1.get("type") == "abort"
    lps = (j1.get("meta_info") or {}).get("output_token_logprobs") or []
    r["logprob_served"] = (b1.status_code == 200 and j1.get("output_ids") == chain(perm, p, 8) and len(lps) == 8
                           and all(t[0] is not None and t[0] <= 0 and t[1] == i for t, i in zip(lps, j1["output_ids"])))
    r["logprob_handled"] = r["logprob_served"] if serves_logprobs else r["bad_logprob_rejected"]
    b2 = requests.post(base + "/generate", json={"input_ids": p, "sampling_params": {
        "max_new_tokens": 8, "temperature": -1}}, timeout=60)
    r["bad_temperature"] = {"status": b2.status_code, "body": b2.text[:200]}
    r["bad_temperature_rejected"] = 400 <= b2.status_code < 500
    d = requests.post(base + "/generate", json={"input_ids": p, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}, timeout=120).json()
    r["healthy_after_bad_input"] = d.get("output_ids") == chain(perm, p, 40)
    r["budget_pin_ok"] = True
    if serves_logprobs:   # a DDTREE server: custom_params.ddtree_budget (sglang_ddtree/policy/adaptive.py)
        r.update(pin_checks(base, perm, p, num_draft))
    print("extra checks", json.dumps({k: r.get(k) for k in EXTRA_KEYS}), flush=True)
    return r


DDTREE_SERIES = ("sglang:ddtree_request_rounds_total", "sglang:ddtree_accepted_tokens_total",
                 "sglang:ddtree_chosen_budget_count", "sglang:ddtree_stage_ms_count", "sglang:ddtree_round_ms_count",
                 "sglang:ddtree_tree_depth_sum_total", "sglang:ddtree_counterfactual_accepted_tokens_total")


def metric_values(text, name):
    """Sum of every sample of ``name`` (any labels) in a Prometheus text exposition, or None."""
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(vals) if vals else None


def scrape_metrics(base, algo):
    """/metrics of a server started with --enable-metrics, after the traffic above (> 64 rounds, so at
    least one window of the plugin's device counters has been published): the plugin's series are
    there for a DDTREE server, the round counts agree, and SGLang's own metrics are there too."""
    time.sleep(3)  # the next window's readback needs a few more rounds: send some
    for _ in range(3):
        requests.post(base + "/generate", json={"input_ids": [1, 5, 17, 300], "sampling_params": {
            "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}, timeout=60)
    r = requests.get(base + "/metrics", timeout=30)
    out = {"metrics_status": r.status_code}
    text = r.text if r.status_code == 200 else ""
    got = {n: metric_values(text, n) for n in DDTREE_SERIES}
    out["metrics_values"] = got
    out["metrics_sglang_present"] = "sglang:" in text.replace("sglang:ddtree_", "")
    if algo in ("ddtree", "ddtreecpu"):
        rounds, chosen = got["sglang:ddtree_request_rounds_total"], got["sglang:ddtree_chosen_budget_count"]
        out["metrics_ok"] = (r.status_code == 200 and all(v is not None for v in got.values())
                             and rounds > 0 and chosen > 0 and got["sglang:ddtree_accepted_tokens_total"] >= 0)
    else:  # DFLASH: the plugin exports nothing of its own there
        out["metrics_ok"] = r.status_code == 200 and out["metrics_sglang_present"]
    print("metrics", json.dumps(out), flush=True)
    return out


base, limit, pid, perm_path, stage, results = sys.argv[1:7]
limit, pid = float(limit), int(pid)
_parts = stage.split("_")
rec = {"stage": stage, "ok": False, "pair": _parts[1], "algo": _parts[2] if len(_parts) > 2 else "dflash",
       "mode": "http"}
t0 = time.time()
up = False
while time.time() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        rec["error"] = "server process exited"
        break
    try:
        if requests.get(base + "/health_generate", timeout=3).status_code == 200:
            up = True
            break
    except Exception:
        pass
    time.sleep(1)
rec["up"] = up
rec["server_up_s"] = round(time.time() - t0, 1)
print(f"http: up={up} after {rec['server_up_s']}s", flush=True)
if up:
    try:
        perm = json.load(open(perm_path))
        prompt = [1, 5, 17, 300, 42, 7, 99, 123]
        t, exp = prompt[-1], []
        for _ in range(48):
            t = perm[t]
            exp.append(t)
        t1 = time.time()
        r = requests.post(base + "/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}, timeout=120)
        rec["generate_ids_status"] = r.status_code
        rec["generate_ids_s"] = round(time.time() - t1, 2)
        d = r.json()
        out_ids = d.get("output_ids")
        mi = d.get("meta_info", {})
        rec["generate_ids_match"] = out_ids == exp if out_ids is not None else None
        rec["generate_meta"] = {k: mi.get(k) for k in ("completion_tokens", "spec_verify_ct", "finish_reason")}
        if mi.get("spec_verify_ct"):
            rec["accept_len"] = round(mi["completion_tokens"] / mi["spec_verify_ct"], 3)
        print("generate(ids)", r.status_code, json.dumps(rec["generate_meta"]), "match", rec["generate_ids_match"], flush=True)
        r = requests.post(base + "/generate", json={"text": "the quick brown fox", "sampling_params": {
            "max_new_tokens": 16, "temperature": 0}}, timeout=120)
        rec["generate_text_status"] = r.status_code
        rec["generate_text"] = r.json().get("text", "")[:200] if r.status_code == 200 else r.text[:300]
        print("generate(text)", r.status_code, repr(rec["generate_text"][:120]), flush=True)
        r = requests.post(base + "/v1/completions", json={"model": "default", "prompt": "speculative decoding drafts",
                                                          "max_tokens": 12, "temperature": 0}, timeout=120)
        rec["completions_status"] = r.status_code
        j = r.json() if r.status_code == 200 else {}
        rec["completions_text"] = (j.get("choices") or [{}])[0].get("text", "")[:200] if j else r.text[:300]
        rec["completions_usage"] = j.get("usage")
        print("v1/completions", r.status_code, repr(rec["completions_text"][:120]), j.get("usage"), flush=True)
        try:
            si = requests.get(base + "/server_info", timeout=10).json()
            rec["server_info"] = {k: si.get(k) for k in ("speculative_algorithm", "speculative_num_draft_tokens",
                                                         "attention_backend", "version", "model_path")}
        except Exception as e:  # noqa
            rec["server_info_error"] = repr(e)
        rec.update(extra_checks(base, perm, rec["algo"] in ("ddtree", "ddtreecpu"),
                                (rec.get("server_info") or {}).get("speculative_num_draft_tokens")))
        if stage.endswith("_metrics"):
            rec.update(scrape_metrics(base, rec["algo"]))
        rec["ok"] = (rec["generate_ids_status"] == 200 and rec["generate_ids_match"] is not False
                     and rec["generate_text_status"] == 200 and rec["completions_status"] == 200
                     and all(rec.get(k) for k in EXTRA_KEYS) and rec.get("metrics_ok", True))
    except Exception as e:  # noqa
        rec["error"] = repr(e)[:1000]
with open(results, "a") as f:
    f.write(json.dumps(rec) + "\n")
print("STAGE_RESULT", json.dumps(rec), flush=True)
sys.exit(0 if rec["ok"] else 1)
