"""The communication figures on synthetic timelines with known answers (times in seconds)."""

from __future__ import annotations

import pytest
import torch

from distcompile.telemetry.timeline import comm_figures, describe_figures, fill_gaps, mean_figures


def _ms(f: dict) -> tuple:
    return tuple(
        None if f[k] is None else round(f[k], 9)
        for k in ("comm_ms", "overlapped_ms", "exposed_ms", "overlap_pct")
    )


def test_two_buckets_in_flight_at_once_count_once() -> None:
    # Buckets 0 and 1 overlap each other from 2 to 3 ms: communication is 0-5 ms, not 6.
    comm = [(0.000, 0.003), (0.002, 0.005)]
    compute = [(0.001, 0.004)]
    assert _ms(comm_figures(comm, compute)) == (5.0, 3.0, 2.0, 60.0)


def test_compute_spans_that_touch_or_overlap_are_merged() -> None:
    comm = [(0.0, 0.010)]
    compute = [(0.000, 0.002), (0.002, 0.004), (0.003, 0.006), (0.008, 0.020)]
    assert _ms(comm_figures(comm, compute)) == (10.0, 8.0, 2.0, 80.0)


def test_fully_hidden_fully_exposed_and_nothing_sent() -> None:
    assert _ms(comm_figures([(1.0, 1.002)], [(0.0, 5.0)])) == (2.0, 2.0, 0.0, 100.0)
    assert _ms(comm_figures([(1.0, 1.002)], [(0.0, 0.5), (2.0, 3.0)])) == (2.0, 0.0, 2.0, 0.0)
    assert _ms(comm_figures([], [(0.0, 1.0)])) == (0.0, 0.0, 0.0, None)  # no overlap % of nothing


def _covered(t: torch.Tensor, spans: list[tuple[float, float]]) -> torch.Tensor:
    return torch.stack([(t >= s) & (t < e) for s, e in spans]).any(0)


def test_many_random_timelines_add_up() -> None:
    import random

    rng = random.Random(0)
    for _ in range(200):
        comm = [(a, a + rng.random()) for a in (rng.random() * 10 for _ in range(rng.randint(1, 6)))]
        compute = [(a, a + rng.random()) for a in (rng.random() * 10 for _ in range(rng.randint(0, 8)))]
        f = comm_figures(comm, compute)
        assert f["overlapped_ms"] + f["exposed_ms"] == pytest.approx(f["comm_ms"], rel=1e-12)
        # Brute force on a 0.1 ms grid agrees with the interval arithmetic (to the grid's
        # error: one step per interval end).
        t = torch.arange(0, 11, 1e-4, dtype=torch.float64)
        both = (_covered(t, comm) & _covered(t, compute)).sum().item() * 1e-4 * 1e3 if compute else 0.0
        assert f["overlapped_ms"] == pytest.approx(both, abs=0.1 * 2 * (len(comm) + len(compute)))


def test_gaps_outside_compute_and_waits_are_filled() -> None:
    # Step 0-10; segments 1-2 and 5-6; the host waited 7-9: the host computed 0-1, 2-5, 6-7, 9-10.
    assert fill_gaps([(1, 2), (5, 6)], (0, 10), [(7, 9)]) == [(0, 1), (2, 5), (6, 7), (9, 10)]
    assert fill_gaps([(0, 10)], (0, 10), []) == []
    assert fill_gaps([(-1, 3)], (0, 4), [(3.5, 6)]) == [(3, 3.5)]  # clipped to the window


def test_means_keep_the_sum_and_dash_what_was_not_measured() -> None:
    steps = [
        {"comm_ms": 10.0, "overlapped_ms": 2.0, "exposed_ms": 8.0, "wait_ms": 9.0},
        {"comm_ms": 2.0, "overlapped_ms": 2.0, "exposed_ms": 0.0, "wait_ms": 0.5},
    ]
    m = mean_figures(steps)
    assert (m["comm_ms"], m["overlapped_ms"], m["exposed_ms"], m["wait_ms"]) == (6.0, 2.0, 4.0, 4.75)
    assert m["overlap_pct"] == pytest.approx(100 * 4 / 12)
    unmeasured = mean_figures([{"comm_ms": None, "overlapped_ms": None, "exposed_ms": None, "wait_ms": 1.0}])
    assert unmeasured["overlap_pct"] is None and unmeasured["wait_ms"] == 1.0
    text = describe_figures(unmeasured)
    assert "0.0" not in text and text.count("-") >= 4, text
