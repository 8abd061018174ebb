"""Clocks for step timelines: host time on CPU, CUDA events on the GPU.

On CUDA, work is only queued by the calls telemetry brackets, so host clocks around
them show when work was queued, not when it ran. ``CudaClock`` instead records an event
on the stream that runs the work and reads its time later, once the GPU has passed it,
so measuring adds no host synchronization. ``PendingSteps`` holds a step's marks until
then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .. import _torch_compat as compat
from .timeline import Span

__all__ = [
    "Clock",
    "CudaClock",
    "HostClock",
    "Mark",
    "PendingSpan",
    "PendingStep",
    "PendingSteps",
    "StepTimeline",
    "clock_for",
]

#: A point in time as a clock records it (a float on the host clock, an event on CUDA).
Mark = object


class Clock(Protocol):
    """Records points in time and tells them apart later."""

    #: True when the time of a mark may only be known later (the device runs behind the host).
    lazy: bool

    def mark(self) -> Mark | None:
        """Now, on the stream that runs the current work (``None``: cannot record here)."""

    def done(self, mark: Mark) -> bool:
        """Whether ``mark``'s time can be read without waiting."""

    def wait(self, mark: Mark) -> None:
        """Block until ``mark``'s time can be read."""

    def seconds(self, origin: Mark, mark: Mark) -> float:
        """Seconds from ``origin`` to ``mark``."""

    def release(self, marks: list[Mark]) -> None:
        """``marks`` were read and are referred to no more: the clock may record them again."""


class HostClock:
    """``time.perf_counter``: the time the host reached each call (right for CPU work).

    Example:
        >>> c = HostClock(); a = c.mark(); c.seconds(a, c.mark()) >= 0
        True
    """

    lazy = False

    def mark(self) -> float:
        return time.perf_counter()

    def done(self, mark: Mark) -> bool:
        return True

    def wait(self, mark: Mark) -> None:
        pass

    def seconds(self, origin: Mark, mark: Mark) -> float:
        return float(mark) - float(origin)  # type: ignore[arg-type]

    def release(self, marks: list[Mark]) -> None:
        pass


class CudaClock:
    """CUDA events with timing, recorded on the current stream of the calling thread.

    Under CUDA graph capture no event is recorded (``mark`` returns ``None``): an event
    recorded there would belong to the graph, not to this step.

    A mark costs the host one event record and no object: events come back through
    ``release`` once their step is read and are recorded again, and each stream's
    ``Stream`` object is built once (``Event.record()`` without one builds it every call:
    about 35 us of a mark's 47 us under cProfile on an H100, 88 marks a step).

    Example:
        >>> # c = CudaClock(); a = c.mark(); ...; c.done(a) and c.seconds(a, c.mark())
    """

    lazy = True
    #: Events kept for reuse at most (about ten steps of the benchmark GPT's marks).
    POOL = 1024

    def __init__(self) -> None:
        self._free: list[torch.cuda.Event] = []
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}

    def mark(self) -> torch.cuda.Event | None:
        if torch.cuda.is_current_stream_capturing():
            return None
        key = compat.current_cuda_stream_key()
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
        try:  # marks are also taken in communication callbacks: pop, not test then pop
            ev = self._free.pop()
        except IndexError:
            ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def release(self, marks: list[Mark]) -> None:
        if len(self._free) < self.POOL:
            self._free.extend(marks)  # type: ignore[arg-type]

    def done(self, mark: Mark) -> bool:
        return mark.query()  # type: ignore[attr-defined]

    def wait(self, mark: Mark) -> None:
        mark.synchronize()  # type: ignore[attr-defined]

    def seconds(self, origin: Mark, mark: Mark) -> float:
        return origin.elapsed_time(mark) / 1e3  # type: ignore[attr-defined]


def clock_for(device: torch.device) -> Clock:
    """The clock that times work on ``device``.

    Example:
        >>> type(clock_for(torch.device("cpu"))).__name__
        'HostClock'
    """
    return CudaClock() if device.type == "cuda" else HostClock()


@dataclass
class PendingSpan:
    """A span whose ends are marks not read yet (see :class:`~.timeline.Span` for the fields)."""

    track: str
    name: str
    start: Mark | None
    end: Mark | None
    lane: int = 0
    args: dict = field(default_factory=dict)


@dataclass
class PendingStep:
    """One step's marks: ``origin`` (host time ``host_origin``) when it opened, ``end`` when it ended.

    ``serial_comm``: the step's all-reduces ran one after another on one stream (NCCL runs a
    group's collectives in launch order), so each started no earlier than the previous ended.
    """

    step: int
    host_origin: float
    origin: Mark | None
    end: Mark | None = None
    spans: list[PendingSpan] = field(default_factory=list)
    extra: object = None
    serial_comm: bool = False

    def marks(self) -> list[Mark]:
        """Each mark once (a span may start and end at one), the step's own two first."""
        found = [self.origin, self.end] + [m for s in self.spans for m in (s.start, s.end)]
        return list({id(m): m for m in found if m is not None}.values())

    def resolve(self, clock: Clock) -> list[Span]:
        """The spans in host seconds (host origin plus device time since the origin mark)."""
        assert self.origin is not None
        if clock.lazy:
            at: Callable[[Mark], float] = lambda m: self.host_origin + clock.seconds(self.origin, m)  # noqa: E731
        else:  # host marks are host seconds already: a shift (none when the origins are one reading)
            shift = self.host_origin - float(self.origin)  # type: ignore[arg-type]
            at = float if shift == 0 else lambda m: m + shift  # type: ignore[assignment,operator]
        out, last_comm_end = [], float("-inf")
        for s in self.spans:
            if s.start is None or s.end is None:
                continue  # recorded under CUDA graph capture
            start, end = at(s.start), at(s.end)
            if s.track == "comm" and self.serial_comm:
                start = max(start, last_comm_end)
                last_comm_end = end = max(end, start)
            out.append(Span(s.track, s.name, start, end, s.lane, dict(s.args)))
        end = at(self.end) if self.end is not None else max([self.host_origin, *(s.end for s in out)])
        out.append(Span("step", f"step {self.step}", self.host_origin, end))
        return out


class StepTimeline:
    """Collects the spans of the open step; safe to add to from communication threads.

    Example:
        >>> tl = StepTimeline()
        >>> tl.begin(); tl.add(PendingSpan("comm", "bucket 0", 0.1, 0.2)); len(tl.finish())
        1
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[PendingSpan] = []
        self.open = False

    def begin(self) -> None:
        with self._lock:
            self.spans = []
            self.open = True

    def add(self, span: PendingSpan) -> None:
        with self._lock:
            self.spans.append(span)

    def finish(self) -> list[PendingSpan]:
        with self._lock:
            self.open = False
            spans, self.spans = self.spans, []
            return spans


class PendingSteps:
    """Finished steps whose marks are not all readable yet, oldest first.

    ``ready()`` hands back every step the device has passed, in order, without waiting;
    ``ready(wait=True)`` waits for all of them (closing, or when ``limit`` steps are held).

    Example:
        >>> q = PendingSteps(HostClock()); c = q.clock
        >>> q.push(PendingStep(0, 0.0, c.mark(), c.mark())); [p.step for p, _ in q.ready()]
        [0]
    """

    def __init__(self, clock: Clock, limit: int = 8) -> None:
        self.clock = clock
        self.limit = limit
        self._q: deque[PendingStep] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def push(self, step: PendingStep) -> None:
        self._q.append(step)

    def ready(self, *, wait: bool = False) -> list[tuple[PendingStep, Sequence[Span]]]:
        out = []
        while self._q:
            head = self._q[0]
            marks = head.marks() if self.clock.lazy else []  # host marks are readable at once
            if wait or len(self._q) > self.limit:
                for m in marks:
                    self.clock.wait(m)
            elif not all(self.clock.done(m) for m in marks):
                break
            self._q.popleft()
            out.append((head, head.resolve(self.clock) if head.origin is not None else []))
            self.clock.release(marks)
        return out
