"""Shared test setup: run the Triton kernels on CUDA when present, else under the interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (Triton decides at
decoration time), so it is set here, at collection start.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# NumPy >= 2.4 raises where 2.3 only warns when a one-element array is used as a Python int (the
# Triton interpreter hands kernels such arrays, e.g. as loop bounds): make it an error here and in
# every subprocess the tests start, so this machine fails the way a newer NumPy would.
NUMPY_SCALAR_FILTER = "error:Conversion of an array with ndim:DeprecationWarning"
os.environ["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), NUMPY_SCALAR_FILTER) if w)


def pytest_report_header(config):
    return f"sglang-ddtree tests on {DEVICE} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the OS: inputs differ on every run.

    The seed is printed so a failure can be replayed with DDTREE_TEST_SEED=<seed>.
    """
    seed = int(os.environ.get("DDTREE_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    print(f"DDTREE_TEST_SEED={seed}")
    g = torch.Generator().manual_seed(seed)
    return g


@pytest.fixture
def one_torch_thread():
    """Tiny CPU forwards on one torch thread (two threads on a shared 2-core machine run them up to
    200x slower); a module opts in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
