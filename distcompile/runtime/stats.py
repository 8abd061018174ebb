"""What the reducer reports about a synchronized step, and to whom (telemetry implements the observer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["StepObserver", "StepStats"]


@dataclass
class StepStats:
    """Timings of one synchronized step, in milliseconds.

    Attributes:
        step: Index of this synchronized step (0 for the first).
        fwd_bwd_ms: From the first forward of the step to the end of ``backward()``.
        buckets: Number of buckets all-reduced.
        bytes: Bytes all-reduced (payload plus flags).
        exposed_comm_ms: Time ``backward()`` spent waiting for communication at its end
            (host time). On CUDA with NCCL the host does not wait, so without telemetry
            this is near 0; with ``logdir=`` it is the GPU time of communication that no
            computation hid, in step ``timed_step``.
        launch_ms: For each bucket, host time of its launch after the first gradient was ready.
        overlap_pct: Share of all-reduce time that overlapped computation (from telemetry).
        comm_ms: Time any all-reduce was in flight (from telemetry).
        timed_step: The step ``overlap_pct`` and ``comm_ms`` describe: this one on CPU; on
            CUDA the newest step the GPU has finished (usually the one before), since
            reading GPU times sooner would stop the host; -1 without telemetry.
    """

    step: int = -1
    fwd_bwd_ms: float = 0.0
    buckets: int = 0
    bytes: int = 0
    exposed_comm_ms: float = 0.0
    launch_ms: list[float] = field(default_factory=list)
    overlap_pct: float = 0.0
    comm_ms: float = 0.0
    timed_step: int = -1


class StepObserver(Protocol):
    """What the reducer tells an observer (telemetry) about a synchronized step.

    The reducer calls these on the training thread; the observer must not communicate.
    """

    def begin_step(self) -> None:
        """A synchronized step opened (its first forward)."""

    def bucket_launched(self, index: int, nbytes: int, nparams: int, future: torch.futures.Future) -> None:
        """Bucket ``index``'s reduction was started; ``future`` completes with it."""

    def end_step(self, stats: StepStats) -> dict[str, float]:
        """The step's ``backward()`` ended; returns ``StepStats`` fields the observer derived."""
