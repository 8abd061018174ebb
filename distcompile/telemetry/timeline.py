"""Spans of one training step and what follows from them (pure: no I/O).

A step's spans live on tracks: ``compile``, ``compute`` (each segment's forward and
backward, and on CPU the host's work between them), ``comm`` (each bucket's all-reduce,
launch to completion) and ``wait`` (the host blocked on communication). The figures follow
Holistic Trace Analysis: *communication* is the union of the all-reduce spans,
*overlapped* the part of it that ran while computation ran, *exposed* the rest, and
*overlap %* overlapped over communication (see ``docs/telemetry.md``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Span",
    "chrome_trace",
    "comm_figures",
    "describe_figures",
    "figures_less_waits",
    "fill_gaps",
    "fmt",
    "mean_figures",
    "union",
]


@dataclass(frozen=True, slots=True)
class Span:
    """One interval on a track; times in seconds of ``time.perf_counter``.

    On CUDA the times are GPU times placed on the host clock (see ``clock.py``).

    Attributes:
        track: ``"compile"``, ``"compute"`` or ``"comm"``.
        name: What ran (``"g0.s1 bwd"``, ``"bucket 2"``).
        start: Start time.
        end: End time.
        lane: Row within the track (all-reduces of different buckets may overlap).
        args: Extra figures shown in the trace viewer.
    """

    track: str
    name: str
    start: float
    end: float
    lane: int = 0
    args: dict = field(default_factory=dict)


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals.

    Example:
        >>> union([(0, 2), (1, 3), (5, 6)])
        [(0, 3), (5, 6)]
    """
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    both = 0.0
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        both += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def comm_figures(
    comm: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]
) -> dict[str, float | None]:
    """A step's communication figures in milliseconds (times in seconds).

    ``comm_ms`` = |union of comm|, ``overlapped_ms`` = |comm ∩ compute|, ``exposed_ms`` =
    |comm \\ compute| (so overlapped + exposed = comm), ``overlap_pct`` = overlapped / comm,
    ``None`` when the step communicated nothing.

    Example:
        >>> f = comm_figures([(0, 0.004)], [(0.001, 0.002), (0.003, 0.010)])
        >>> round(f["overlapped_ms"], 6), round(f["exposed_ms"], 6), round(f["overlap_pct"], 6)
        (2.0, 2.0, 50.0)
    """
    c = union(comm)
    total = _length(c)
    return _figures(total, _intersection(c, union(compute)))


def _figures(total: float, overlapped: float) -> dict[str, float | None]:
    """The figures in milliseconds from communication ``total`` and its ``overlapped`` part (s)."""
    return {
        "comm_ms": total * 1e3,
        "overlapped_ms": overlapped * 1e3,
        "exposed_ms": (total - overlapped) * 1e3,
        "overlap_pct": 100.0 * overlapped / total if total > 0 else None,
    }


def figures_less_waits(
    comm: Iterable[tuple[float, float]], waits: Iterable[tuple[float, float]]
) -> dict[str, float | None]:
    """``comm_figures`` of a CPU step whose computation is all of it but ``waits`` (Note [Segment
    spans on CPU] in ``sink.py``), for all-reduces inside the step: exposed is what the waits
    cover. The same figures, without building the step's gaps.

    Example:
        >>> f = figures_less_waits([(1, 2), (2, 4)], [(3.5, 4)])
        >>> f == comm_figures([(1, 2), (2, 4)], fill_gaps([], (0, 5), [(3.5, 4)]))
        True
    """
    c = union(comm)
    total = _length(c)
    return _figures(total, total - _intersection(c, union(waits)))


def mean_figures(steps: Sequence[dict]) -> dict[str, float | None]:
    """Per-step means of the figures of ``comm_figures`` (and ``wait_ms``) over ``steps``.

    Means, not medians, so that overlapped + exposed = communication holds for the summary
    as for each step; ``overlap_pct`` is total overlapped over total communication. A
    figure no step measured (``None`` or absent) stays ``None``.

    Example:
        >>> mean_figures([{"comm_ms": 4.0, "overlapped_ms": 1.0, "exposed_ms": 3.0},
        ...               {"comm_ms": 2.0, "overlapped_ms": 2.0, "exposed_ms": 0.0}])["overlap_pct"]
        50.0
    """
    out: dict[str, float | None] = {}
    for key in ("comm_ms", "overlapped_ms", "exposed_ms", "wait_ms"):
        vals = [s[key] for s in steps if s.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals and len(vals) == len(steps) else None
    comm, over = out["comm_ms"], out["overlapped_ms"]
    out["overlap_pct"] = 100.0 * over / comm if comm and over is not None else None
    return out


def fmt(value: float | None, spec: str = ".1f", unit: str = "") -> str:
    """``value`` formatted, or ``-`` when it was not measured (never 0).

    Example:
        >>> fmt(2.345), fmt(None), fmt(50.0, ".0f", "%")
        ('2.3', '-', '50%')
    """
    return "-" if value is None else f"{value:{spec}}{unit}"


def describe_figures(f: dict) -> str:
    """One line for the figures of ``comm_figures`` / ``mean_figures`` (``-``: not measured).

    Example:
        >>> describe_figures({"comm_ms": 4.0, "overlapped_ms": 3.0, "exposed_ms": 1.0,
        ...                   "overlap_pct": 75.0, "wait_ms": 1.2})
        'all-reduce 4.0 ms = overlapped 3.0 + exposed 1.0 ms (overlap 75%); host waited 1.2 ms'
    """
    return (
        f"all-reduce {fmt(f.get('comm_ms'))} ms = overlapped {fmt(f.get('overlapped_ms'))} + exposed "
        f"{fmt(f.get('exposed_ms'))} ms (overlap {fmt(f.get('overlap_pct'), '.0f', '%')}); host waited "
        f"{fmt(f.get('wait_ms'))} ms"
    )


def fill_gaps(
    compute: Sequence[tuple[float, float]], window: tuple[float, float], waits: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The parts of ``window`` covered by neither ``compute`` nor ``waits`` (merged, in order).

    On CPU the training thread computes whenever it is in the step and not blocked on
    communication: these gaps are its work outside compiled segments (eager operations,
    Python, the autograd engine, bucket copies, an optimizer run in backward).

    Example:
        >>> fill_gaps([(1, 2)], (0, 5), [(3, 4)])
        [(0, 1), (2, 3), (4, 5)]
    """
    lo, hi = window
    gaps, at = [], lo
    for s, e in union([*compute, *waits]):
        s, e = max(s, lo), min(e, hi)
        if s > at:
            gaps.append((at, s))
        at = max(at, e)
    if at < hi:
        gaps.append((at, hi))
    return gaps


def chrome_trace(spans: Sequence[Span], *, rank: int, step: int, origin: float) -> dict:
    """A Chrome Trace Event document (Perfetto and chrome://tracing open it).

    One process per rank; one thread per track and lane (``comm`` lanes are buckets).
    Times are microseconds from ``origin``.

    Example:
        >>> doc = chrome_trace([Span("compute", "g0.s0 fwd", 1.0, 1.5)], rank=0, step=3, origin=1.0)
        >>> doc["traceEvents"][-1]["dur"]
        500000.0
    """
    tids: dict[tuple[str, int], int] = {}
    order = {"step": 0, "compile": 1, "compute": 2, "wait": 3, "comm": 4}
    for s in sorted(spans, key=lambda s: (order.get(s.track, 9), s.lane)):
        tids.setdefault((s.track, s.lane), len(tids) + 1)
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for (track, lane), tid in tids.items():
        label = track if track != "comm" else f"comm (bucket {lane})"
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
        )
    for s in spans:
        events.append(
            {
                "ph": "X",
                "name": s.name,
                "cat": s.track,
                "pid": rank,
                "tid": tids[(s.track, s.lane)],
                "ts": round((s.start - origin) * 1e6, 3),
                "dur": round((s.end - s.start) * 1e6, 3),
                "args": {"step": step, **s.args},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"rank": rank, "step": step}}
