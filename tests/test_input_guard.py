"""The input-id guard (``patches/validate_input_ids.py``): token ids outside ``[0, vocab)`` and
non-integer ids are rejected with a ValueError (SGLang answers it with HTTP 400) before a request
reaches the scheduler; valid requests pass untouched.  Checked on the hooked function itself and on
SGLang 0.5.16's real ``TokenizerManager._validate_one_request`` after ``load_plugins()`` in a fresh
process (the GPU host's soak and bad-id probe check the server end to end)."""
import json
import os
import random
import subprocess
import sys
import types

import pytest

from helpers import env_without_checkout
from sglang_ddtree.patches.validate_input_ids import (TARGET, check_input_ids,
                                                      validate_one_request_with_vocab)


def test_valid_ids_pass_and_bad_ids_raise_with_the_position():
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    V = rng.randint(2, 200_000)
    good = [rng.randrange(V) for _ in range(rng.randint(1, 3000))] + [0, V - 1]
    check_input_ids(good, V)
    check_input_ids([], V)
    check_input_ids(None, V)
    for bad_val in (V, V + 1, 10 ** 12, -1, -(10 ** 9)):
        ids = list(good)
        pos = rng.randrange(len(ids) + 1)
        ids.insert(pos, bad_val)
        with pytest.raises(ValueError, match=rf"input_ids\[{pos}\] = {bad_val} is outside the vocabulary"):
            check_input_ids(ids, V)
    for junk in ("7", 1.5, None, True, [3]):
        with pytest.raises(ValueError, match="input_ids must be integers"):
            check_input_ids(good[:5] + [junk], V)


def test_the_hook_checks_then_calls_the_original():
    calls = []

    def original(self, obj, input_ids):
        calls.append(input_ids)
        return "validated"

    tm = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=100), is_generation=True)
    assert validate_one_request_with_vocab(original, tm, object(), [1, 2, 99]) == "validated"
    with pytest.raises(ValueError):
        validate_one_request_with_vocab(original, tm, object(), [1, 100])
    assert calls == [[1, 2, 99]]           # the bad request never reached the original
    emb = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=100), is_generation=False)
    assert validate_one_request_with_vocab(original, emb, object(), [1, 100]) == "validated"


HOOKED = r'''
import json, types
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.io_struct import GenerateReqInput
tm = TokenizerManager.__new__(TokenizerManager)   # the real method on a bare instance
tm.model_config = types.SimpleNamespace(vocab_size=1000, is_matryoshka=False)
tm.context_len, tm.num_reserved_tokens, tm.allow_auto_truncate = 4096, 0, False
tm.validate_total_tokens, tm.is_generation = True, True
tm.server_args = types.SimpleNamespace(limit_mm_data_per_request=None, enable_return_hidden_states=False,
                                       enable_custom_logit_processor=False)
out = {"patched": TARGET in HookRegistry._patched}
obj = GenerateReqInput(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
for name, ids in (("good", [1, 2, 999]), ("vocab", [1, 1000]), ("negative", [-1, 5])):
    try:
        tm._validate_one_request(obj, ids)
        out[name] = "ok"
    except ValueError as e:
        out[name] = "ValueError: " + str(e)
print("RESULT" + json.dumps(out))
'''


def test_real_tokenizer_manager_rejects_out_of_vocab_ids_after_load_plugins():
    pytest.importorskip("sglang.srt.plugins")
    e = env_without_checkout()
    r = subprocess.run([sys.executable, "-c", f"TARGET = {TARGET!r}\n" + HOOKED], cwd="/", env=e,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert out["patched"]
    assert out["good"] == "ok"
    assert out["vocab"].startswith("ValueError: input_ids[1] = 1000 is outside the vocabulary")
    assert out["negative"].startswith("ValueError: input_ids[0] = -1 is outside the vocabulary")
