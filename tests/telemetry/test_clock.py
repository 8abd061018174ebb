"""Step timelines through the clocks: host times pass unchanged; device times are read late, in order."""

from __future__ import annotations

import tempfile
import time

import pytest
import torch

from distcompile.runtime.reducer import StepStats
from distcompile.telemetry.clock import HostClock, PendingSpan, PendingStep, PendingSteps, clock_for
from distcompile.telemetry.sink import Telemetry


class _DeviceLikeClock:
    """Marks that become readable only when the test says the device got there.

    Stands in for CUDA events (no GPU here): what is under test is the queue that waits
    for them, not the events.
    """

    lazy = True

    def __init__(self) -> None:
        self.now = 0.0
        self.reached = 0.0
        self.waits = 0
        self.released: list[float] = []

    def mark(self) -> float:
        self.now += 1.0
        return self.now

    def done(self, mark: float) -> bool:
        return mark <= self.reached

    def wait(self, mark: float) -> None:
        self.waits += 1
        self.reached = max(self.reached, mark)

    def seconds(self, origin: float, mark: float) -> float:
        return (mark - origin) / 1e3  # one mark = 1 ms of device time

    def release(self, marks: list[float]) -> None:
        self.released += marks


def test_host_clock_spans_keep_their_times() -> None:
    c = HostClock()
    step = PendingStep(3, 10.0, 10.0, 10.5)
    step.spans = [
        PendingSpan("compute", "g0.s0 fwd", 10.1, 10.2),
        PendingSpan("comm", "bucket 0", 10.3, 10.4),
    ]
    spans = step.resolve(c)
    assert [(s.track, s.start, s.end) for s in spans] == [
        ("compute", 10.1, 10.2),
        ("comm", 10.3, 10.4),
        ("step", 10.0, 10.5),
    ]
    assert spans[-1].name == "step 3"


def test_serial_comm_starts_each_all_reduce_after_the_previous() -> None:
    # Ready at 1 and 2 ms, the first ends at 5: on one stream the second runs 5..7, not 2..7.
    step = PendingStep(0, 0.0, 0.0, 0.010, serial_comm=True)
    step.spans = [
        PendingSpan("comm", "bucket 0", 0.001, 0.005),
        PendingSpan("comm", "bucket 1", 0.002, 0.007),
    ]
    comm = [(s.start, s.end) for s in step.resolve(HostClock()) if s.track == "comm"]
    assert comm == [(0.001, 0.005), (0.005, 0.007)]


def test_spans_recorded_under_graph_capture_are_dropped() -> None:
    step = PendingStep(0, 0.0, 0.0, 1.0, spans=[PendingSpan("compute", "x", None, 0.5)])
    assert [s.track for s in step.resolve(HostClock())] == ["step"]


def test_pending_steps_come_out_in_order_once_the_device_passed_them() -> None:
    c = _DeviceLikeClock()
    q = PendingSteps(c, limit=3)
    for k in range(3):
        q.push(PendingStep(k, float(k), c.mark(), c.mark()))
    assert q.ready() == [] and len(q) == 3  # nothing reached yet: nothing read, nothing waited
    c.reached = 4.0  # the device finished steps 0 and 1
    assert [p.step for p, _ in q.ready()] == [0, 1] and c.waits == 0
    q.push(PendingStep(3, 3.0, c.mark(), c.mark()))
    q.push(PendingStep(4, 4.0, c.mark(), c.mark()))
    q.push(PendingStep(5, 5.0, c.mark(), c.mark()))
    # Four held, over the limit of three: the oldest is waited for, the rest stay queued.
    assert [p.step for p, _ in q.ready()] == [2] and c.waits == 2  # its two marks
    assert len(q) == 3
    assert [p.step for p, _ in q.ready(wait=True)] == [3, 4, 5] and len(q) == 0


def test_marks_go_back_to_the_clock_once_each_after_their_step_is_read() -> None:
    # CudaClock records a released event again: a mark released before its step is read,
    # or twice (a span that starts and ends at one mark), would time two things at once.
    c = _DeviceLikeClock()
    q = PendingSteps(c)
    shared = c.mark()
    step = PendingStep(
        0, 0.0, c.mark(), c.mark(), spans=[PendingSpan("compute", "g0.s0 bwd", shared, shared)]
    )
    q.push(step)
    assert q.ready() == [] and c.released == []  # not read yet: nothing goes back
    c.reached = c.now
    assert [p.step for p, _ in q.ready()] == [0]
    assert sorted(c.released) == sorted([step.origin, step.end, shared])


def test_telemetry_on_a_late_clock_reports_the_newest_finished_step(tmp_path) -> None:
    tele = Telemetry(
        run_dir=str(tmp_path / "run"),
        trace_dir=str(tmp_path / "traces"),
        rank=0,
        trace_every=1,
        figure_every=0,
    )
    c = tele.clock = _DeviceLikeClock()
    tele.pending = PendingSteps(c)
    figures = []
    for k in range(3):
        tele.begin_step()  # six marks a step: begin, 4 span ends, end
        bwd = PendingSpan("compute", "g0.s0 bwd", c.mark(), None)
        comm = PendingSpan("comm", "bucket 0", c.mark(), None)
        bwd.end = c.mark()
        comm.end = c.mark()  # 1 ms of its 2 ms overlapped the backward
        tele.timeline.add(bwd)
        tele.timeline.add(comm)
        c.reached = 6.0 * k  # the device finished the step before this one
        figures.append(tele.end_step(StepStats(step=k, fwd_bwd_ms=5.0)))
    assert figures[0] == {}  # nothing finished yet
    assert figures[1]["timed_step"] == 0 and figures[2]["timed_step"] == 1
    assert figures[2]["overlap_pct"] == pytest.approx(50.0)
    # GPU time: 1 ms of the 2 ms all-reduce under the backward, 1 ms that no compute hid.
    assert figures[2]["comm_ms"] == pytest.approx(2.0)
    assert figures[2]["overlapped_ms"] == pytest.approx(1.0) and figures[2]["exposed_ms"] == pytest.approx(
        1.0
    )
    assert not (tmp_path / "traces" / "trace_rank0_step2.json").exists()
    tele.close()  # waits for the last step and writes it
    assert (tmp_path / "traces" / "trace_rank0_step2.json").exists()


def test_clock_for_cpu_is_the_host_clock() -> None:
    assert isinstance(clock_for(torch.device("cpu")), HostClock)


class _NoCallbacks(torch.futures.Future):
    """An all-reduce's future that fails the test if a Python callback is chained to it."""

    def then(self, callback):  # noqa: ANN001, ANN201
        raise AssertionError("telemetry chained a Python callback to a CPU all-reduce")

    def add_done_callback(self, callback):  # noqa: ANN001, ANN201
        raise AssertionError("telemetry chained a Python callback to a CPU all-reduce")


def test_cpu_telemetry_polls_all_reduce_ends_and_times_segments_only_in_drawn_steps() -> None:
    # Note [Polled ends on CPU], Note [Segment spans on CPU]
    tele = Telemetry(run_dir=None, trace_dir=tempfile.mkdtemp(), rank=0, trace_every=3, figure_every=0)
    timing = []
    for k in range(4):
        tele.begin_step()
        timing.append(tele.timing)
        seen, waited = _NoCallbacks(), _NoCallbacks()
        tele.bucket_launched(0, 8, 1, seen)
        tele.bucket_launched(1, 8, 1, waited)
        time.sleep(0.002)  # the backward computes while both are in flight
        seen.set_result(None)
        tele.poll()  # a segment's backward ends: bucket 0 is seen done
        t0 = time.perf_counter()
        time.sleep(0.001)
        waited.set_result(None)
        t1 = time.perf_counter()
        tele.waited(1, t0, t1)  # bucket 1: ends when its wait returned
        figures = tele.end_step(StepStats(step=k, fwd_bwd_ms=5.0))
        assert figures["timed_step"] == k
        assert figures["exposed_ms"] == pytest.approx(1e3 * (t1 - t0))  # only the wait was exposed
        assert figures["overlapped_ms"] >= 2.0 and figures["comm_ms"] == pytest.approx(
            figures["overlapped_ms"] + figures["exposed_ms"]
        )
    assert timing == [True, False, False, True]  # traced: steps 0 and 3
    tele.close()


def test_default_pictures_take_at_most_their_share_of_the_time(tmp_path) -> None:
    # figure_every=None: the first step after warm-up, then each step once drawing has taken
    # under PICTURE_SHARE of the time since; an explicit figure_every keeps its cadence.
    drawn = {}
    for every in (None, 1):
        tele = Telemetry(
            run_dir=str(tmp_path / f"run{every}"), trace_dir=str(tmp_path / "t"), rank=0, trace_every=0,
            figure_every=every,
        )  # fmt: skip
        steps = []
        for k in range(4):
            tele.begin_step()
            steps.append(tele._picture)
            tele.end_step(StepStats(step=k, fwd_bwd_ms=1.0))
        drawn[every] = steps
        tele.close()
    assert drawn[None] == [True, False, False, False], "drawn at step 0, then not within 50x its cost"
    assert drawn[1] == [True, True, True, True]
