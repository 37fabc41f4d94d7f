"""The tracked tree must fit the GPU device call's carry (issue 40 item 1).

A device call carries at most 64 MiB (67.1 MB): the tracked tree, plus the SGLang kit (``.kit/``,
43 MB, git-ignored) and the JIT caches (~6 MB).  Keeping 7 MB of that free leaves the tracked tree
at most 18 MB (``TREE_BOUND``), counted as the on-disk sizes of the files ``git ls-files`` lists.
Skipped outside a git checkout (an installed wheel, an sdist).

The bound is not met yet: after the raw records were pruned and gzipped the tree is ~32 MB, ~17 MB
of it the four ``*.safetensors`` (bench/device/weights/drafter{,_b16}.safetensors, 5 MB each;
sglang_ddtree/data/textpair/{target,drafter}.safetensors, 5 + 1.8 MB), already stored in bf16, the
dtype they are served in.  Until that is resolved the bound test is an expected failure (strict: it
turns red the moment it passes, so the marker and ``GROWTH_BOUND`` go then), and the growth test
keeps the tree from growing past today's size plus 1 MB."""
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE_BOUND = 18_000_000     # 64 MiB device carry - 43 MB kit - ~6 MB JIT cache - 7 MB kept free
GROWTH_BOUND = 33_000_000   # today's ~31.9 MB + 1 MB: no growth while TREE_BOUND is not met


def tracked_bytes():
    """(total bytes on disk of the tracked files, [(bytes, path)] largest first); None outside a checkout."""
    try:
        r = subprocess.run(["git", "-C", REPO, "ls-files", "-z"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    sizes = []
    for p in r.stdout.decode("utf-8", "surrogateescape").split("\0"):
        f = os.path.join(REPO, p)
        if p and os.path.lexists(f) and not os.path.isdir(f):   # a deletion not yet committed: gone
            sizes.append((os.lstat(f).st_size, p))
    sizes.sort(reverse=True)
    return sum(s for s, _ in sizes), sizes


@pytest.fixture(scope="module")
def tree():
    t = tracked_bytes()
    if t is None:
        pytest.skip("not a git checkout")
    return t


def _why(total, sizes, bound):
    return f"tracked tree {total / 1e6:.1f} MB > {bound / 1e6:.0f} MB; largest: " + ", ".join(
        f"{p} {s / 1e6:.1f} MB" for s, p in sizes[:8])


@pytest.mark.xfail(strict=True, reason="~17 MB of bf16 safetensors keep the tree at ~32 MB (module docstring)")
def test_tracked_tree_fits_the_device_carry(tree):
    total, sizes = tree
    assert total <= TREE_BOUND, _why(total, sizes, TREE_BOUND)


def test_tracked_tree_does_not_grow(tree):
    total, sizes = tree
    assert total <= GROWTH_BOUND, _why(total, sizes, GROWTH_BOUND)
