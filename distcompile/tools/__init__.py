"""Tools around the library: the ``distcompile`` command line, the demo, the benchmark.

They use the library as a user does (the public ``distcompile`` API and
``distcompile.models``). Nothing in the core imports ``tools``.

- ``cli.py``: the ``distcompile`` command line.
- ``demo.py``: ``distcompile demo``.
- ``bench/``: ``distcompile bench``.
"""
