"""A/B serving benchmark: one SGLang server per arm, the same greedy prompts at each concurrency.

    python bench/ab_serve.py --model-path T --draft-model-path D [options]     # measure
    python bench/ab_serve.py [--pair text|gqa|mla] [options]    # a test-bed pair (/tmp/models); default text
    python bench/ab_serve.py --report-only OUT.json              # rewrite OUT.md from a results JSON
    python bench/ab_serve.py --merge OUT a.json b.json           # one report (JSON + MD) from several runs

The code is the package ``sglang_ddtree.ab`` (its docstring states the arms, the measurement, the
identity check, the stage split and the outputs); the installed command ``sglang-ddtree-ab`` runs the
same CLI.  This file is the checkout's entry point and compatibility module: same arguments, same
output, ``--out`` defaults to bench/results/ab_h200, the package finds the checkout's files
(bench/textpair, bench/tree_kernels.py, git) in this checkout, and every name of the
package's modules is importable from here (``import ab_serve as AB``: bench/ab_divergence.py,
bench/soak.py, bench/text_divergence.py, the tests).  Setting a name here does not change the package:
replace ``sglang_ddtree.ab.<module>.<name>`` to change its behaviour.
"""
from __future__ import annotations

import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

try:  # installed: pip install [-e] ., a wheel, the GPU host's folder of symlinks
    import sglang_ddtree.ab  # noqa: F401
except ImportError:  # a bare checkout (e.g. another interpreter's stdlib for ab_divergence's prompts)
    # appended, not prepended: the checkout root's kernels/ must not shadow an installed `kernels`
    sys.path.append(REPO)
    for _k in [k for k in sys.modules if k == "sglang_ddtree" or k.startswith("sglang_ddtree.")]:
        del sys.modules[_k]
    import sglang_ddtree.ab  # noqa: F401

from sglang_ddtree.ab import (checkout as _checkout, cli as _cli, client, environment, merge as _merge,  # noqa: E402
                              prompts, report, runner, servers, stats, sweep)

_checkout.use(REPO)
DEFAULT_OUT = os.path.join(HERE, "results", "ab_h200")

# every name of the package's modules, as the single-file script had them
for _m in (servers, prompts, client, stats, environment, sweep, runner, report, _merge, _cli):
    for _k, _v in vars(_m).items():
        if not _k.startswith("__") and not isinstance(_v, types.ModuleType) and _k not in globals():
            globals()[_k] = _v
merge = _merge.merge
del _m, _k, _v


def build_parser():
    """The argument parser; ``--out`` defaults to bench/results/ab_h200."""
    return _cli.build_parser(default_out=DEFAULT_OUT)


def main(argv=None):
    return _cli.main(argv, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
