"""Compile: from one captured graph to compiled segments whose buckets the reducer knows.

May import ``capture``, ``planning`` and the leaves. It reaches the runtime and telemetry
only through the small interfaces it is given (``backend.BucketRegistry``,
``backend.CompileObserver``); it never imports them.

- ``backend.py``: the TorchDynamo backend, a numbered recipe of capture, plan, agreement,
  split, compile, register.
- ``ranks_together.py``: which compiles the ranks do together, and what must agree.
- ``pricing.py``: a graph's compute and wire costs for ``bucket_cap_mb="auto"``.
- ``segments.py``: splitting the graph at the planned boundaries, compiling each piece.
- ``reuse.py``: which pieces are interchangeable, so one compiled piece serves them all.
- ``jobs.py``: the distinct pieces to compile, and the seam to compile sharing (``SharedCompiles``,
  implemented in ``distcompile/fleet``: ``compile/`` compiles locally and knows no peers).
- ``cpu_checks.py``: Inductor's one-time CPU checks, in an order that lets ranks split them.
- ``wrappers.py``: what runs around a compiled graph (the reducer told, backwards refused with
  the fix, the graph as captured for the forward check).
- ``failures.py``: a failure inside torch's compilers as a ``CompileError`` with the next rung.
- ``record.py``: what the backend keeps of each graph (``DistCompiledModule.graphs``).
"""
