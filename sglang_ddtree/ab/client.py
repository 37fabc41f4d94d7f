"""The load client: plain HTTP JSON calls, one streaming /generate (timed per chunk), the request
payload, one concurrency level (at most c requests in flight) and its progress bar."""
from __future__ import annotations

import http.client
import json
import re
import sys
import threading
import time
import urllib.parse
from typing import List, Optional

RE_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')


# ------------------------------------------------------------------------------------------ HTTP
def _conn(base_url: str, timeout: float):
    u = urllib.parse.urlparse(base_url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def http_json(base_url: str, method: str, path: str, body=None, timeout: float = 10.0):
    c = _conn(base_url, timeout)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        return r.status, data
    finally:
        c.close()


def iter_sse_data(response):
    """The ``data:`` payloads (bytes) of an SSE response, until ``data: [DONE]`` or the end."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield data


def stream_generate(base_url: str, payload: dict, timeout: float = 600.0) -> dict:
    """One streaming /generate.  SGLang 0.5.16 streams SSE lines ``data: {json}`` (output_ids are
    cumulative by default, deltas with --incremental-streaming-output; meta_info.completion_tokens is
    cumulative either way) and ends with ``data: [DONE]``.  Chunks are timed on arrival; only the
    token count is pulled out per chunk (a regex), the last chunk is parsed in full."""
    res = dict(ok=False, ttft=None, itl=[], latency=None, n_chunks=0, output_ids=None, meta={}, error=None)
    body = dict(payload, stream=True)
    t0 = time.perf_counter()
    chunks = []
    c = _conn(base_url, timeout)
    try:
        c.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:300].decode('utf-8', 'replace')}"
            return res
        prev_n, t_prev = 0, None
        for data in iter_sse_data(r):
            t = time.perf_counter()
            chunks.append(data)
            m = RE_COMPLETION.search(data)
            if m is None:
                if b'"error"' in data[:20]:
                    res["error"] = data[:300].decode("utf-8", "replace")
                continue
            n = int(m.group(1))
            new = n - prev_n
            if new <= 0:
                continue
            if t_prev is None:
                res["ttft"] = t - t0
            else:
                res["itl"].extend([(t - t_prev) / new] * new)
            t_prev, prev_n = t, n
            res["n_chunks"] += 1
        res["latency"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - recorded per request
        res["error"] = repr(e)[:300]
        return res
    finally:
        c.close()
    if res["error"] or not chunks:
        res["error"] = res["error"] or "empty stream"
        return res
    last = json.loads(chunks[-1])
    if "error" in last:
        res["error"] = json.dumps(last["error"])[:300]
        return res
    meta = last.get("meta_info") or {}
    ids = last.get("output_ids")
    ct = meta.get("completion_tokens")
    if ids is not None and ct is not None and len(ids) != ct:  # incremental streaming: deltas
        ids = []
        for d in chunks:
            ids.extend(json.loads(d).get("output_ids") or [])
    res["output_ids"] = ids
    res["meta"] = {k: meta.get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "spec_verify_ct",
                                            "spec_accept_length", "spec_num_correct_drafts")
                   if meta.get(k) is not None}
    fr = meta.get("finish_reason")
    res["meta"]["finish_reason"] = fr.get("type") if isinstance(fr, dict) else fr
    res["ok"] = True
    return res


def request_payload(prompt: dict, max_new_tokens: int) -> dict:
    """``max_new_tokens`` scaled by the prompt's ``new_tokens_scale`` (``prompts.spread_new_tokens``),
    at least 1; the prompt's ``custom_params`` (a pinned arm's budget) go into the sampling params."""
    n = max(1, int(round(int(max_new_tokens) * float(prompt.get("new_tokens_scale", 1.0)))))
    p = {"sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}
    if prompt.get("custom_params"):
        p["sampling_params"]["custom_params"] = dict(prompt["custom_params"])
    if "input_ids" in prompt:
        p["input_ids"] = prompt["input_ids"]
    else:
        p["text"] = prompt["text"]
    return p


def run_level(base_url: str, prompts: List[dict], c: int, max_new_tokens: int, deadline_at: Optional[float],
              desc: str = "", progress: bool = True, timeout: float = 600.0):
    """Send prompts with at most c in flight; returns (results in prompt order, wall seconds, partial)."""
    results: List[Optional[dict]] = [None] * len(prompts)
    bar = _bar(len(prompts), desc, progress)
    stop = threading.Event()
    lock = threading.Lock()
    nxt = [0]
    t0 = time.perf_counter()
    t_end = [t0]

    def worker():
        while not stop.is_set():
            with lock:
                i = nxt[0]
                if i >= len(prompts):
                    return
                if deadline_at is not None and time.time() > deadline_at:
                    stop.set()
                    return
                nxt[0] += 1
            r = stream_generate(base_url, request_payload(prompts[i], max_new_tokens), timeout)
            results[i] = r
            with lock:
                t_end[0] = max(t_end[0], time.perf_counter())
            bar.update(1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(c, len(prompts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    partial = any(r is None for r in results)
    return results, t_end[0] - t0, partial


class _PrintBar:
    def __init__(self, total, desc):
        self.total, self.desc, self.n, self.t = total, desc, 0, time.time()
        self.lock = threading.Lock()

    def update(self, k=1):
        with self.lock:
            self.n += k
            if time.time() - self.t > 10 or self.n == self.total:
                self.t = time.time()
                print(f"  {self.desc}: {self.n}/{self.total}", flush=True)

    def close(self):
        pass


class _NoBar:
    def update(self, k=1):
        pass

    def close(self):
        pass


def _bar(total, desc, progress):
    if not progress:
        return _NoBar()
    try:
        from tqdm import tqdm
        tty = sys.stderr.isatty()
        return tqdm(total=total, desc=desc, leave=False, mininterval=0.5 if tty else 15, file=sys.stderr,
                    dynamic_ncols=tty, ncols=None if tty else 100)
    except ImportError:
        return _PrintBar(total, desc)

