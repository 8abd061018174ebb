"""Diagnostics: what distcompile would do, and which stage goes wrong.

May import every core package; ``runtime.module`` only through the public ``wrap``.
Nothing in the core imports diagnostics.

- ``explain.py``: ``distcompile.explain``: graphs, breaks, segments, buckets without training.
- ``doctor.py``: ``distcompile.doctor``: the eager -> aot_eager -> inductor ladder against eager DDP.
- ``_ladder.py``: the doctor's training runs, one per stage, compared.
"""
