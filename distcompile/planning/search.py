"""The schedule search behind ``bucket_cap_mb="auto"`` (Note [Planning segments and buckets together]).

Given estimated backward times per node and the link's cost, choose where segments start
so that the step's last all-reduce ends as early as possible. With shared parameters
reduced by use (Note [Shared weights reduced by use]), a segment's bucket is priced as
it will be sent: a later use of a shared parameter adds its bytes, in a bucket of its
own, to the segment holding that use, and a table whose home segment only looks rows up
sends about the rows a step touches instead of the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .nodes import NodeInfo

__all__ = ["GraphCosts", "SharedUse", "segment_bytes", "starts_by_cost"]


@dataclass(frozen=True, slots=True)
class SharedUse:
    """A parameter read by several nodes, as the search prices it when reduced by use.

    Attributes:
        first: Index of the node that reads it first (its home segment holds this node).
        readers: Indices of every node that reads it, ascending.
        lookups: Those of ``readers`` that read it as an embedding table.
        nbytes: Its gradient bytes.
        rows_nbytes: What its own bucket costs the link when its home segment only looks
            rows up, as all-reduced bytes (at most ``nbytes``): the rows one step looks up
            over all ranks, with their indices, all-gathered (half an all-reduce's bytes).
    """

    first: int
    readers: tuple[int, ...]
    lookups: tuple[int, ...]
    nbytes: int
    rows_nbytes: int


@dataclass(frozen=True, slots=True)
class GraphCosts:
    """Estimated costs that let the planner choose segments from a schedule, not caps.

    Attributes:
        node_backward_s: Estimated backward seconds of each node (forward order).
        latency_s: Fixed seconds of one all-reduce (launch, handshakes).
        bytes_per_s: All-reduce throughput in buffer bytes per second.
        segment_backward_s: Backward cost of one more segment (an autograd node, its call).
        segment_forward_s: Forward cost of one more segment.
        wire_scale: Bytes on the wire per gradient byte (0.5 under bf16/fp16 compression).
        first_segment_wire_scale: The same for the first segment's bucket (the tail),
            which ``compression_scope="tail"`` compresses alone.
        split_shared: Shared parameters are reduced by use (``Config.split_shared``, when
            the backend can): price their buckets that way.
        rows_nbytes: Parameter name -> what its row bucket costs the link, as all-reduced
            bytes (``SharedUse.rows_nbytes``; tables not named: the whole table).
        cpu_s_per_byte: Backward seconds lost per byte all-reduced while backward runs
            (communication threads sharing the rank's CPU cores).
        timed_nodes: How many of ``node_backward_s`` were timed rather than counted (for
            the log).
    """

    node_backward_s: Sequence[float]
    latency_s: float
    bytes_per_s: float
    segment_backward_s: float = 2e-4
    segment_forward_s: float = 1e-4
    wire_scale: float = 1.0
    first_segment_wire_scale: float = 1.0
    split_shared: bool = False
    rows_nbytes: dict[str, int] | None = None
    cpu_s_per_byte: float = 0.0
    timed_nodes: int = 0


#: Most candidate segment starts the cost search considers (more are thinned by bytes).
_MAX_CANDIDATES = 96
#: Most segments per graph the cost search considers.
_MAX_SEGMENTS = 32


def _candidates(
    firsts_bytes: Sequence[int], allowed: set[int] | None, n: int, shared: Sequence[SharedUse]
) -> list[int]:
    # Worth a segment start: where a parameter is first read, or a shared one read again (a part).
    later = {r for u in shared for r in u.readers if r > u.first}
    if allowed is None:
        cands = [i for i in range(1, n) if firsts_bytes[i] > 0 or i in later]
    else:  # an allowed start, if such a read comes before the next one
        marks = sorted(p for p in allowed if 0 < p < n)
        cands = [
            p
            for p, q in zip(marks, [*marks[1:], n])
            if any(firsts_bytes[p:q]) or any(p <= r < q for r in later)
        ]
    if len(cands) > _MAX_CANDIDATES:  # keep the starts where cumulative bytes cross even steps
        step = sum(firsts_bytes) / _MAX_CANDIDATES
        kept, acc, prev = [], 0, 0
        for i in cands:
            acc += sum(firsts_bytes[prev:i])
            prev = i
            if acc >= step * (len(kept) + 1):
                kept.append(i)
        cands = kept
    return cands


def segment_bytes(shared: Sequence[SharedUse], start: int, stop: int) -> tuple[int, int]:
    """How reducing by use changes the bytes of segment ``nodes[start:stop]``: the change to
    its own bucket (rows instead of a table) and the bytes of its parts (which travel in it).

    Example:
        >>> use = SharedUse(first=0, readers=(0, 5), lookups=(0,), nbytes=800, rows_nbytes=100)
        >>> segment_bytes([use], 0, 3), segment_bytes([use], 3, 6), segment_bytes([use], 0, 6)
        ((-700, 0), (0, 800), (0, 0))
    """
    own, parts = 0, 0
    for u in shared:
        inside = [r for r in u.readers if start <= r < stop]
        if start <= u.first < stop:
            if all(r in u.lookups for r in inside):
                own -= u.nbytes - u.rows_nbytes
        elif u.first < start and inside:
            parts += u.nbytes
    return own, parts


def _valid_segments(nodes: Sequence[NodeInfo], points: Sequence[int]) -> list[list[bool]]:
    # valid[a][b]: segment points[a]..points[b] has a value used after it (else FX drops it).
    n, m = len(nodes), len(points) - 1
    valid = [[False] * (m + 1) for _ in range(m + 1)]
    for a in range(m):
        reach, i = -1, points[a]
        for b in range(a + 1, m + 1):
            while i < points[b]:
                reach = max(reach, nodes[i].last_user)
                i += 1
            valid[a][b] = points[b] == n or reach >= points[b]
    return valid


def starts_by_cost(
    nodes: Sequence[NodeInfo],
    firsts_bytes: Sequence[int],
    costs: GraphCosts,
    allowed: set[int] | None = None,
    shared: Sequence[SharedUse] = (),
) -> tuple[list[int], float]:
    """Segment starts that end the step's communication earliest (``shared``: the
    parameters reduced by use, priced by :func:`segment_bytes`), and the seconds the model
    predicts for them: from backward's start to the end of the last all-reduce, with the
    segments' forward and backward overheads.

    Example:
        >>> from distcompile.planning.plan import NodeInfo
        >>> nodes = [NodeInfo("a", ("w",), 1), NodeInfo("b", ("v",), 2)]
        >>> starts, predicted = starts_by_cost(nodes, [8e6, 8e6], GraphCosts([0.1, 0.1], 1e-4, 1e8))
        >>> starts
        [0, 1]
    """
    n = len(nodes)
    if len(costs.node_backward_s) != n:
        raise ValueError(f"costs give {len(costs.node_backward_s)} node times for {n} nodes")
    if not costs.bytes_per_s > 0 or costs.latency_s < 0:
        raise ValueError(f"need bytes_per_s > 0 and latency_s >= 0, got {costs!r}")
    points = [0, *_candidates(firsts_bytes, allowed, n, shared), n]
    m = len(points) - 1
    below = [0.0] * (n + 1)  # backward seconds of nodes[i:]
    byte_below = [0] * (n + 1)  # bytes first used in nodes[i:]
    for i in range(n - 1, -1, -1):
        below[i] = below[i + 1] + costs.node_backward_s[i]
        byte_below[i] = byte_below[i + 1] + firsts_bytes[i]
    valid = _valid_segments(nodes, points)

    def comm_s(a: int, b: int) -> float:
        own, parts = segment_bytes(shared, points[a], points[b])
        own += byte_below[points[a]] - byte_below[points[b]]
        scale = costs.first_segment_wire_scale if a == 0 else costs.wire_scale
        nbytes = own + parts  # the parts travel in the segment's bucket (``SplitPlan.groups``)
        return costs.latency_s + nbytes * scale / costs.bytes_per_s if nbytes > 0 else 0.0

    inf = float("inf")
    kmax = min(_MAX_SEGMENTS, m)
    # finish[a][k]: earliest end of the last all-reduce when nodes[points[a]:] form k segments.
    finish = [[inf] * (kmax + 1) for _ in range(m + 1)]
    choice = [[-1] * (kmax + 1) for _ in range(m + 1)]
    finish[m][0] = 0.0
    for a in range(m - 1, -1, -1):
        for b in range(a + 1, m + 1):
            if not valid[a][b]:
                continue
            comm = comm_s(a, b)
            for k in range(1, kmax + 1):
                prev = finish[b][k - 1]
                if prev == inf:
                    continue
                # Backward of nodes[points[a]:] ends late by the CPU its running all-reduces took.
                lost = costs.cpu_s_per_byte * costs.wire_scale * byte_below[points[b]]
                ready = below[points[a]] + k * costs.segment_backward_s + lost
                t = max(ready, prev) + comm
                if t < finish[a][k]:
                    finish[a][k], choice[a][k] = t, b
    totals = {
        k: max(below[0] + k * costs.segment_backward_s, finish[0][k]) + k * costs.segment_forward_s
        for k in range(1, kmax + 1)
        if finish[0][k] < inf
    }
    if not totals:
        return [0], 0.0
    best = min(totals.values())

    def tail_bytes(k: int) -> int:  # what the plan's first segment sends after backward
        a, stop = 0, 0
        while k > 0:  # a parameter-free preamble joins the next segment (plan_graph)
            a, k = choice[a][k], k - 1
            stop = points[a]
            if byte_below[0] > byte_below[stop]:
                break
        return byte_below[0] - byte_below[stop] + segment_bytes(shared, 0, stop)[0]

    k = min((k for k, t in totals.items() if t <= best * 1.01), key=lambda k: (tail_bytes(k), k))
    starts, a = [], 0
    while k > 0:
        starts.append(points[a])
        a, k = choice[a][k], k - 1
    return starts, totals[len(starts)]
