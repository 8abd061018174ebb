"""The chaos run: its schedule, its reading of the event logs, its figures; and a short run
for real in the long set (2 nodes of 2 ranks in namespaces, one fault of each kind)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos.figures import figures
from benchmarks.chaos.monitor import Monitor
from benchmarks.chaos.schedule import KINDS, RESTARTING, make_schedule, steps_needed
from distcompile import _events
from distcompile.tools.bench.netns import can_make_namespaces
from tests.harness import child_env


def test_schedule_is_seeded_covers_every_kind_and_always_passes_a_checkpoint() -> None:
    a = make_schedule(7, 20, nodes=4, ranks_per_node=2, ckpt_every=4)
    assert a == make_schedule(7, 20, nodes=4, ranks_per_node=2, ckpt_every=4)
    assert a != make_schedule(8, 20, nodes=4, ranks_per_node=2, ckpt_every=4)
    assert {f.kind for f in a[: len(KINDS)]} == set(KINDS)
    assert all(f.gap > 4 and 0 <= f.node < 4 and 0 <= f.worker < 2 for f in a)
    stalls = [f.seconds for f in a if f.kind == "stall"]
    assert stalls[0] == 30.0 and all(s < 30 for s in stalls[1:])
    links = sum(f.gap for f in a if f.kind == "bad_link")
    assert steps_needed(a, tail=8) == sum(f.gap + 1 for f in a) + links + 8
    assert RESTARTING == set(KINDS) - {"stall", "bad_link"}
    with pytest.raises(ValueError, match="nodes >= 2"):
        make_schedule(0, 3, nodes=1, ranks_per_node=2, ckpt_every=4)


def _write(path: Path, *events: dict) -> None:
    with path.open("a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def test_monitor_follows_lives_resumes_and_steps_across_nodes(tmp_path: Path) -> None:
    n0, n1 = tmp_path / "n0.jsonl", tmp_path / "n1.jsonl"
    start = {"kind": "start", "world": 4}
    _write(
        n0,
        {**start, "t": 1.0, "life": "a", "rank": 0, "pid": 10},
        {"t": 2.0, "kind": "step", "life": "a", "n": 1},
    )
    _write(
        n1,
        {**start, "t": 1.1, "life": "a", "rank": 2, "pid": 12},
        {"t": 2.1, "kind": "step", "life": "a", "n": 1},
    )
    mon = Monitor([str(n0), str(n1), str(tmp_path / "absent")])
    mon.poll()
    assert mon.current().life == "a" and mon.current().pids == {0: 10, 2: 12}
    assert mon.last_step() == (2.0, 0)  # step 0 of a fresh start, counted once for both nodes
    # A second life resumes from the checkpoint of step 7; a line cut by a kill is not read yet.
    _write(n0, {**start, "t": 5.0, "life": "b", "rank": 0, "pid": 20})
    _write(n0, {"t": 5.1, "kind": "resumed", "life": "b", "step": 7})
    _write(n0, {"t": 5.2, "kind": "compiled", "life": "b", "sources": {"compiled here": 2, "cache": 1}})
    with n0.open("a") as f:
        f.write('{"t": 6.0, "kind": "step", "life": "b", "n": 1}\n{"t": 6.5, "kind": "st')
    mon.poll()
    life = mon.current()
    assert life.life == "b" and life.resumed == 7 and life.steps == [(6.0, 8)]
    assert life.compiled_here == {0: 2}
    with n0.open("a") as f:
        f.write('ep", "life": "b", "n": 2}\n')
    mon.poll()
    assert mon.last_step() == (6.5, 9)


def test_figures_count_survivals_restarts_and_compiles_on_warm_nodes() -> None:
    records = [
        {"kind": "stall", "recovered": True, "fault_to_step_s": 31.0},
        {"kind": "kill_worker", "recovered": True, "resumed": 7, "resumed_newest": True, "recomputed": 3,
         "fault_to_step_s": 20.0, "compiled_here": {"0": 0, "1": 0}},
        {"kind": "empty_cache", "recovered": True, "resumed": 11, "resumed_newest": False, "recomputed": 2,
         "fault_to_step_s": 90.0, "compiled_here": {"0": 1, "1": 4}, "emptied_node": 1},
        {"kind": "kill_worker", "outcome": "hang: no new life of the process group"},
    ]  # fmt: skip
    ref = {"digests": {0: "1.5", 1: "1.5"}, "first_step_s": 30.0, "step_s": 0.5}
    fig = figures(
        records, reference=ref, chaos={"digests": {0: "1.5", 1: "1.5"}, "orphans": [4], "exit_codes": [0]}
    )
    assert (
        fig["survived"] == 2 and fig["hangs"] == 1 and fig["restarts"] == 2
    )  # a stale resume is no survival
    assert fig["survived_by_kind"] == {"stall": 1, "kill_worker": 1}
    assert fig["compiles_at_restart_warm_nodes"] == 1 and fig["compiles_at_restart_emptied_nodes"] == 4
    assert fig["restart_bound"]["within"] == 1  # 90 s > 2 x (30 + 2 x 0.5)
    assert fig["fault_to_step_s"] == {"median": 31.0, "max": 90.0}
    assert fig["bitwise_equal"] and fig["orphans"] == 1
    assert not figures([], reference={**ref, "digests": {}}, chaos={"digests": {}})["bitwise_equal"]


def test_event_log_and_its_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(_events.ENV, str(path))
    monkeypatch.setattr(_events, "_life", {})
    _events.emit("start", rank=0, world=2, life="first")
    _events.emit("error", error="CommunicationError", message="rank 0: step 4, bucket 1: a peer died")
    monkeypatch.setattr(_events, "_life", {})
    _events.emit("start", rank=0, world=2, life="second")
    _events.emit("resumed", step=3, path="ckpt/step-00000003.pt")
    _events.emit("close", steps=5)
    with path.open("a") as f:
        f.write('{"t": 1e12, "kind": "st')  # cut by a kill
    events = _events.read([str(path)])
    assert [e["kind"] for e in events] == ["start", "error", "start", "resumed", "close"]
    assert events[1]["life"] == "first" and events[1]["rank"] == 0 and events[0]["restart"] == 0
    text = _events.summary([str(path)])
    assert text.splitlines()[0] == (
        "distcompile: 2 lives of the process group: recovered from 1 failure(s); the last life closed normally"
    )
    assert "rank 0: CommunicationError: rank 0: step 4, bucket 1: a peer died" in text
    assert "resumed from ckpt/step-00000003.pt" in text
    # The first life died before a step: not called "started fresh" (it may have been loading one).
    assert "life 1: 2 ranks, no checkpoint loaded and no step seen" in text, text
    monkeypatch.delenv(_events.ENV)
    _events.emit("step", n=1)  # off: nothing written
    assert len(_events.read([str(path)])) == 5


@pytest.mark.long  # two jobs of 4 ranks on 2 namespaces, one fault of each kind: ~6 minutes
def test_short_chaos_run_loses_nothing(tmp_path: Path) -> None:
    reason = can_make_namespaces()
    if reason:
        pytest.skip(f"cannot create network namespaces here: {reason}")
    cmd = [
        sys.executable,
        str(Path(__file__).parents[2] / "benchmarks" / "run_chaos.py"),
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
    ]
    cmd += ["--faults", "6", "--long-stall", "10", "--out-dir", str(tmp_path), "--name", "chaos"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=child_env())
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "chaos.json").read_text())
    fig = data["figures"]
    assert fig["survived"] == fig["faults"] == 6 and sorted(fig["by_kind"]) == sorted(KINDS), fig
    assert fig["bitwise_equal"] and fig["hangs"] == 0 and fig["orphans"] == 0, fig
    assert fig["compiles_at_restart_warm_nodes"] == 0, fig
    assert all(r["resumed_newest"] for r in data["faults"] if "resumed" in r), data["faults"]
