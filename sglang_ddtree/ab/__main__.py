"""``python -m sglang_ddtree.ab``: the same command as the installed ``sglang-ddtree-ab``."""
import sys

from .cli import main

sys.exit(main())
