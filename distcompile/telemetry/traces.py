"""A rank's Chrome trace files: which steps are traced, written whole, and which are kept.

Note [Traces a long job can afford]
    A trace costs a few milliseconds to write, and every segment is timed in the step it
    traces; a job may run 100,000 steps. Traces follow the step number, not a time budget,
    so that every rank traces the same steps (their files are compared side by side). By
    default (``trace_every=None``): the compile step and step ``FIRST_TRACES[1]``, then every
    ``TRACE_PERIOD``-th; a rank keeps those first ones and its newest ``TRACES_KEPT``,
    removing the oldest as it writes a new one. A ``trace_every`` given keeps every file it
    asked for.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os

from .timeline import Span, chrome_trace

__all__ = ["FIRST_TRACES", "TRACES_KEPT", "TRACE_PERIOD", "TraceFiles"]

#: ``trace_every=None`` (the default): traces of these steps (the compile, a warm step) and
#: of every ``TRACE_PERIOD``-th, of which a rank keeps these and its newest ``TRACES_KEPT``.
FIRST_TRACES = (0, 10)
TRACE_PERIOD = 100
TRACES_KEPT = 10


class TraceFiles:
    """One rank's traces under ``trace_dir``, as ``trace_rank{R}_step{N}.json``.

    Example:
        >>> import tempfile
        >>> files = TraceFiles(tempfile.mkdtemp(), rank=0, every=None)
        >>> [s for s in range(250) if files.due(s)]
        [0, 10, 100, 200]
    """

    def __init__(self, trace_dir: str, *, rank: int, every: int | None) -> None:
        self.trace_dir, self.rank, self.every = trace_dir, rank, every
        os.makedirs(trace_dir, exist_ok=True)
        self._rolling: collections.deque[str] = collections.deque()  # files that may be removed

    def due(self, step: int) -> bool:
        """Whether step ``step`` is traced."""
        if self.every is None:
            return step in FIRST_TRACES or step % TRACE_PERIOD == 0
        return bool(self.every) and step % self.every == 0

    def write(self, spans: list[Span], step: int, origin: float) -> str:
        """Write step ``step``'s trace (``spans``, times from ``origin`` or the earliest span); returns its path."""
        first = min([origin, *(s.start for s in spans)])
        path = os.path.join(self.trace_dir, f"trace_rank{self.rank}_step{step}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            # dumps, not dump: json.dump streams through the pure-Python encoder; dumps uses the
            # C one (a traced step's writing on the host-overhead proxy: 3.1 -> 2.1 ms).
            f.write(json.dumps(chrome_trace(spans, rank=self.rank, step=step, origin=first)))
        os.replace(tmp, path)  # readers never see a half-written trace
        if self.every is None and step not in FIRST_TRACES:  # Note [Traces a long job can afford]
            self._rolling.append(path)
            if len(self._rolling) > TRACES_KEPT:
                with contextlib.suppress(FileNotFoundError):  # already removed by someone else
                    os.remove(self._rolling.popleft())
        return path
