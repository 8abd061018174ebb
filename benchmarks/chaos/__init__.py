"""The chaos run (``python benchmarks/run_chaos.py``): faults injected into a real multi-node job, counted.

A harness of the checkout, not of the installed package: it drives ``launchers/`` and
``examples/``, which only a checkout has.

- ``schedule.py``: the seeded fault schedule (pure).
- ``inject.py``: the faults done to processes, links and folders.
- ``job.py``: one job of the example GPT on namespaces as nodes, through ``launchers/``.
- ``monitor.py``: the job's progress, from the nodes' event logs.
- ``faults.py``: each fault and the recovery from it, measured (Note [Chaos run]).
- ``figures.py``: the figures and the report.
- ``run.py``: the command: an uninterrupted job, the chaos job, the comparison.
- ``__main__.py``: ``python -m benchmarks.chaos``.
"""

__all__: list[str] = []
