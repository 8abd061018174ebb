"""A CPU step not drawn (Note [Steps not drawn on CPU]) gives the figures and scalars a drawn one does."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distcompile.runtime.stats import StepStats
from distcompile.telemetry.sink import Telemetry


def _future(done: bool) -> torch.futures.Future:
    f: torch.futures.Future = torch.futures.Future()
    if done:
        f.set_result(None)
    return f


def _one_step(telemetry: Telemetry, now: list[float]) -> dict:
    """Two buckets: 0 seen done at 1's launch, 1 ended by a wait; the clock is ``now[0]``."""
    now[0] = 0.0
    telemetry.begin_step()
    first, second = _future(False), _future(False)
    now[0] = 1.0
    telemetry.bucket_launched(0, 64, 2, first)
    first.set_result(None)
    now[0] = 2.0
    telemetry.bucket_launched(1, 32, 1, second)
    now[0] = 3.0
    telemetry.poll()  # a segment's backward ended: bucket 1 still flying
    second.set_result(None)
    telemetry.waited(1, 3.5, 4.0)
    now[0] = 5.0
    stats = StepStats(step=0, fwd_bwd_ms=5000.0, buckets=2, bytes=96, wait_ms=500.0)
    return telemetry.end_step(stats)


def test_a_step_not_drawn_has_the_figures_and_scalars_of_a_drawn_one(tmp_path: Path, monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    drawn = Telemetry(run_dir=str(tmp_path / "drawn"), trace_dir=str(tmp_path / "t1"), rank=0,
                      trace_every=1, figure_every=0)  # fmt: skip
    plain = Telemetry(run_dir=str(tmp_path / "plain"), trace_dir=str(tmp_path / "t2"), rank=0,
                      trace_every=0, figure_every=0)  # fmt: skip
    got = {name: _one_step(t, now) for name, t in (("drawn", drawn), ("plain", plain))}
    for t in (drawn, plain):
        t.close()
    # Computation: the step (0-5 s) less the wait (3.5-4); all-reduces 1-2 and 2-4.
    want = {"comm_ms": 3000.0, "overlapped_ms": 2500.0, "exposed_ms": 500.0, "overlap_pct": 250 / 3}
    for name, derived in got.items():
        assert {k: derived[k] for k in want} == pytest.approx(want), name
    assert list((tmp_path / "t1").glob("*.json")) and not list((tmp_path / "t2").glob("*.json"))
    boards = {}
    for name in got:
        acc = EventAccumulator(str(tmp_path / name), size_guidance={"scalars": 0})
        acc.Reload()
        boards[name] = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert boards["plain"] == boards["drawn"]
    assert boards["plain"]["comm/bucket_0_ms"] == [1000.0] and boards["plain"]["comm/bucket_1_ms"] == [2000.0]


class _TwoPieces(torch.nn.Module):
    """Stands in for a split graph: its children carry the names the compiled pieces have."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled_submod_0 = torch.nn.Linear(2, 2)
        self.compiled_submod_1 = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compiled_submod_1(self.compiled_submod_0(x))


def test_steps_not_drawn_run_the_pieces_themselves(tmp_path: Path) -> None:
    # Note [Segment spans on CPU]: a stand-in timing a piece is in place only in a drawn step.
    tele = Telemetry(run_dir=None, trace_dir=str(tmp_path), rank=0, trace_every=2, figure_every=0)
    graph = tele.instrument(torch.fx.symbolic_trace(_TwoPieces()), 0)
    plain = [graph.compiled_submod_0, graph.compiled_submod_1]
    seen = []
    for k in range(4):
        tele.begin_step()
        seen.append([type(graph.get_submodule(f"compiled_submod_{i}")).__name__ for i in range(2)])
        graph(torch.ones(1, 2)).sum().backward()
        tele.end_step(StepStats(step=k, fwd_bwd_ms=1.0))
        assert [graph.compiled_submod_0, graph.compiled_submod_1] == plain  # after the step: themselves
    assert seen == [["_TimedPiece"] * 2, ["Linear"] * 2] * 2
    for k in (0, 2):  # traced: each piece's forward and backward
        doc = json.loads((tmp_path / f"trace_rank0_step{k}.json").read_text())
        names = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "compute"}
        assert {"g0.s0 fwd", "g0.s1 fwd", "g0.s0 bwd", "g0.s1 bwd"} <= names, names
    assert not (tmp_path / "trace_rank0_step1.json").exists()
    tele.close()
