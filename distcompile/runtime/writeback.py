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

from .bucket import FlatBucket, comm_error, raise_if_nonfinite
from .schedule import Bucket, OpenStep

__all__ = ["WriteBack"]


class WriteBack:
    """The write-back half of ``BucketReducer`` (a mixin; the reducer holds the state it reads:
    ``comm_hook``, ``detect_nonfinite``, ``optimizers``, ``parts``, ``observer``, ``group``,
    ``steps``, ``describe_peers`` and ``_waited_s``).

    Example:
        >>> # BucketReducer(WriteBack): reducer._wait_and_write(step.order) at the end of backward
    """

    def _streaming(self) -> bool:
        """Whether each bucket is written as it finishes (not under a hook: flags are reduced
        together; nor detect_nonfinite: all are checked before any step)."""
        return self.comm_hook is None and not self.detect_nonfinite

    def _write_finished(self, step: OpenStep) -> None:
        """During backward: write (and step) the launched buckets whose all-reduce is done, in order."""
        while step.written < step.cursor:
            bucket = step.order[step.written]  # type: ignore[index]
            if not (isinstance(bucket, FlatBucket) and bucket.done()):
                return
            self._wait(bucket)
            self._write(bucket)
            self.optimizers.step(bucket.params)
            step.written += 1

    def _wait(self, bucket: Bucket) -> None:
        try:
            self._blocked(bucket.index, bucket.wait)
        except Exception as exc:
            raise comm_error(bucket, self.steps, self.describe_peers, "waiting for", exc) from exc

    def _write(self, bucket: Bucket, used: torch.Tensor | None = None) -> None:
        if isinstance(bucket, FlatBucket):
            bucket.write(bucket.wire[bucket.numel :] if used is None else used)
        else:
            bucket.write()
        self.parts.add_to(bucket)

    def _blocked(self, index: int, wait: Callable[[], object]) -> None:
        """Run ``wait`` (blocks on bucket ``index``'s communication), timing the host's wait."""
        t0 = time.perf_counter()
        wait()
        self._waited_s += (t1 := time.perf_counter()) - t0
        if self.observer is not None:
            self.observer.waited(index, t0, t1)

    def _wait_and_write(self, order: list[Bucket], *, write: bool = True) -> None:
        """Wait for every bucket in order and write its gradients, stepping any optimizer in
        backward after each bucket while the later ones are still in flight. With a hook, the
        used flags are reduced together once every hook is done (a hook may chain collectives);
        with detect_nonfinite every bucket is checked before any optimizer steps."""
        streaming = write and self._streaming()
        for bucket in order:
            self._wait(bucket)
            if streaming:
                self._write(bucket)
                self.optimizers.step(bucket.params)
        if streaming:
            return
        hooked = [b for b in order if isinstance(b, FlatBucket) and self.comm_hook is not None]
        used: dict[int, torch.Tensor] = {}
        if hooked:
            flags = torch.cat([b.local_flags() for b in hooked])
            dist.all_reduce(flags, group=self.group)
            used = dict(zip((b.index for b in hooked), flags.split([len(b.params) for b in hooked])))
        if not write:
            return
        for bucket in order:
            self._write(bucket, used.get(bucket.index))
        if self.detect_nonfinite:
            raise_if_nonfinite(order, self.steps)
        for bucket in order:
            self.optimizers.step(bucket.params)
