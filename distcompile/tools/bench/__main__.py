"""``python -m distcompile.tools.bench``: the benchmark (the parent, or one rank with ``--worker``)."""

import sys

from .parent import main

sys.exit(main())
