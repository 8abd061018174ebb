"""Planning: which graph nodes form each segment and which gradients each bucket holds.

Owns the plan (``plan.py``: segments and buckets from the bucket caps, or from measured
costs) and the cost model's arithmetic (``costs.py``). Pure: it takes numbers and node
descriptions and returns a plan. It must never import a process group, a compiler,
telemetry, or anything else of distcompile but ``_errors``; it does no I/O.
"""
