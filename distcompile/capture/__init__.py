"""Capture: reading what TorchDynamo captured.

Owns turning a captured ``fx.GraphModule`` into the planner's input (``graph.py``: the
forward nodes, the parameters each one reads, their order), counting each node's work
(``flops.py``), and TorchDynamo's graph-break reasons (``breaks.py``). May import
``planning`` and the top-level leaves; never ``compile``, ``runtime``, ``telemetry``.
"""
