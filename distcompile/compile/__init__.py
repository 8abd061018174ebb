"""Compile: from one captured graph to compiled segments whose buckets the reducer knows.

Owns the TorchDynamo backend (``backend.py``: a numbered recipe of capture, plan,
agreement, split, compile, register) and splitting the graph at the planned boundaries
and compiling each piece (``segments.py``), sharing the compiles between ranks
(``sharing.py``, ``peers.py``; across cache folders through the store: ``transfer.py``).
May import ``capture``, ``planning`` and the
leaves. It reaches the runtime and telemetry only through the small interfaces it is
given (``backend.BucketRegistry``, ``backend.CompileObserver``); it never imports them.
"""
