"""The overlap benchmark (``distcompile bench``, ``benchmarks/overlap.py``).

``parent`` launches the ranks (on loopback or a shaped link: ``netns``) and writes the
``report``; each rank (``worker``) trains the ``workload`` with every one of the
``variants``, after measuring the ``floor``. It uses the library as a user does.
"""
