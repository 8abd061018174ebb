"""``python -m distcompile.tools.chaos``: the same as ``distcompile bench --chaos``."""

import sys

from .run import main

sys.exit(main())
