"""Note [Bucketed all-reduce]

Background
    The planner gives each captured graph buckets aligned with its segments. At run time
    a training step may execute several graphs (graph breaks) and eager code between
    them; this module turns the graphs a step actually ran into an ordered list of flat
    buckets, and all-reduces each one as soon as its last gradient is final.

Algorithm
    * A parameter is *ready* when its post-accumulate-grad hook fires. The autograd
      engine runs a leaf's ``AccumulateGrad`` once per ``backward()``, after every use's
      gradient has arrived, so the hook fires exactly once, when the gradient is final.
    * The launch order is fixed by what ran in forward, identically on every rank:
      graphs in reverse first-execution order, each graph's buckets in plan order, then
      one trailing bucket for every other trainable parameter (those only read by eager
      code, or owned by a graph that did not run). A parameter goes with its first use.
    * Buckets launch strictly in that order (bucket *k+1* waits for bucket *k*), so
      collectives match across ranks. Launching copies each gradient into the bucket
      already multiplied by ``1/world_size`` (and cast, under compression), then starts
      ``all_reduce(async_op=True)``.
    * A callback queued on the autograd engine runs when ``backward()`` finishes: it
      launches what is left, waits for every bucket in order, and writes ``param.grad``.

Notes
    * Every flat buffer ends with one flag per parameter (1 if this rank produced a
      gradient this step). After the all-reduce, a parameter no rank produced a
      gradient for keeps its ``grad`` untouched; otherwise it gets the average, with
      zeros standing in for ranks without a gradient. This is DDP's
      ``find_unused_parameters`` behaviour, always on, for one extra element per parameter.
    * No host synchronization in a steady-state step: each bucket's flags are a device
      tensor made once per pattern of produced gradients; gradients go into the bucket with
      one copy and one scale per bucket (one scale with ``gradient_as_bucket_view``); after
      the all-reduce, the flags decide on the device (``torch.where``) for a parameter this
      rank left without gradient. Only when such a parameter has no ``.grad`` at all are the
      flags read back (creating ``.grad`` is a host decision). ``work.wait()`` on NCCL makes
      the current stream wait for the all-reduce, not the host; on gloo it blocks, as it must.
    * ``gradient_as_bucket_view`` leaves ``param.grad`` as a view of the flat buffer, so
      later steps accumulate straight into the bucket and launching needs no copy.

Debugging
    ``StepStats`` of the last step are on ``BucketReducer.last_step``; set
    ``TORCH_LOGS=+distcompile`` (or logging DEBUG for ``distcompile``) to see launches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from .._errors import CommunicationError, DistCompileError, NonFiniteGradientError, UnsupportedModelError
from ..telemetry.timeline import Span, StepTimeline

if TYPE_CHECKING:
    from ..telemetry.sink import Telemetry

__all__ = ["BucketReducer", "StepStats", "broadcast_coalesced"]

log = logging.getLogger(__name__)

_COMPRESSED = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], *, src: int, group: dist.ProcessGroup | None
) -> None:
    """Overwrite ``tensors`` on every rank with global rank ``src``'s values, one broadcast per dtype.

    What DDP does for its buffers before each forward, with public collectives: the
    tensors of one dtype and device travel as one flat buffer.

    Example:
        >>> # broadcast_coalesced(list(model.buffers()), src=0, group=None)
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    mine = dist.get_rank() == src
    for members in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=src, group=group)
        if mine:
            continue
        offset = 0
        for t in members:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class _FlatBucket:
    """One flat buffer of same-dtype parameters, plus one used-flag per parameter."""

    def __init__(
        self,
        index: int,
        params: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        compression: str | None,
        grad_as_view: bool,
    ) -> None:
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        dtype, device = self.params[0].dtype, self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        self.offsets = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        total = self.numel + len(self.params)
        self.buffer = torch.zeros(total, dtype=dtype, device=device)
        wire = _COMPRESSED[compression]
        self.wire = (
            self.buffer if wire is None or wire == dtype else torch.zeros(total, dtype=wire, device=device)
        )
        self.grad_as_view = grad_as_view
        self.views = [self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]
        self.wire_views = (
            self.views
            if self.wire is self.buffer
            else [self.wire[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]
        )
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.produced: tuple[bool, ...] = ()
        self._flag_cache: dict[tuple[bool, ...], torch.Tensor] = {}
        self.work: dist.Work | None = None
        self.launched_at = 0.0

    @property
    def nbytes(self) -> int:
        return self.wire.numel() * self.wire.element_size()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.work = None

    def _flags(self, produced: tuple[bool, ...], scale: float) -> torch.Tensor:
        # One device tensor per pattern of locally produced gradients (nearly always a
        # single pattern: all of them), made once: a steady-state step copies nothing from
        # the host, so on CUDA the CPU never waits for the GPU here.
        flags = self._flag_cache.get(produced)
        if flags is None:
            host = torch.tensor([scale if r else 0.0 for r in produced], dtype=self.wire.dtype)
            flags = self._flag_cache[produced] = host.to(self.wire.device)
        return flags

    def _fill(self, produced: tuple[bool, ...], scale: float) -> None:
        """Write ``scale * grad`` of every produced gradient into the wire buffer (zeros elsewhere)."""
        dense = self.wire[: self.numel]
        grads = [p.grad for p in self.params]
        if all(produced):
            in_bucket = [g.data_ptr() == v.data_ptr() for g, v in zip(grads, self.views)]
            if all(in_bucket):
                # Gradients live in the bucket (gradient_as_bucket_view): one scale (and cast).
                torch.mul(self.buffer[: self.numel], scale, out=dense)
                return
            if not any(in_bucket):
                # One copy (and cast) of all gradients into the bucket, then one scale.
                torch.cat([g.reshape(-1) for g in grads], out=dense)
                dense.mul_(scale)
                return
        for i, g in enumerate(grads):  # mixed: per parameter
            dst = self.wire_views[i]
            if not produced[i]:
                dst.zero_()
            elif g.data_ptr() == dst.data_ptr():
                dst.mul_(scale)
            else:
                torch.mul(g, scale, out=dst)

    def launch(self, group: dist.ProcessGroup | None, scale: float, timeline: StepTimeline | None) -> None:
        produced = tuple(r and p.grad is not None for r, p in zip(self.ready, self.params))
        for name, p, r in zip(self.names, self.params, produced):
            if r and p.grad.is_sparse:
                raise UnsupportedModelError(
                    f"parameter {name!r} has a sparse gradient; distcompile reduces dense "
                    "buckets only. Use nn.Embedding(sparse=False) or plain DDP for this model."
                )
        self.produced = produced
        self._fill(produced, scale)
        self.wire[self.numel :].copy_(self._flags(produced, scale))
        self.launched_at = time.perf_counter()
        self.work = dist.all_reduce(self.wire, group=group, async_op=True)
        if timeline is not None:
            start, index, nbytes = self.launched_at, self.index, self.nbytes

            def done(fut: torch.futures.Future) -> None:
                # Runs on the communication thread when the all-reduce completes.
                timeline.add(
                    Span(
                        "comm",
                        f"bucket {index}",
                        start,
                        time.perf_counter(),
                        lane=index,
                        args={"bytes": nbytes, "params": len(self.params)},
                    )
                )

            self.work.get_future().then(done)

    def nonfinite(self) -> list[str]:
        """Names of parameters whose synchronized gradient holds NaN or Inf."""
        if bool(torch.isfinite(self.wire[: self.numel]).all()):
            return []
        return [n for n, v in zip(self.names, self.wire_views) if not bool(torch.isfinite(v).all())]

    def finish(self) -> None:
        if self.work is None:
            raise RuntimeError(f"bucket {self.index}: finish() before launch()")
        # Drop the Work at once rather than at the next step: the last step's Work would
        # otherwise live until interpreter teardown, holding this buffer and (with
        # telemetry) a Python callback.
        work, self.work = self.work, None
        work.wait()  # on CUDA/NCCL: the current stream waits for the all-reduce, not the host
        used = self.wire[self.numel :]  # > 0 where some rank produced a gradient
        used_host: list[float] | None = None
        for i, p in enumerate(self.params):
            src = self.wire_views[i]
            if not self.produced[i]:
                # This rank produced no gradient: the average (zeros standing in for this
                # rank) if another rank did, else .grad stays as it was, as in DDP.
                if p.grad is None:
                    # Whether to create a .grad is a host decision: read the flags back
                    # (only in steps where this rank left a parameter without gradient).
                    if used_host is None:
                        used_host = used.tolist()
                    if used_host[i] <= 0:
                        continue
                else:
                    src = torch.where(used[i] > 0, src.to(p.grad.dtype), p.grad)
            if self.grad_as_view:
                if src is not self.views[i]:
                    self.views[i].copy_(src)
                if p.grad is None or p.grad.data_ptr() != self.views[i].data_ptr():
                    p.grad = self.views[i]
            elif p.grad is None:
                p.grad = src.to(p.dtype, copy=True)
            else:
                p.grad.copy_(src)


@dataclass
class StepStats:
    """Timings of one synchronized step, in milliseconds.

    Attributes:
        step: Index of this synchronized step (0 for the first).
        fwd_bwd_ms: From the first forward of the step to the end of ``backward()``.
        buckets: Number of buckets all-reduced.
        bytes: Bytes all-reduced (payload plus flags).
        exposed_comm_ms: Time ``backward()`` spent waiting for communication at its end.
        launch_ms: For each bucket, launch time after the first gradient became ready.
        overlap_pct: Share of all-reduce time that overlapped computation (telemetry on).
        comm_ms: Time any all-reduce was in flight (telemetry on).
    """

    step: int = -1
    fwd_bwd_ms: float = 0.0
    buckets: int = 0
    bytes: int = 0
    exposed_comm_ms: float = 0.0
    launch_ms: list[float] = field(default_factory=list)
    overlap_pct: float = 0.0
    comm_ms: float = 0.0


class _Step:
    def __init__(self) -> None:
        self.graphs: list[int] = []
        self.order: list[_FlatBucket] | None = None
        self.cursor = 0
        self.forward_at = time.perf_counter()
        self.started = 0.0


class BucketReducer:
    """Owns gradient synchronization for the trainable parameters of one wrapped model.

    Example:
        >>> # created by distcompile.wrap; a training step then looks like eager DDP:
        >>> # loss = model(x).sum(); loss.backward()  # grads are averaged across ranks
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        *,
        group: dist.ProcessGroup | None,
        compression: str | None,
        grad_as_view: bool,
        compress_tail_only: bool = False,
        telemetry: Telemetry | None = None,
        detect_nonfinite: bool = False,
        describe_peers: Callable[[], str] = lambda: "",
    ) -> None:
        self.params = dict(params)
        self.telemetry = telemetry
        self.detect_nonfinite = detect_nonfinite
        self.describe_peers = describe_peers
        self.steps = 0
        self.group = group
        self.compression = compression
        self.compress_tail_only = compress_tail_only
        self.grad_as_view = grad_as_view
        self.world_size = dist.get_world_size(group)
        self._graph_buckets: dict[int, list[list[str]]] = {}
        # graphs that ran -> (buckets in launch order, id(param) -> (bucket, slot))
        self._schedules: dict[tuple[int, ...], tuple[list[_FlatBucket], dict]] = {}
        self._step: _Step | None = None
        self._warned_unsynced = False
        self.last_step = StepStats()
        self._index_of = {id(p): i for i, p in enumerate(self.params.values())}
        self._name_of = {id(p): n for n, p in self.params.items()}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params.values()]

    # -- forward side ------------------------------------------------------------
    def add_graph(self, graph_id: int, buckets: Sequence[Sequence[str]]) -> None:
        """Register the planned buckets (parameter names, gradient order) of a graph."""
        self._graph_buckets[graph_id] = [list(b) for b in buckets]

    def begin_forward(self) -> None:
        """Open a step (if none is open): the next backward synchronizes gradients."""
        if self._step is None:
            self._step = _Step()
            if self.telemetry is not None:
                self.telemetry.begin_step()

    def record_graph(self, graph_id: int) -> None:
        """Note that a captured graph ran with gradients in the open step."""
        step = self._step
        if step is not None and step.order is None and graph_id not in step.graphs:
            step.graphs.append(graph_id)

    def claimed(self) -> set[str]:
        """Parameters bucketed by graphs that already ran in the open step."""
        step = self._step
        if step is None:
            return set()
        return {p for g in step.graphs for b in self._graph_buckets.get(g, ()) for p in b}

    @property
    def step_open(self) -> bool:
        return self._step is not None

    # -- backward side -------------------------------------------------------------
    def _schedule(self, graphs: tuple[int, ...]) -> tuple[list[_FlatBucket], dict]:
        cached = self._schedules.get(graphs)
        if cached is not None:
            for b in cached[0]:
                b.reset()
            return cached
        claimed: set[str] = set()
        groups: list[list[str]] = []
        # First use wins: claim graphs in forward order, launch them in reverse.
        per_graph = []
        for g in graphs:
            mine = [[p for p in b if p not in claimed] for b in self._graph_buckets.get(g, ())]
            claimed.update(p for b in mine for p in b)
            per_graph.append(mine)
        for mine in reversed(per_graph):
            groups.extend(b for b in mine if b)
        # The tail: the first forward segment's bucket and the trailing bucket, both final
        # only when backward ends.
        tail_from = max(len(groups) - 1, 0)
        rest = [n for n in reversed(list(self.params)) if n not in claimed]
        if rest:
            groups.append(rest)
        order = []
        for g, names in enumerate(groups):
            compression = self.compression if g >= tail_from or not self.compress_tail_only else None
            by_dtype: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.nn.Parameter]]] = {}
            for n in names:
                p = self.params[n]
                by_dtype.setdefault((p.dtype, p.device), []).append((n, p))
            for members in by_dtype.values():
                order.append(
                    _FlatBucket(len(order), members, compression=compression, grad_as_view=self.grad_as_view)
                )
        locate = {id(p): (b, i) for b in order for i, p in enumerate(b.params)}
        self._schedules[graphs] = (order, locate)
        log.debug(
            "schedule for graphs %s: %s",
            graphs,
            [(b.index, len(b.params), b.nbytes) for b in order],
        )
        return order, locate

    def _on_grad(self, param: torch.Tensor) -> None:
        step = self._step
        if step is None:
            if not self._warned_unsynced:
                self._warned_unsynced = True
                log.debug(
                    "gradient of %s accumulated outside a synchronized step (no_sync?)",
                    self._name_of.get(id(param)),
                )
            return
        if step.order is None:
            step.order, self._locate = self._schedule(tuple(step.graphs))
            step.started = time.perf_counter()
            compat.queue_engine_callback(self._finish_step)
        bucket, i = self._locate[id(param)]
        if not bucket.ready[i]:
            bucket.ready[i] = True
            bucket.n_ready += 1
        self._launch_ready(step)

    def _launch_ready(self, step: _Step, *, all_remaining: bool = False) -> None:
        order = step.order
        assert order is not None
        scale = 1.0 / self.world_size
        while step.cursor < len(order):
            bucket = order[step.cursor]
            if not all_remaining and bucket.n_ready < len(bucket.params):
                return
            try:
                bucket.launch(self.group, scale, self.telemetry.timeline if self.telemetry else None)
            except DistCompileError:
                raise
            except Exception as exc:
                raise self._comm_error(bucket, "launching", exc) from exc
            step.cursor += 1

    def _comm_error(self, bucket: _FlatBucket, doing: str, exc: Exception) -> CommunicationError:
        return CommunicationError(
            f"rank {dist.get_rank()}: {doing} the all-reduce of bucket {bucket.index} "
            f"({bucket.nbytes} bytes, {len(bucket.params)} parameters) in step {self.steps} failed: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}. {self.describe_peers()}"
        )

    def _finish_step(self) -> None:
        step = self._step
        self._step = None
        if step is None or step.order is None:
            return
        t0 = time.perf_counter()
        self._launch_ready(step, all_remaining=True)
        for bucket in step.order:
            try:
                bucket.finish()
            except Exception as exc:
                raise self._comm_error(bucket, "waiting for", exc) from exc
        if self.detect_nonfinite:
            for bucket in step.order:
                bad = bucket.nonfinite()
                if bad:
                    raise NonFiniteGradientError(
                        f"step {self.steps}: bucket {bucket.index} holds NaN/Inf gradients after the "
                        f"all-reduce, in {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}. Every rank "
                        "stops here (they all see the same averaged gradients). Lower the learning rate, "
                        "check the inputs of this step, or use a loss scaler; set detect_nonfinite=False "
                        "to skip the check."
                    )
        t1 = time.perf_counter()
        self.last_step = StepStats(
            step=self.steps,
            fwd_bwd_ms=(t1 - step.forward_at) * 1e3,
            buckets=len(step.order),
            bytes=sum(b.nbytes for b in step.order),
            exposed_comm_ms=(t1 - t0) * 1e3,
            launch_ms=[(b.launched_at - step.started) * 1e3 for b in step.order],
        )
        self.steps += 1
        if self.telemetry is not None:
            self.telemetry.end_step(self.last_step)

    def abandon_step(self) -> None:
        """Forget an open step whose backward never ran (e.g. forward under grad, no backward)."""
        self._step = None

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
