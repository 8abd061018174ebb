"""Capture: reading what TorchDynamo captured.

Turns a captured ``fx.GraphModule`` into the planner's input, and prepares the model so
that TorchDynamo traces it fast and right. May import ``planning`` and the top-level
leaves; never ``compile``, ``runtime``, ``telemetry``.

- ``graph.py``: the forward nodes, the parameters each reads, their order; data-dependent spans.
- ``flops.py``: each node's forward FLOPs, on fake copies of its inputs.
- ``timing.py``: each node's backward timed on random tensors of its shapes (``bucket_cap_mb="auto"``).
- ``breaks.py``: graph-break reasons, with the user's code line.
- ``guards.py``: failed guards of a recompile, condensed for a person to read.
- ``blocks.py``: the repeated blocks of a captured graph (the layers of a transformer).
- ``regions.py``: repeated blocks traced once as nested compile regions, inlined back.
- ``block_likeness.py``: which blocks are alike enough to share a region.
"""
