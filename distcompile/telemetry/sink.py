"""Telemetry sinks: TensorBoard scalars, text and a Gantt picture; a Chrome trace per rank.

Everything here runs only when ``wrap(..., logdir=...)`` is given; without it the engine
installs no timers and no hooks for telemetry.

Note [Segment spans on CPU]
    On CPU the training thread computes whenever it is in the step and not waiting for an
    all-reduce, so the overlap figures need only the waits. Timing each segment (two marks
    and two autograd hooks a segment and step: 0.9 ms a step on the host-overhead proxy)
    only names the computation, so it is done in the steps drawn: those whose Chrome trace
    or TensorBoard picture is written, and only there are the pieces' timing stand-ins in
    place (``instrument.TimedPieces``). On CUDA every step times every segment: the
    computation there is the segments' GPU time.

    All-reduces on CPU: Note [Polled ends on CPU] and Note [Steps not drawn on CPU] in
    ``host_comm.py``.

Note [Pictures a long job can afford]
    A picture takes 0.1-0.4 s to draw. By default one is drawn when drawing has taken under
    ``PICTURE_SHARE`` of the time spent in steps that compiled nothing: this model's steps,
    not the wall clock, so a loop that does much else between steps (or a benchmark stepping
    several models in turn) does not draw more often than its steps can pay for. Traces:
    Note [Traces a long job can afford] in ``traces.py``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import _torch_compat as compat
from ..errors import ConfigError
from .clock import PendingSpan, PendingStep, PendingSteps, StepTimeline, clock_for
from .figure import gantt_figure
from .host_comm import HostComm
from .instrument import TimedPieces, instrument
from .timeline import Span, comm_figures, fill_gaps
from .traces import TraceFiles

if TYPE_CHECKING:
    from ..runtime.reducer import StepStats

__all__ = ["PICTURE_SHARE", "Telemetry", "require_extra"]

#: With ``figure_every=None`` (the default), at most this share of the time spent in steps
#: that compiled nothing goes to drawing TensorBoard pictures (0.1-0.4 s each; Note [Pictures
#: a long job can afford]).
PICTURE_SHARE = 0.02
#: Each step's scalars are one event, held and handed to TensorBoard's writer thread at most
#: this often (and before any other event, so steps stay in order in the file): the thread
#: then takes the interpreter lock once for many steps, not once a step.
HAND_OVER_S = 1.0

log = logging.getLogger(__name__)


class Telemetry:
    """Per-rank measurement of steps and compiles, written to ``logdir``.

    Attributes:
        timeline: Spans of the open step.
        last_figures: Communication figures of the last step written (``comm_figures``).
    """

    def __init__(
        self,
        *,
        run_dir: str | None,
        trace_dir: str,
        rank: int,
        trace_every: int | None,
        figure_every: int | None,
        device: torch.device | None = None,
        serial_comm: bool = False,
    ) -> None:
        self.rank = rank
        # CPU: host clocks, each step written as it ends. CUDA: events on the streams that
        # run the work, each step written once the GPU has passed its last event.
        self.clock = clock_for(device or torch.device("cpu"))
        self.serial_comm = serial_comm
        self.pending = PendingSteps(self.clock)
        self._open: PendingStep | None = None
        self.figure_every = figure_every
        self.timeline = StepTimeline()
        self.traces = TraceFiles(trace_dir, rank=rank, every=trace_every)
        self.writer = None
        # Every rank checks, so no rank fails alone (the others would wait for it).
        require_extra("wrap(..., logdir=...) writes TensorBoard files (or drop logdir=)")
        if run_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # A deep queue: with the default (10 events) add_scalar blocks on the writer thread.
            self.writer = SummaryWriter(log_dir=run_dir, max_queue=1000, flush_secs=10)
            compat.fast_records(self.writer)  # Note [Event records]
        self._compile_spans: list[Span] = []
        self._compiled_this_step = False
        self._first_warm_step: int | None = None
        self._picture = False  # the open step is to be drawn (``_picture_due``)
        self._warm_s = 0.0  # time in steps that compiled nothing, and in drawing pictures
        self._drawing_s = 0.0
        self.recompiles = 0
        self.graph_breaks: list[str] = []
        self.last_figures: dict[str, float | None] = {}
        self._host = HostComm(self.clock.mark)  # type: ignore[arg-type]  # CPU: all-reduces and waits
        if not self.clock.lazy:  # CPU: the reducer's calls go straight to the record, a frame less each
            self.bucket_launched = self._host.launched  # type: ignore[method-assign]
            self.waited = self._host.waited  # type: ignore[method-assign]
        self.timing = False  # whether this step times each segment (``instrument``)
        self._pieces = TimedPieces(always=self.clock.lazy)
        self._next_step = 0
        self._derived: dict[str, float] = {}
        self._summary: Any = None  # the last step's scalars, and their tags (``_scalars``)
        self._summary_tags: tuple[str, ...] = ()
        # Steps' scalars not yet handed over (``_hand_over``): step, wall time, values.
        self._held: list[tuple[int, float, dict[str, float]]] = []
        self._hand_at = 0.0

    # -- compile side (compile.backend.CompileObserver) ------------------------------------
    def instrument(self, compiled: Callable, graph_id: int) -> Callable:
        """``compiled`` with each segment's forward and backward recorded as compute spans."""
        return instrument(compiled, self, graph_id, self._pieces)

    # -- compile side ------------------------------------------------------------------
    def compiled(
        self,
        *,
        graph_id: int,
        step: int,
        start: float,
        end: float,
        segment_s: Sequence[float],
        plan_table: str,
        breaks: Sequence[str],
        recompile_reasons: Sequence[str],
        cache_hits: int,
        control_plane: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        self._compile_spans.append(
            Span("compile", f"graph {graph_id}", start, end, args={"pieces": len(segment_s)})
        )
        self._compiled_this_step = True
        self.graph_breaks.extend(breaks)
        if recompile_reasons:
            self.recompiles += 1
        w = self.writer
        if w is None:
            return
        self._hand_over()  # the steps before first: events in step order
        w.add_scalar(f"compile/graph_{graph_id}_s", end - start, step)
        for k, s in enumerate(segment_s):
            w.add_scalar(f"compile/graph_{graph_id}_piece_{k}_s", s, step)
        w.add_scalar("compile/recompiles", self.recompiles, step)
        w.add_scalar("compile/graph_breaks", len(self.graph_breaks), step)
        w.add_scalar("compile/cache_hits", cache_hits, step)
        for phase, (ops, nbytes) in (control_plane or {}).items():  # Note [The control plane]
            w.add_scalar(f"control_plane/{phase}_ops", ops, step)
            w.add_scalar(f"control_plane/{phase}_bytes", nbytes, step)
        rows = "\n".join(f"| {line} |" for line in plan_table.splitlines())
        w.add_text(
            f"plan/graph_{graph_id}",
            "| bucket | segment | size | parameters |\n|---|---|---|---|\n" + rows,
            step,
        )
        if breaks:
            w.add_text("compile/graph_breaks", "\n".join(f"- {b}" for b in self.graph_breaks), step)
        if recompile_reasons:
            guards = "\n".join(f"- `{r}`" for r in recompile_reasons)
            w.add_text("compile/recompile_reasons", f"graph {graph_id}, failed guards:\n{guards}", step)
        w.flush()

    # -- step side -----------------------------------------------------------------------
    def _picture_due(self, step: int) -> bool:
        """Whether step ``step`` is to be drawn as a TensorBoard picture (decided as it begins):
        every ``figure_every`` steps from the first that compiled nothing; by default
        (``None``) the first such step, then each step once drawing has taken under
        ``PICTURE_SHARE`` of the time in such steps (Note [Pictures a long job can afford])."""
        if self.writer is None or self.figure_every == 0:
            return False
        if self.figure_every is None:
            return self._drawing_s <= PICTURE_SHARE * self._warm_s
        first = self._first_warm_step
        return first is None or (step - first) % self.figure_every == 0

    def begin_step(self) -> None:
        host = time.perf_counter()
        origin = self.clock.mark() if self.clock.lazy else host  # on CPU: one reading, no shift
        self._open = PendingStep(-1, host, origin, serial_comm=self.serial_comm)
        self.timeline.begin()
        self._host.clear()  # a step that failed mid-way leaves nothing for this one to wait on
        # On CUDA the overlap figures need every segment's span; on CPU only a drawn step does
        # (the thread computes whenever it does not wait: Note [Segment spans on CPU]).
        k = self._next_step
        self._picture = self._picture_due(k)
        self.timing = self.clock.lazy or self._picture or self.traces.due(k)
        self._pieces.use(self.timing)
        self._compiled_this_step = False

    def bucket_launched(self, index: int, nbytes: int, nparams: int, future: torch.futures.Future) -> None:
        # Start: the gradients are in the bucket (on CUDA, the producing stream reached the
        # launch). End: on CUDA, the future's callback, which runs on a stream that waits for
        # the all-reduce, so an event recorded there marks its end on the GPU. On CPU, when
        # the training thread first sees it done (Note [Polled ends on CPU]).
        # (On CPU the instance's own ``bucket_launched`` is ``HostComm.launched``: set in __init__.)
        clock = self.clock
        span = PendingSpan("comm", f"bucket {index}", clock.mark(), None, lane=index)
        span.args.update(bytes=nbytes, params=nparams)
        timeline = self.timeline

        def done(fut: object) -> None:
            span.end = clock.mark()
            timeline.add(span)

        future.then(done)

    def poll(self) -> None:
        """On CPU: end every all-reduce now done (called at each segment's backward end, each
        launch and each wait; Note [Polled ends on CPU])."""
        self._host.poll()

    def waited(self, index: int, start: float, end: float) -> None:
        # Host time: meaningful on CPU only (on CUDA the host does not wait for NCCL), where
        # the instance's own ``waited`` is ``HostComm.waited`` (set in __init__).
        pass

    def _wants_figure(self, step: int, compiled: bool, due: bool) -> bool:
        # A step that compiled (step 0: capture and the lazy backward compile) would show
        # compilation, not training: the first picture is of the first step after warm-up,
        # then every figure_every steps from there. Compile time has its own scalars and
        # the trace's compile track.
        if not due or compiled:
            return False
        if self._first_warm_step is None:
            self._first_warm_step = step
        return True

    def end_step(self, stats: StepStats) -> dict[str, float]:
        """Queue the step; write every queued step whose times can be read (on CPU: this one).

        Returns the figures of the newest step written so far (``timed_step`` says which).
        """
        step = self._open
        assert step is not None, "end_step without begin_step"
        if not self._compiled_this_step:
            self._warm_s += time.perf_counter() - step.host_origin
        drawn = self.timing or self.traces.due(stats.step)
        self.timing, self._next_step, self._open = False, stats.step + 1, None
        self._pieces.use(False)
        if not self.clock.lazy:
            self._host.finish()
            if not drawn:  # Note [Steps not drawn on CPU]
                self.timeline.finish()
                figures = self._host.figures()
                self._derived = self._write_figures(stats, figures, self._host.lane_ms())
                return dict(self._derived)
            for span in self._host.spans():
                self.timeline.add(span)
        step.step, step.end, step.spans = stats.step, self.clock.mark(), self.timeline.finish()
        step.extra = (stats, self._compiled_this_step, self._picture)
        self.pending.push(step)
        return self._write_ready(wait=False)

    def _write_ready(self, *, wait: bool) -> dict[str, float]:
        for step, spans in self.pending.ready(wait=wait):
            stats, compiled, picture = step.extra  # type: ignore[misc]
            self._derived = self._write_step(stats, compiled, list(spans), step.host_origin, picture)
        return dict(self._derived)

    def _computation(self, spans: list[Span]) -> tuple[list[Span], list[tuple[float, float]]]:
        """``spans`` plus, on a drawn CPU step, spans for the host's work outside compiled
        segments; and the intervals that count as computation for the overlap figures.

        On CPU the training thread is the compute engine: inside the step, whenever it is
        not blocked on communication, it computes (eager code, Python, autograd, bucket
        copies, an optimizer in backward). On CUDA only timed segments count.
        """
        step = next((s for s in spans if s.track == "step"), None)
        compute = sorted((s for s in spans if s.track == "compute"), key=lambda s: s.start)
        intervals = [(s.start, s.end) for s in compute]
        if self.clock.lazy or step is None:
            return spans, intervals
        waits = [(s.start, s.end) for s in spans if s.track == "wait"]
        gaps = fill_gaps(intervals, (step.start, step.end), waits)
        if not compute:  # a step not drawn: no segment timed, no span to name
            return spans, gaps
        starts = [s.start for s in compute]
        filled = []
        for lo, hi in gaps:
            k = bisect.bisect_left(starts, hi)  # the first segment starting at or after the gap
            name = f"eager before {compute[k].name}" if k < len(compute) else "eager after segments"
            filled.append(Span("compute", name, lo, hi, args={"outside": "compiled segments"}))
        return spans + filled, intervals + gaps

    def _write_step(
        self, stats: StepStats, compiled: bool, spans: list[Span], origin: float, picture: bool = False
    ) -> dict:
        spans, computing = self._computation(spans)
        figures = comm_figures([(s.start, s.end) for s in spans if s.track == "comm"], computing)
        shown = {k: round(v, 3) for k, v in figures.items() if v is not None}
        for s in spans:
            if s.track == "step":
                s.args.update(shown, wait_ms=round(stats.wait_ms, 3))
        lanes = {s.lane: (s.end - s.start) * 1e3 for s in spans if s.track == "comm"}
        derived = self._write_figures(stats, figures, lanes)
        w = self.writer
        if self.traces.due(stats.step):
            self.traces.write(self._compile_spans + spans, stats.step, origin)
            self._compile_spans = []
        if w is not None and self._wants_figure(stats.step, compiled, picture):
            drawing = time.perf_counter()
            pct = figures["overlap_pct"]
            fig = gantt_figure(
                spans,
                title=f"rank {self.rank}, step {stats.step}: overlap "
                f"{'-' if pct is None else f'{pct:.0f}%'}, exposed comm {figures['exposed_ms']:.1f} ms",
                origin=origin,
            )
            self._hand_over()
            w.add_figure("timeline/step", fig, stats.step, close=True)
            self._drawing_s += time.perf_counter() - drawing
        return derived

    def _write_figures(self, stats: StepStats, figures: dict, lane_ms: Mapping[int, float]) -> dict:
        """Keep a step's figures and write its scalars; returns what ``end_step`` reports."""
        self.last_figures = figures
        if self.writer is not None:
            values = {
                "step/time_ms": stats.fwd_bwd_ms,
                "step/wait_ms": stats.wait_ms,
                "comm/megabytes": stats.bytes / 2**20,
                "comm/tail_megabytes": stats.tail_bytes / 2**20,
                **{f"step/{k}": v for k, v in figures.items() if v is not None},
                **{f"comm/bucket_{lane}_ms": ms for lane, ms in lane_ms.items()},
            }
            self._scalars(values, stats.step)
        return {**figures, "timed_step": stats.step}

    def _scalars(self, values: dict[str, float], step: int) -> None:
        # Kept as numbers; made into events when handed over (``_hand_over``).
        self._held.append((step, time.time(), values))
        if time.perf_counter() >= self._hand_at:
            self._hand_over()

    def _hand_over(self) -> None:
        """Queue the held steps' scalars to the writer thread, one event a step (``HAND_OVER_S``).

        One event holds every scalar of a step: a tenth of the cost of one ``add_scalar`` call
        per tag, and read back by TensorBoard exactly the same way. The same tags step after
        step: the last step's message with its values replaced (a fifth of building one; the
        event copies it). Made here, a second's steps together, rather than in each step: on
        the proxy of ``distcompile bench --host-overhead`` 17 us a step, against 73 us made in
        the step (where each step's own work has left the caches cold).
        """
        if self._held:
            events = []
            for step, wall_time, values in self._held:
                tags = tuple(values)
                if tags != self._summary_tags:
                    from tensorboard.compat.proto.summary_pb2 import Summary

                    self._summary = Summary(value=[Summary.Value(tag=k) for k in tags])
                    self._summary_tags = tags
                for value, v in zip(self._summary.value, values.values()):
                    value.simple_value = float(v)
                events.append(compat.summary_event(self._summary, step, wall_time))
            compat.write_events(self.writer, events)
            self._held = []
        self._hand_at = time.perf_counter() + HAND_OVER_S

    def close(self) -> None:
        """Write the steps still queued (on CUDA this waits for their events), then close the files."""
        self._write_ready(wait=True)
        if self.writer is not None:
            self._hand_over()
            self.writer.flush()
            self.writer.close()
            self.writer = None


def require_extra(purpose: str) -> None:
    """Raise a ``ConfigError`` naming the ``telemetry`` extra if TensorBoard or matplotlib is missing.

    Example:
        >>> require_extra("wrap(..., logdir=...) writes TensorBoard files")  # both installed: no error
    """
    try:
        import matplotlib  # noqa: F401 - the Gantt figures
        import tensorboard  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"{purpose}, but {exc.name or 'a dependency'} is not installed. Install the telemetry "
            "extra: pip install 'distcompile[telemetry]' (TensorBoard and matplotlib)."
        ) from exc
