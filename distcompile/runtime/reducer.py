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
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from .._errors import CommunicationError, DistCompileError, NonFiniteGradientError
from .bucket import FlatBucket

__all__ = ["BucketReducer", "StepObserver", "StepStats"]

log = logging.getLogger(__name__)


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

    def bucket_launched(self, index: int, nbytes: int, nparams: int, work: dist.Work) -> None:
        """Bucket ``index``'s all-reduce was started; ``work`` completes with it."""

    def end_step(self, stats: StepStats) -> dict[str, float]:
        """The step's ``backward()`` ended; returns ``StepStats`` fields the observer derived."""


class _Step:
    def __init__(self) -> None:
        self.graphs: list[int] = []
        self.order: list[FlatBucket] | None = None
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
        observer: StepObserver | None = None,
        detect_nonfinite: bool = False,
        describe_peers: Callable[[], str] = lambda: "",
    ) -> None:
        self.params = dict(params)
        self.observer = observer
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
        self._schedules: dict[tuple[int, ...], tuple[list[FlatBucket], dict]] = {}
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
            if self.observer is not None:
                self.observer.begin_step()

    def record_graph(self, graph_id: int) -> None:
        """Note that a captured graph ran with gradients in the open step."""
        step = self._step
        if step is not None and step.order is None and graph_id not in step.graphs:
            step.graphs.append(graph_id)

    def claimed(self) -> set[str]:
        """Parameters bucketed by graphs that already ran in the open step."""
        return set() if self._step is None else self._claimed_by(self._step)

    def _claimed_by(self, step: _Step) -> set[str]:
        return {p for g in step.graphs for b in self._graph_buckets.get(g, ()) for p in b}

    @property
    def step_open(self) -> bool:
        return self._step is not None

    @property
    def graphs_run(self) -> int:
        """Captured graphs that ran with gradients in the open step (0 when none is open)."""
        return 0 if self._step is None else len(self._step.graphs)

    # -- backward side -------------------------------------------------------------
    def _schedule(self, graphs: tuple[int, ...]) -> tuple[list[FlatBucket], dict]:
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
                    FlatBucket(len(order), members, compression=compression, grad_as_view=self.grad_as_view)
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
                work = bucket.launch(self.group, scale)
                if self.observer is not None:
                    self.observer.bucket_launched(bucket.index, bucket.nbytes, len(bucket.params), work)
            except DistCompileError:
                raise
            except Exception as exc:
                raise self._comm_error(bucket, "launching", exc) from exc
            step.cursor += 1

    def _comm_error(self, bucket: FlatBucket, doing: str, exc: Exception) -> CommunicationError:
        return CommunicationError(
            f"rank {dist.get_rank()}: {doing} the all-reduce of bucket {bucket.index} "
            f"({bucket.nbytes} bytes, {len(bucket.params)} parameters) in step {self.steps} failed: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}. {self.describe_peers()}"
        )

    def finish_step(self) -> None:
        """End the open step now, inside ``backward()``: launch and wait for every bucket (idempotent)."""
        self._finish_step()

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
        stats = StepStats(
            step=self.steps,
            fwd_bwd_ms=(t1 - step.forward_at) * 1e3,
            buckets=len(step.order),
            bytes=sum(b.nbytes for b in step.order),
            exposed_comm_ms=(t1 - t0) * 1e3,
            launch_ms=[(b.launched_at - step.started) * 1e3 for b in step.order],
        )
        if self.observer is not None:
            stats = replace(stats, **self.observer.end_step(stats))
        if self.steps == 0:
            self._report_uncompiled(step)
        self.last_step = stats
        self.steps += 1

    def _report_uncompiled(self, step: _Step) -> None:
        # Once, after the first step, on the group's first rank: parameters whose gradient
        # came from code no graph of the step contains (a frame TorchDynamo skipped, eager
        # code between graphs) train uncompiled and wait for the trailing bucket.
        claimed = self._claimed_by(step)
        eager = [
            (n, p)
            for b in step.order or ()
            for n, p, ready in zip(b.names, b.params, b.ready)
            if ready and n not in claimed
        ]
        if not eager or dist.get_rank(self.group) != 0:
            return
        nbytes = sum(p.numel() * p.element_size() for _, p in eager)
        share = nbytes / max(sum(p.numel() * p.element_size() for p in self.params.values()), 1)
        log.log(
            logging.WARNING if share >= 0.1 else logging.INFO,
            "%d of %d trainable parameters (%.2f MB, %.0f%% of the bytes; %s%s) got their gradients from "
            "code that no captured graph contains (a frame TorchDynamo skipped, or eager code between "
            "graphs): that code runs uncompiled, and its gradients are all-reduced in one bucket when "
            "backward ends, without overlap. TORCH_LOGS=graph_breaks or distcompile.explain(model, "
            "*inputs) shows why.",
            len(eager),
            len(self.params),
            nbytes / 1e6,
            100 * share,
            ", ".join(n for n, _ in eager[:3]),
            ", ..." if len(eager) > 3 else "",
        )

    def abandon_step(self) -> None:
        """Forget an open step whose backward never ran (e.g. forward under grad, no backward)."""
        self._step = None

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
