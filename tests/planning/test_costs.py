"""Cost measurement for bucket_cap_mb='auto' on a one-rank gloo group: fitting, snapping, remembering."""

from __future__ import annotations

import json

import pytest
import torch

from distcompile.planning.costs import CostModel, fit_line, snap
from distcompile.runtime.measure import _remembered, measure_costs

CPU = torch.device("cpu")


def test_fit_line_recovers_latency_and_bandwidth() -> None:
    sizes = (64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
    latency, per_byte = fit_line(sizes, [3e-4 + b / 1.25e8 for b in sizes])
    assert latency == pytest.approx(3e-4) and 1 / per_byte == pytest.approx(1.25e8)
    # Noise that makes the line fall or cross below zero is clamped to something physical.
    latency, per_byte = fit_line(sizes, [5e-3, 1e-3, 1e-3])
    assert latency >= 1e-5 and per_byte > 0


def test_snap_is_stable_within_a_few_percent() -> None:
    assert snap(1.0e8) == snap(1.03e8)
    assert snap(1.0e8) != snap(1.5e8)
    assert 0.9 < snap(1.0e8) / 1.0e8 < 1.1


def test_measure_costs_remembers(single_rank_group, tmp_path) -> None:
    got = measure_costs(group=None, device=CPU, remember_dir=str(tmp_path / "mem"))
    assert got.bytes_per_s > 1e6 and got.flops_per_s > 1e6 and got.latency_s > 0
    (path,) = (tmp_path / "mem").glob("costs-world1-cpu.json")
    assert json.loads(path.read_text())["flops_per_s"] == got.flops_per_s


def test_remembered_costs_are_reused_while_close(single_rank_group, tmp_path) -> None:
    path = str(tmp_path / "mem" / "costs.json")
    first = CostModel(latency_s=2e-4, bytes_per_s=1.2e8, flops_per_s=7e10)
    assert _remembered(first, group=None, device=CPU, path=path) == first  # nothing yet: stored
    wobble = CostModel(latency_s=4e-4, bytes_per_s=1.0e8, flops_per_s=5e10)
    assert _remembered(wobble, group=None, device=CPU, path=path) == first  # same plan as before
    moved = CostModel(latency_s=2e-4, bytes_per_s=2.5e7, flops_per_s=7e10)  # a 5x slower link
    assert _remembered(moved, group=None, device=CPU, path=path) == moved
    assert json.loads(open(path).read())["bytes_per_s"] == 2.5e7
    with open(path, "w") as f:
        f.write("{not json")
    assert _remembered(first, group=None, device=CPU, path=path) == first


def test_graph_costs_convert_flops_to_backward_seconds() -> None:
    costs = CostModel(latency_s=1e-4, bytes_per_s=1e8, flops_per_s=1e10).graph_costs([1e9, 0.0])
    assert costs.node_backward_s == (0.2, 0.0) and costs.bytes_per_s == 1e8


def test_the_compute_rate_is_measured_with_every_rank_computing() -> None:
    """More ranks than cores (8 on 2 in the bench's multi-node run): each rank computes at a
    share of a core, and the planner must price backward at that rate, not at a lone rank's."""
    import os

    from tests import workers
    from tests.harness import run_ranks

    cores = len(os.sched_getaffinity(0))
    if cores > 2:
        pytest.skip(f"needs more ranks than cores; this machine has {cores} cores for 4 ranks")
    # 4 ranks on 2 cores compute at about half a lone rank's rate; under the suite's other
    # worker a lone rank is slowed too (0.80x measured once under -n 2, 0.5x alone), and
    # when that worker's load falls on the lone rank's measurement and not on the four's,
    # the two come out alike (1.01x seen once): up to three tries.
    tries = []
    for _ in range(3):
        results = run_ranks(workers.compute_rate_together_and_alone, 4, timeout=120)
        together = {r["together"] for r in results}
        assert len(together) == 1, together  # agreed: the slowest rank's
        tries.append(together.pop() / results[0]["alone"])
        if tries[-1] < 0.9:
            return
    pytest.fail(f"together / alone in each try: {[round(t, 2) for t in tries]} (expected < 0.9)")
