"""Planning: which graph nodes form each segment and which gradients each bucket holds.

Pure: it takes numbers and node descriptions and returns a plan. It must never import a
process group, a compiler, telemetry, or anything else of distcompile but ``errors``; it
does no I/O.

- ``nodes.py``: ``NodeInfo``, one graph node as the planner sees it.
- ``plan.py``: segments and buckets from the bucket caps or from measured costs.
- ``repeats.py``: cuts that keep identical blocks identical pieces.
- ``search.py``: the schedule search behind ``bucket_cap_mb="auto"``.
- ``costs.py``: the cost model's numbers and arithmetic.
- ``split.py``: shared weights reduced by use; tables reduced by rows.
"""
