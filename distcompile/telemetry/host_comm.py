"""On CPU: a step's all-reduces and waits, kept as numbers until the step ends.

Note [Polled ends on CPU]
    On CPU an all-reduce ends on gloo's thread. A Python callback there (``future.then``)
    must take the interpreter lock from the training thread, which keeps it until its
    switch interval: it cost 2.7 ms a step on the host-overhead proxy (15 buckets, 0.18 ms
    each), and it delayed the end it recorded as much. Instead the training thread ends a
    span when it first sees the future done: at the end of each segment's backward, at
    each launch, and when a wait for that bucket returns. An end is so late by at most one
    segment's backward; a wait, the only time it matters to the exposed figure, is exact.
    On CUDA the callback stays: it records an event on the stream that waits for NCCL.

Note [Steps not drawn on CPU]
    Most steps are neither traced nor drawn: all they write is their scalars. For those,
    the launches, ends and waits stay plain numbers (a list a bucket, a tuple a wait) and
    the figures come straight from them; span objects are made only for a step whose
    Chrome trace or picture is written. On the host-overhead proxy (15 buckets; timers
    around telemetry's own calls, the written traces' cost spread over the steps; two runs
    of 500 steps each, 2026-11-29) this took telemetry from 0.93-1.18 to 0.71-0.78 ms a
    step: from 5.0-5.2% to 3.7% of the step. Since 2026-11-30 such a step also runs the
    compiled pieces without their timing stand-ins (``instrument.TimedPieces``), holds its
    scalars as numbers until they are handed over (``sink.Telemetry._hand_over``), and takes
    its figures from the waits alone (``timeline.figures_less_waits``); its telemetry calls
    took 0.24 ms a step (500 steps, means: start 43 us, launches 67, waits 16, end 114).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .clock import PendingSpan
from .timeline import figures_less_waits

__all__ = ["HostComm"]

# One launched all-reduce: [lane, start, end (None until seen done), bytes, parameters, future].
_LANE, _START, _END, _BYTES, _PARAMS, _FUTURE = range(6)


class HostComm:
    """The all-reduces and waits of the open step, on the host clock (Note [Polled ends on CPU]).

    Example:
        >>> now = iter([1.0, 5.0])
        >>> comm = HostComm(lambda: next(now))
        >>> done = torch.futures.Future(); done.set_result(None)
        >>> comm.launched(0, 64, 2, done); comm.waited(0, 2.0, 3.0); comm.finish()
        >>> comm.figures()["exposed_ms"], comm.lane_ms()
        (1000.0, {0: 2000.0})
    """

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.clear()

    def clear(self) -> None:
        """Forget the last step (a new one opens)."""
        self.flying: list[list] = []
        self.waits: list[tuple[float, float, int]] = []
        self._first_open = 0  # every record before this one has its end

    def launched(self, lane: int, nbytes: int, nparams: int, future: torch.futures.Future) -> None:
        """Bucket ``lane``'s all-reduce started now; ``future`` completes with it (the arguments of
        ``StepObserver.bucket_launched``)."""
        self.poll()
        self.flying.append([lane, self.now(), None, nbytes, nparams, future])

    def poll(self) -> None:
        """End every all-reduce now done (they finish in launch order, nearly always)."""
        flying, k = self.flying, self._first_open
        if k >= len(flying) or not flying[k][_FUTURE].done():
            return
        now = self.now()
        for record in flying[k:]:
            if record[_END] is None and record[_FUTURE].done():
                record[_END] = now
        while k < len(flying) and flying[k][_END] is not None:
            k += 1
        self._first_open = k

    def waited(self, lane: int, start: float, end: float) -> None:
        """A wait for bucket ``lane`` blocked the host from ``start`` to ``end``: it ended by then."""
        for record in self.flying[self._first_open :]:
            if record[_LANE] == lane and record[_END] is None:
                record[_END] = end
                break
        self.poll()
        if end > start:
            self.waits.append((start, end, lane))

    def finish(self) -> None:
        """At the end of the step: every all-reduce was waited for (a hook's may be left: waited here)."""
        for record in self.flying[self._first_open :]:
            if record[_END] is None:
                record[_FUTURE].wait()
                record[_END] = self.now()
        self._first_open = len(self.flying)

    def figures(self) -> dict[str, float | None]:
        """``comm_figures`` of the step; computation on CPU is the step less its waits (Note
        [Segment spans on CPU] in ``sink.py``), and every all-reduce is inside the step."""
        return figures_less_waits(
            [(r[_START], r[_END]) for r in self.flying], [(s, e) for s, e, _ in self.waits]
        )

    def lane_ms(self) -> dict[int, float]:
        """Each bucket's all-reduce time, in milliseconds, by lane."""
        return {r[_LANE]: (r[_END] - r[_START]) * 1e3 for r in self.flying}

    def spans(self) -> list[PendingSpan]:
        """The step's all-reduces and waits as spans (for a step whose trace or picture is written)."""
        out = [
            PendingSpan(
                "comm",
                f"bucket {r[_LANE]}",
                r[_START],
                r[_END],
                r[_LANE],
                {"bytes": r[_BYTES], "params": r[_PARAMS]},
            )
            for r in self.flying
        ]
        out += [PendingSpan("wait", f"wait bucket {lane}", s, e) for s, e, lane in self.waits]
        return out
