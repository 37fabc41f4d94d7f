"""bench/device/fi_aot.py: a carried flashinfer module (its ``.so`` alone, as the device cache holds
it) is loaded by flashinfer's own ``JitSpec.build_and_load`` without a build once linked, and is
rebuilt without the link (the control: ninja would rebuild a ``.so`` whose objects are missing)."""
import contextlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "device"))
import fi_aot  # noqa: E402

core = pytest.importorskip("flashinfer.jit.core")
NAME = "batch_prefill_with_kv_cache_dtype_q_bf16_head_dim_qk_128"


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    jit, aot = tmp_path / "fi" / "0.6.14" / "90a" / "cached_ops", tmp_path / "site" / "flashinfer" / "data" / "aot"
    (jit / NAME).mkdir(parents=True)
    (jit / NAME / f"{NAME}.so").write_bytes(b"carried")
    (jit / "odd").mkdir()
    (jit / "odd" / "other.so").write_bytes(b"not the module's own name")
    monkeypatch.setattr(core.jit_env, "FLASHINFER_JIT_DIR", jit)
    monkeypatch.setattr(core.jit_env, "FLASHINFER_AOT_DIR", aot)
    calls = []
    monkeypatch.setattr(core.JitSpec, "build", lambda self, verbose, need_lock=True: calls.append(("build", self.name)))
    monkeypatch.setattr(core.JitSpec, "load", lambda self, so_path: calls.append(("load", str(so_path))) or "module")
    monkeypatch.setattr(core, "FileLock", lambda *a, **k: contextlib.nullcontext())
    return jit, aot, calls


def spec(name=NAME):
    return core.JitSpec(name=name, sources=[], extra_cflags=None, extra_cuda_cflags=None, extra_ldflags=None,
                        extra_include_dirs=None)


def test_a_linked_module_loads_without_a_build(dirs):
    jit, aot, calls = dirs
    assert fi_aot.link_carried_modules(jit, aot) == [NAME]
    assert spec().build_and_load() == "module"
    assert calls == [("load", str(aot / NAME / f"{NAME}.so"))]
    assert (aot / NAME / f"{NAME}.so").read_bytes() == b"carried"
    assert not (aot / "odd").exists()                                # only <name>/<name>.so


def test_without_the_link_flashinfer_builds(dirs):
    jit, aot, calls = dirs
    spec().build_and_load()
    assert calls[0] == ("build", NAME)


def test_an_existing_aot_module_and_a_second_run_are_left_alone(dirs):
    jit, aot, calls = dirs
    (aot / NAME).mkdir(parents=True)
    (aot / NAME / f"{NAME}.so").write_bytes(b"shipped")
    assert fi_aot.link_carried_modules(jit, aot) == []
    assert (aot / NAME / f"{NAME}.so").read_bytes() == b"shipped"
    other = "norm"
    (jit / other).mkdir()
    (jit / other / "norm.so").write_bytes(b"n")
    assert fi_aot.link_carried_modules(jit, aot) == [other]
    assert fi_aot.link_carried_modules(jit, aot) == []
