"""Shared by the report checks (tests/reports/): where a check reads the committed files, how it runs a
bench/ renderer, and the corruptions that show each check can fail.

A check is a function ``check(root, tmp)`` that reads the committed results under ``root`` (the
checkout, or a copy of just the files it names) and raises AssertionError when a report does not
match its records.  ``@reads(...)`` names those files (paths relative to the checkout; a raw record
may be stored plain or gzipped, ``resolve`` finds either), so ``copy_inputs`` can lay them out in a
temporary tree, a corruption can change one record there, and the same check must then fail.  The
code that renders (bench/*.py, sglang_ddtree.ab.report) and the text pair's weights are always the
checkout's."""
import gzip
import json
import os
import shutil
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
RES = "bench/results"
RAW = "bench/results/raw"


class RendererFailed(Exception):
    """A bench/ renderer exited non-zero: not a check failure (a corruption must leave the inputs valid)."""


def resolve(root, rel):
    """The stored path of ``rel`` under ``root``: as named, or its gzipped / plain twin (the raw
    records are committed gzipped or plain; bench/rawio.py reads both)."""
    p = os.path.join(root, rel)
    if os.path.exists(p):
        return p
    twin = p[:-3] if p.endswith(".gz") else p + ".gz"
    return twin if os.path.exists(twin) else p


def reads(*rels):
    """Declare the committed files a check reads (relative to the checkout)."""
    def mark(fn):
        fn.reads = rels
        return fn
    return mark


def copy_inputs(dst, rels):
    """Copy the named files (as stored: plain or gzipped) from the checkout to ``dst`` (same layout)."""
    for rel in rels:
        src = resolve(REPO, rel)
        out = os.path.join(str(dst), os.path.relpath(src, REPO))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        shutil.copy(src, out)
    return str(dst)


def run_script(args, cwd=None, timeout=300):
    """Run a bench/ script with this interpreter; its stdout, or RendererFailed."""
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if r.returncode != 0:
        raise RendererFailed(r.stderr[-2000:])
    return r.stdout


def _open(path, mode):
    return gzip.open(path, mode) if path.endswith(".gz") else open(path, mode)


def edit_json(root, rel, fn):
    """Apply ``fn(doc)`` (in place) to the JSON document ``rel`` under ``root`` (plain or gzipped)."""
    p = resolve(root, rel)
    with _open(p, "rt") as f:
        doc = json.load(f)
    fn(doc)
    with _open(p, "wt") as f:
        json.dump(doc, f)


def edit_records(root, rel, fn):
    """Apply ``fn(records)`` (a list of dicts, in place) to the JSON-lines file ``rel`` under ``root``."""
    p = resolve(root, rel)
    with _open(p, "rt") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    fn(recs)
    with _open(p, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


def edit_text(root, rel, old, new):
    """Replace the one occurrence of ``old`` in the text file ``rel`` under ``root``."""
    p = resolve(root, rel)
    s = open(p).read()
    assert s.count(old) == 1, (rel, old, s.count(old))
    open(p, "w").write(s.replace(old, new))


# ------------------------------------------------------------------------------------------ corruptions
# Each returns fn(root) that changes one committed fact in the copy under root, keeping it well formed.

def stage_left_the_chain(rel, stage=None):
    """A worker stage's bs16 outputs no longer equal the reference (``matches_target_greedy`` False):
    the first toy stage that matched, or ``stage``."""
    def corrupt(root):
        def fn(recs):
            r = next(r for r in recs if (r["stage"] == stage if stage else
                                         (not r["stage"].startswith(("text_", "http_"))
                                          and r.get("matches_target_greedy") is True)))
            r["matches_target_greedy"] = False
        edit_records(root, rel, fn)
    return corrupt


def set_json(rel, keys, value):
    """doc[k0][k1]... = value in the JSON document rel."""
    def corrupt(root):
        def fn(doc):
            d = doc
            for k in keys[:-1]:
                d = d[k]
            assert keys[-1] in d, keys
            d[keys[-1]] = value
        edit_json(root, rel, fn)
    return corrupt


def replace_text(rel, old, new):
    return lambda root: edit_text(root, rel, old, new)


def copy_over(src_rel, dst_rel):
    """The file dst_rel replaced by src_rel (e.g. a later run's report by the earlier one's)."""
    return lambda root: shutil.copy(resolve(root, src_rel), resolve(root, dst_rel))


def assert_fails_on_a_corrupted_copy(check, corrupt, tmp, faithful=True):
    """Run ``check`` on a copy of just the files it declares (``faithful``: it must pass there), then
    ``corrupt`` the copy: the check must now raise AssertionError (a crash of the renderer, or a file
    the check did not declare, is an error of this control instead)."""
    import pytest

    root = copy_inputs(os.path.join(str(tmp), "copy"), check.reads)
    if faithful:
        check(root, tmp)
    corrupt(root)
    with pytest.raises(AssertionError):
        check(root, tmp)
