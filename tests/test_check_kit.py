"""bench/device/check_kit.py's compiled-library comparison: a library the trim removed that the CPU
import maps is reported; Python-tag differences (3.11 venv vs the host's 3.12 / abi3 kit) are not."""
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("check_kit", os.path.join(HERE, "..", "bench", "device", "check_kit.py"))
check_kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_kit)


def _touch(root, rel):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()


def test_a_removed_library_the_import_maps_is_reported(tmp_path):
    site = str(tmp_path / "site")
    _touch(site, "tvm_ffi/core.abi3.so")
    _touch(site, "tvm_ffi/lib/libtvm_ffi.so")
    _touch(site, "zmq/backend/cython/_zmq.cpython-312-x86_64-linux-gnu.so")
    venv = "/venv/lib/python3.11/site-packages/"
    mapped = [venv + "tvm_ffi/core.cpython-311-x86_64-linux-gnu.so", venv + "tvm_ffi/lib/libtvm_ffi.so",
              venv + "tvm_ffi/lib/libtvm_ffi_testing.so", venv + "zmq/backend/cython/_zmq.cpython-311-x86_64-linux-gnu.so",
              venv + "torch/lib/libtorch.so",            # a package the kit does not hold: the host's own
              "/usr/lib/x86_64-linux-gnu/libc.so.6"]
    assert check_kit.missing_libs(site, mapped) == ["tvm_ffi/lib/libtvm_ffi_testing.so"]
    _touch(site, "tvm_ffi/lib/libtvm_ffi_testing.so")
    assert check_kit.missing_libs(site, mapped) == []
