"""``python -m benchmarks.chaos`` from a checkout: the same as ``python benchmarks/run_chaos.py``."""

import sys

from .run import main

sys.exit(main())
