"""``patches/req_update_finish_state.py``: when one speculative round both reaches max_new_tokens and
holds a stop string / stop token before that limit, the request stops where plain decoding (one
token per step) stops.  Checked on SGLang 0.5.16's real ``Req`` (CPU) against a one-token-per-step
replay of the same output, on random stop placements drawn fresh each run."""
import random
import types
from array import array

import pytest

pytest.importorskip("sglang.srt.managers.schedule_batch")

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_ddtree.patches import req_update_finish_state as P  # noqa: E402

import inspect  # noqa: E402



def _sglang_original():
    """SGLang's own method, also when load_plugins() hooked it in this process (before or after this
    module was imported: another test module may load the plugins): the function at the end of the
    ``__wrapped__`` chain, checked to be defined in SGLang's schedule_batch.py."""
    fn = inspect.unwrap(Req.update_finish_state)
    assert fn.__code__.co_filename.endswith("schedule_batch.py"), fn.__code__.co_filename
    return fn


def ORIGINAL(req, n):
    return _sglang_original()(req, n)


class _Tok:
    """token t decodes to the letter chr(97 + t % 26); eos is 0."""
    eos_token_id = 0
    additional_stop_token_ids = None

    def decode(self, ids, *a, **k):
        return "".join(chr(97 + t % 26) for t in ids)

    def encode(self, text, *a, **k):
        return [ord(c) - 97 for c in text]


def _req(max_new, stop=None, stop_ids=None):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop=stop, stop_token_ids=stop_ids,
                        ignore_eos=False)
    sp.normalize(_Tok())
    r = Req("r", "", array("q", [1, 2, 3]), sp)
    r.tokenizer = _Tok()
    r.vocab_size = 26
    return r


def _finish(req, blocks, hooked):
    """Append token blocks (a speculative round each) and update the finish state after each."""
    for blk in blocks:
        if req.finished():
            break
        req.output_ids.extend(blk)
        if hooked:
            P.update_finish_state_stop_first(_sglang_original(), req, len(blk))
        else:
            ORIGINAL(req, len(blk))
    return req


def _plain(max_new, tokens, **kw):
    return _finish(_req(max_new, **kw), [[t] for t in tokens], hooked=False)


def _out(req):
    ids = req.output_ids[: req.finished_len] if req.finished_len is not None else req.output_ids
    return list(ids), type(req.finished_reason).__name__


@pytest.fixture(autouse=True)
def _ddtree_on(monkeypatch):
    monkeypatch.setattr(P, "_ddtree_server", lambda: True)


def test_the_soak_case():
    # max_new_tokens 6; the stop string "ef" is complete at token 5; the last round commits tokens 5-6
    toks = [1, 2, 3, 4, 5, 11]
    plain = _plain(6, toks, stop=["ef"])
    assert _out(plain) == ([1, 2, 3, 4, 5], "FINISH_MATCHED_STR")
    stock = _finish(_req(6, stop=["ef"]), [toks[:4], toks[4:]], hooked=False)
    assert _out(stock)[1] == "FINISH_LENGTH" and len(_out(stock)[0]) == 6     # SGLang's order
    hooked = _finish(_req(6, stop=["ef"]), [toks[:4], toks[4:]], hooked=True)
    assert _out(hooked) == _out(plain)


def test_random_blocks_equal_one_token_per_step():
    rng = random.Random()
    for _ in range(300):
        max_new = rng.randint(2, 20)
        toks = [rng.randint(1, 25) for _ in range(max_new + 8)]
        kind = rng.choice(["str", "ids", "eos", "none"])
        kw = {}
        if kind == "str":
            at = rng.randint(0, len(toks) - 2)
            kw["stop"] = [_Tok().decode(toks[at:at + rng.randint(1, 2)])]
        elif kind == "ids":
            kw["stop_ids"] = [rng.choice(toks)]
        elif kind == "eos":
            toks[rng.randint(0, len(toks) - 1)] = 0
        blocks, i = [], 0
        while i < len(toks):
            n = rng.randint(1, 8)
            blocks.append(toks[i:i + n])
            i += n
        want = _out(_plain(max_new, toks, **kw))
        got = _out(_finish(_req(max_new, **kw), blocks, hooked=True))
        assert got == want, (max_new, toks, kw, blocks)


def test_other_algorithms_keep_sglang_order(monkeypatch):
    monkeypatch.setattr(P, "_ddtree_server", lambda: False)
    toks = [1, 2, 3, 4, 5, 11]
    r = _finish(_req(6, stop=["ef"]), [toks[:4], toks[4:]], hooked=True)
    assert _out(r)[1] == "FINISH_LENGTH"
