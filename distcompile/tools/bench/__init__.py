"""The overlap benchmark (``distcompile bench``, ``benchmarks/overlap.py``).

It uses the library as a user does.

- ``parent.py``: launches the ranks (on loopback or a shaped link), first steps, the report.
- ``netns.py``: two network namespaces joined by a shaped veth pair.
- ``worker.py``: one rank: every variant, timed in alternating rounds.
- ``workload.py``: the model, its data and the rank every variant trains.
- ``variants.py``: how each variant builds its model and takes a step.
- ``floor.py``: the physical floor of a step from measured compute and link speed.
- ``gpu.py``: warm steps under the profiler (host syncs on GPUs), the GPU's versions.
- ``report.py``: the table and the dated markdown report.
- ``scaling.py``: the compile-scaling mode (first step against depth).
- ``sharing.py``: the compile-sharing mode (separate cache folders).
- ``host.py``: the host-overhead mode (host time per step on a CPU proxy of the GPU benchmark).
- ``__main__.py``: ``python -m distcompile.tools.bench``.
"""
