"""Diagnostics: ``explain`` (graphs, breaks, segments, buckets without training) and
``doctor`` (the eager -> aot_eager -> inductor ladder against eager DDP).

May import every core package; ``runtime.module`` only through the public ``wrap``.
Nothing in the core imports diagnostics.
"""
