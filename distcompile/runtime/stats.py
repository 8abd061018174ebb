"""What the reducer reports about a synchronized step, and to whom (telemetry implements the observer)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["StepObserver", "StepStats"]


@dataclass
class StepStats:
    """Timings of one synchronized step, in milliseconds (definitions: ``docs/telemetry.md``).

    The communication figures follow Holistic Trace Analysis and need telemetry
    (``wrap(..., logdir=...)``); without it they are ``None`` (shown as ``-``), never 0.

    Attributes:
        step: Index of this synchronized step (0 for the first).
        fwd_bwd_ms: From the first forward of the step to the end of ``backward()``.
        buckets: Number of buckets all-reduced.
        bytes: Bytes all-reduced (payload plus flags).
        tail_bytes: Of those, the bytes of the tail: buckets whose gradients are final only
            when backward ends (the first forward segment's, and parameters no graph reads).
        wait_ms: Host time the step blocked waiting for communication to finish (rank skew
            included: a rank waits for its slowest peer). Always measured. On CUDA with
            NCCL the host does not wait, so this is near 0.
        launch_ms: For each bucket, host time of its launch after the first gradient was ready.
        comm_ms: Time any all-reduce of the step was in flight.
        overlapped_ms: The part of ``comm_ms`` during which computation ran.
        exposed_ms: The rest of ``comm_ms`` (``overlapped_ms + exposed_ms == comm_ms``).
        overlap_pct: ``overlapped_ms / comm_ms`` in percent (``None`` also when nothing was
            all-reduced).
        timed_step: The step the four figures above describe: this one on CPU; on CUDA the
            newest step the GPU has finished (usually the one before), since reading GPU
            times sooner would stop the host; -1 without telemetry.
    """

    step: int = -1
    fwd_bwd_ms: float = 0.0
    buckets: int = 0
    bytes: int = 0
    tail_bytes: int = 0
    wait_ms: float = 0.0
    launch_ms: list[float] = field(default_factory=list)
    comm_ms: float | None = None
    overlapped_ms: float | None = None
    exposed_ms: float | None = None
    overlap_pct: float | None = None
    timed_step: int = -1

    @property
    def exposed_comm_ms(self) -> float:
        """Deprecated: the host wait, now ``wait_ms`` (``exposed_ms`` is the HTA figure)."""
        warnings.warn(
            "StepStats.exposed_comm_ms is deprecated: it was the host's wait for communication, now "
            "StepStats.wait_ms; the communication no computation hid is StepStats.exposed_ms",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.wait_ms

    def figures(self) -> dict[str, float | None]:
        """The communication figures as a dict (for ``telemetry.timeline.mean_figures``).

        Example:
            >>> StepStats(wait_ms=1.5).figures()["wait_ms"]
            1.5
        """
        keys = ("comm_ms", "overlapped_ms", "exposed_ms", "overlap_pct", "wait_ms")
        return {k: getattr(self, k) for k in keys}


class StepObserver(Protocol):
    """What the reducer tells an observer (telemetry) about a synchronized step.

    The reducer calls these on the training thread; the observer must not communicate.
    """

    def begin_step(self) -> None:
        """A synchronized step opened (its first forward)."""

    def bucket_launched(self, index: int, nbytes: int, nparams: int, future: torch.futures.Future) -> None:
        """Bucket ``index``'s reduction was started; ``future`` completes with it."""

    def waited(self, index: int, start: float, end: float) -> None:
        """The host blocked on bucket ``index``'s communication from ``start`` to ``end`` (perf_counter)."""

    def end_step(self, stats: StepStats) -> dict[str, float]:
        """The step's ``backward()`` ended; returns ``StepStats`` fields the observer derived."""
