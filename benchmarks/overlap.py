"""Overlap benchmark: eager DDP, torch.compile's DDP paths and distcompile on one link, in one run.

    python benchmarks/overlap.py                   # loopback
    python benchmarks/overlap.py --link 1gbit      # real shaped link (root: namespaces + tc tbf)
    python benchmarks/overlap.py --link 200mbit --variants ddp,ddp_fp16,dc_inductor,dc_inductor_bf16

Same as `distcompile bench`. Prints a table and writes JSON and a dated markdown report
to benchmarks/results/. See distcompile/tools/bench/ for what is measured and how.
"""

import sys

from distcompile.tools.bench.parent import main

if __name__ == "__main__":
    sys.exit(main())
