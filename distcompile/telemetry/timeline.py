"""Spans of one training step and what follows from them (pure: no I/O).

A step's spans live on tracks: ``compile``, ``compute`` (each segment's forward and
backward) and ``comm`` (each bucket's all-reduce, launch to completion). From them come
the overlap figure, defined as Holistic Trace Analysis defines it: the time communication
ran while computation ran, divided by the time communication ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["Span", "union", "overlap_pct", "chrome_trace"]


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


def overlap_pct(comm: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]) -> float:
    """Percent of communication time during which computation also ran (0 if no communication).

    Example:
        >>> overlap_pct([(0, 4)], [(1, 2), (3, 10)])
        50.0
    """
    c = union(comm)
    total = _length(c)
    if total <= 0:
        return 0.0
    k = union(compute)
    both = 0.0
    i = j = 0
    while i < len(c) and j < len(k):
        lo, hi = max(c[i][0], k[j][0]), min(c[i][1], k[j][1])
        both += max(0.0, hi - lo)
        if c[i][1] < k[j][1]:
            i += 1
        else:
            j += 1
    return 100.0 * both / total


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
    order = {"step": 0, "compile": 1, "compute": 2, "comm": 3}
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
