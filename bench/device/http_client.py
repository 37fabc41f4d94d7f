"""HTTP stage client: wait for an SGLang server, then check /generate and /v1/completions.

usage: python bench/device/http_client.py BASE_URL LIMIT_S SERVER_PID PERM_JSON STAGE RESULTS_JSONL
/generate is sent token ids and must return exactly the toy target's greedy chain (perm^k); the text
form of /generate and /v1/completions must answer 200 with text.  One JSON record is appended to
RESULTS_JSONL; exit 0 only when everything passed.
"""
import json
import os
import sys
import time

import requests

base, limit, pid, perm_path, stage, results = sys.argv[1:7]
limit, pid = float(limit), int(pid)
rec = {"stage": stage, "ok": False, "pair": stage.split("_")[-1], "algo": "dflash", "mode": "http"}
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
        rec["ok"] = (rec["generate_ids_status"] == 200 and rec["generate_ids_match"] is not False
                     and rec["generate_text_status"] == 200 and rec["completions_status"] == 200)
    except Exception as e:  # noqa
        rec["error"] = repr(e)[:1000]
with open(results, "a") as f:
    f.write(json.dumps(rec) + "\n")
print("STAGE_RESULT", json.dumps(rec), flush=True)
sys.exit(0 if rec["ok"] else 1)
