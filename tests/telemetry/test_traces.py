"""Which steps a rank traces, and which of its trace files a long job leaves behind."""

from __future__ import annotations

import json

from distcompile.runtime.reducer import StepStats
from distcompile.telemetry.sink import Telemetry
from distcompile.telemetry.timeline import Span
from distcompile.telemetry.traces import FIRST_TRACES, TRACE_PERIOD, TRACES_KEPT, TraceFiles


def _steps(folder) -> list[int]:
    return sorted(int(p.stem.rsplit("step", 1)[1]) for p in folder.glob("trace_rank0_step*.json"))


def test_the_default_keeps_the_first_traces_and_the_newest(tmp_path) -> None:
    # Note [Traces a long job can afford]: 25 periods of a long job leave 12 files.
    files = TraceFiles(str(tmp_path), rank=0, every=None)
    written = [s for s in range(25 * TRACE_PERIOD + 1) if files.due(s)]
    assert written[:3] == [0, FIRST_TRACES[1], TRACE_PERIOD]
    for s in written:
        files.write([Span("compute", "g0.s0 fwd", 1.0 + s, 2.0 + s)], s, 1.0 + s)
    newest = written[-TRACES_KEPT:]
    assert _steps(tmp_path) == [*FIRST_TRACES, *newest]
    doc = json.loads((tmp_path / f"trace_rank0_step{newest[-1]}.json").read_text())
    assert any(e.get("name") == "g0.s0 fwd" for e in doc["traceEvents"])
    assert not list(tmp_path.glob("*.tmp"))


def test_a_trace_every_given_keeps_every_file(tmp_path) -> None:
    files = TraceFiles(str(tmp_path), rank=0, every=3)
    for s in range(40):
        if files.due(s):
            files.write([], s, 0.0)
    assert _steps(tmp_path) == list(range(0, 40, 3))
    assert not TraceFiles(str(tmp_path / "off"), rank=0, every=0).due(0)


def test_default_telemetry_times_and_traces_the_same_steps_on_every_rank(tmp_path) -> None:
    # The steps follow the step number, so ranks' files of one step are compared side by side.
    timed = {}
    for rank in (0, 1):
        tele = Telemetry(run_dir=None, trace_dir=str(tmp_path), rank=rank, trace_every=None, figure_every=0)
        timed[rank] = []
        for k in range(12):
            tele.begin_step()
            timed[rank].append(tele.timing)
            tele.end_step(StepStats(step=k, fwd_bwd_ms=1.0))
        tele.close()
    assert timed[0] == timed[1] == [k in FIRST_TRACES for k in range(12)]
    for rank in (0, 1):
        assert sorted(p.name for p in tmp_path.glob(f"trace_rank{rank}_*.json")) == [
            f"trace_rank{rank}_step{s}.json" for s in sorted(map(str, FIRST_TRACES))
        ]
