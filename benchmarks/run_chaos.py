"""The chaos run: faults injected into a real multi-node job of the example GPT, counted.

Run from a checkout (it drives ``launchers/`` and ``examples/``), as root, with iproute2
(and nftables for packet loss): ``python benchmarks/run_chaos.py --faults 20 --seed 0``;
``-h`` lists the options. The harness is ``benchmarks/chaos/`` (Note [Chaos run]).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.chaos.run import main  # noqa: E402 - after the checkout is on the path

if __name__ == "__main__":
    sys.exit(main())
