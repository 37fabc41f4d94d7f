"""The A/B plot, from a checkout: ``python bench/ab_plot.py OUT.json [PNG]``.

A thin wrapper of the package's :mod:`sglang_ddtree.ab.plot` (``python -m sglang_ddtree.ab.plot``
where the package is installed).
"""
import sys

from sglang_ddtree.ab.plot import *  # noqa: F401,F403
from sglang_ddtree.ab.plot import main, plot  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
