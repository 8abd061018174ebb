"""Writing a synchronized step's reduced gradients back, in launch order.

Each bucket is waited for (the host's wait timed for telemetry), written to ``.grad``,
the parts of shared parameters added to theirs (Note [Shared weights reduced by use]),
and any optimizer run in backward stepped on its parameters, while later buckets are
still in flight (Note [The optimizer under communication]). During backward, buckets
already reduced are written as soon as they are done, when an optimizer waits for them.
Under a communication hook the used flags of every bucket are reduced together after the
hooks, and with ``detect_nonfinite`` every bucket is checked before any optimizer steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .bucket import FlatBucket
from .comm_errors import Peers, comm_error, raise_if_nonfinite
from .hooks import HookChain
from .optim_in_backward import OptimizersInBackward
from .schedule import OpenStep, ReduceBucket
from .shared_weights import SharedParts
from .stats import StepObserver

__all__ = ["WriteBack"]


class WriteBack:
    """Waits for a step's buckets and writes their gradients back (the reducer's second half).

    Attributes:
        waited_s: Host time blocked on communication since ``new_step``.

    Example:
        >>> # wb = WriteBack(parts=..., optimizers=..., hooks=..., group=None, observer=None,
        >>> #                detect_nonfinite=False, peers=Peers())
        >>> # wb.wait_and_write(step.order, step_index)      # at the end of backward
    """

    def __init__(
        self,
        *,
        parts: SharedParts,
        optimizers: OptimizersInBackward,
        hooks: HookChain,
        group: dist.ProcessGroup | None,
        observer: StepObserver | None,
        detect_nonfinite: bool,
        peers: Peers,
    ) -> None:
        self._parts, self._optimizers, self._hooks, self._group = parts, optimizers, hooks, group
        self._observer, self._detect_nonfinite, self._peers = (
            observer,
            detect_nonfinite,
            peers,
        )
        self.waited_s = 0.0

    def new_step(self) -> None:
        self.waited_s = 0.0

    def streaming(self) -> bool:
        """Whether each bucket is written as it finishes (not under a hook: flags are reduced
        together; nor detect_nonfinite: all are checked before any step)."""
        return self._hooks.fused and not self._detect_nonfinite

    def write_finished(self, step: OpenStep, index: int) -> None:
        """During backward: write (and step) the launched buckets whose all-reduce is done, in order."""
        while step.written < step.cursor:
            bucket = step.order[step.written]  # type: ignore[index]
            if not (isinstance(bucket, FlatBucket) and bucket.done()):
                return
            self._wait(bucket, index)
            self._write(bucket)
            self._optimizers.step(bucket.params)
            step.written += 1

    def _wait(self, bucket: ReduceBucket, index: int) -> None:
        try:
            self.blocked(bucket.index, bucket.wait)
        except Exception as exc:
            raise comm_error(bucket, index, self._peers, "waiting for", exc) from exc

    def _write(self, bucket: ReduceBucket, used: torch.Tensor | None = None) -> None:
        if isinstance(bucket, FlatBucket):
            bucket.write(used)
        else:
            bucket.write()
        self._parts.add_to(bucket)

    def blocked(self, index: int, wait: Callable[[], object]) -> None:
        """Run ``wait`` (blocks on bucket ``index``'s communication), timing the host's wait."""
        t0 = time.perf_counter()
        wait()
        self.waited_s += (t1 := time.perf_counter()) - t0
        if self._observer is not None:
            self._observer.waited(index, t0, t1)

    def wait_and_write(self, order: list[ReduceBucket], index: int, *, write: bool = True) -> None:
        """Wait for every bucket of step ``index`` in order and write its gradients, stepping any
        optimizer in backward after each bucket while the later ones are still in flight. With a
        hook, the used flags are reduced together once every hook is done (a hook may chain
        collectives); with detect_nonfinite every bucket is checked before any optimizer steps."""
        streaming = write and self.streaming()
        for bucket in order:
            self._wait(bucket, index)
            if streaming:
                self._write(bucket)
                self._optimizers.step(bucket.params)
        if streaming:
            return
        hooked = [b for b in order if self._hooks.for_bucket(b) is not None]
        used: dict[int, torch.Tensor] = {}
        if hooked:
            flags = torch.cat([b.local_flags() for b in hooked])
            dist.all_reduce(flags, group=self._group)
            used = dict(zip((b.index for b in hooked), flags.split([len(b.params) for b in hooked])))
        if not write:
            return
        for bucket in order:
            self._write(bucket, used.get(bucket.index))
        if self._detect_nonfinite:
            raise_if_nonfinite(order, index)
        for bucket in order:
            self._optimizers.step(bucket.params)
