"""Note [Planning segments and buckets together]

Background
    A compiled graph runs its backward as one autograd node, so no gradient is final
    (and no all-reduce can start) until all of it is done. Splitting the forward graph
    into segments, each compiled on its own, gives one backward node per segment; if
    the gradient buckets are chosen *from the same split*, each bucket's all-reduce can
    start the moment its segment's backward ends.

Algorithm
    The input is the forward graph as a list of nodes in execution order, each with the
    trainable parameters it reads, plus the parameter sizes. Bucket *k* holds exactly
    the parameters whose **first use in forward** lies in segment *k*: every later use
    is in a later segment, whose backward runs earlier, so the bucket's gradients are
    final when its segment's backward ends. A parameter read several times (a tied
    embedding) is counted once, with its first use.

    Nodes are walked from last to first (gradient order). The bytes of parameters first
    used at each node are added to the open bucket; once it reaches its cap (a small
    first cap for the first bucket in gradient order, so communication starts early,
    then ``bucket_cap``) the segment is closed just before the node that filled it. A
    segment is only closed if one of its values is used outside it, since an FX
    partition without outputs would be dropped. A leading segment without parameters
    is merged into the next one.

    With ``costs`` (``bucket_cap_mb="auto"``), caps give way to a schedule search. Each
    candidate segment start is a node that first reads a parameter. For a suffix of the
    graph cut into *k* segments, a dynamic program keeps the earliest time its last
    all-reduce can finish: a bucket is ready when backward has run through its segment
    (estimated node times plus a fixed cost per segment), all-reduces run one after
    another, each costing ``latency + bytes / bandwidth``. The plan minimizes
    ``max(end of backward, end of communication)`` plus the forward cost of its
    segments. Among plans within 1% of the best, the one with the smallest last bucket
    wins, then the one with fewest segments (fewer pieces fuse better and compile
    faster): that bucket can only go after backward ends, whatever the link does, while
    the simulated queue of the others rests on a measured bandwidth that can be off. With shared parameters reduced by use (Note [Shared weights
    reduced by use]) buckets are priced as they will be sent: a later use adds the
    parameter's bytes to its segment's bucket, and a table its home
    segment only looks rows up in costs the rows a step touches (``search.py``).

Notes
    Planning is pure: the same inputs give the same plan on every rank, and nothing here
    touches a process group, a compiler or a tensor. Parameters owned by an earlier
    graph of the same step (``owned_elsewhere``) are read but not bucketed here.

Debugging
    ``Plan.describe()`` prints the segments and buckets; ``distcompile.explain`` shows
    it for a real model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .nodes import NodeInfo
from .repeats import Blocks, allowed_cuts, piece_bounds
from .search import GraphCosts, SharedUse, starts_by_cost

__all__ = ["NodeInfo", "Bucket", "Plan", "GraphCosts", "plan_graph", "DEFAULT_FIRST_BUCKET_BYTES"]

#: DDP's first-bucket cap (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``).
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Bucket:
    """Parameters reduced together.

    Attributes:
        index: Position in gradient (launch) order; bucket 0 is ready first.
        segment: The segment holding the first forward use of every parameter here.
        params: Parameter names, in gradient order (reverse first use).
        nbytes: Total gradient bytes.
    """

    index: int
    segment: int
    params: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Plan:
    """Segments of one graph and the buckets aligned with them.

    Attributes:
        segments: ``(start, stop)`` node ranges in forward order, covering every node.
        buckets: Buckets in gradient order (``buckets[0]`` belongs to the last segment).
        first_use: Parameter name -> index of the node that first reads it.
        shared: Parameters read by more than one node, with their use count.
        foreign: Parameters read here but owned by an earlier graph.
        unused: Parameters given to the planner that no node reads.
        pieces: ``(start, stop)`` node ranges compiled separately, a refinement of the
            segments: each repeated block is its own piece, so identical blocks compile
            once (Note [Repeated blocks]). Equal to ``segments`` without repeated blocks.
        predicted_s: Planned from measured costs: the seconds the cost model predicts from
            backward's start to the end of the last all-reduce (``search.starts_by_cost``);
            ``None`` when planned by the bucket caps.
    """

    segments: tuple[tuple[int, int], ...]
    buckets: tuple[Bucket, ...]
    first_use: Mapping[str, int]
    shared: Mapping[str, int]
    foreign: tuple[str, ...]
    unused: tuple[str, ...]
    pieces: tuple[tuple[int, int], ...] = ()
    predicted_s: float | None = None

    @property
    def compiled_pieces(self) -> tuple[tuple[int, int], ...]:
        """The node ranges compiled separately: ``pieces``, or the segments when it is empty.

        Example:
            >>> plan_graph([NodeInfo("a", ("w",), 1)], {"w": 4}).compiled_pieces
            ((0, 1),)
        """
        return self.pieces or self.segments

    def segment_of(self, node_index: int) -> int:
        """Return the segment that holds node ``node_index``.

        Example:
            >>> plan = plan_graph([NodeInfo("a", ("w",), 1), NodeInfo("b", (), 2)], {"w": 4})
            >>> plan.segment_of(1)
            0
        """
        for i, (start, stop) in enumerate(self.segments):
            if start <= node_index < stop:
                return i
        raise IndexError(f"node index {node_index} is outside the plan's {self.segments}")

    def fingerprint(self) -> str:
        """A short hash identifying this plan; equal on ranks that planned alike.

        Example:
            >>> plan = plan_graph([NodeInfo("a", ("w",), 1)], {"w": 4})
            >>> len(plan.fingerprint())
            16
        """
        blob = json.dumps(
            [self.segments, [(b.segment, b.params, b.nbytes) for b in self.buckets], self.pieces],
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """A readable table of buckets, segments and parameters.

        Example:
            >>> print(plan_graph([NodeInfo("a", ("w",), 1)], {"w": 4}).describe())
            bucket 0 | segment 0 (nodes 0-0) | 4 B | w
        """
        lines = []
        for b in self.buckets:
            start, stop = self.segments[b.segment]
            lines.append(
                f"bucket {b.index} | segment {b.segment} (nodes {start}-{stop - 1}) | "
                f"{_fmt_bytes(b.nbytes)} | {', '.join(b.params)}"
            )
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def plan_graph(
    nodes: Sequence[NodeInfo],
    param_bytes: Mapping[str, int],
    *,
    bucket_cap: int = 25 * 1024 * 1024,
    first_bucket_cap: int = DEFAULT_FIRST_BUCKET_BYTES,
    owned_elsewhere: Iterable[str] = (),
    costs: GraphCosts | None = None,
    blocks: Blocks = (),
    sealed: Sequence[tuple[int, int]] = (),
) -> Plan:
    """Plan segments and buckets for one forward graph (see Note [Planning segments and buckets together]).

    Args:
        nodes: Graph nodes in forward order (placeholders and the output excluded).
        param_bytes: Gradient bytes of every trainable parameter the graph may read.
        bucket_cap: Byte cap of every bucket but the first.
        first_bucket_cap: Byte cap of the first bucket in gradient order.
        owned_elsewhere: Parameters bucketed by an earlier graph of the step.
        costs: Choose segments by simulating the schedule instead of by caps (the caps
            are then ignored).
        blocks: Groups of structurally identical blocks as node ranges (from
            ``capture.blocks``): segments are cut so that they stay identical, and each
            becomes its own piece (Note [Repeated blocks]).
        sealed: ``(first, last)`` node ranges no segment or piece may split (a size made
            from the data at ``first``, read up to ``last``).

    Example:
        >>> nodes = [NodeInfo("l1", ("w1",), 1), NodeInfo("l2", ("w2",), 2)]
        >>> plan = plan_graph(nodes, {"w1": 8, "w2": 8}, bucket_cap=8, first_bucket_cap=8)
        >>> plan.segments, [b.params for b in plan.buckets]
        (((0, 1), (1, 2)), [('w2',), ('w1',)])
    """
    if bucket_cap <= 0 or first_bucket_cap <= 0:
        raise ValueError(f"bucket caps must be positive, got {bucket_cap=} {first_bucket_cap=}")
    foreign_set = set(owned_elsewhere)
    first_use: dict[str, int] = {}
    uses: dict[str, int] = {}
    foreign: list[str] = []
    for i, node in enumerate(nodes):
        for p in node.params:
            if p not in param_bytes:
                raise KeyError(f"node {node.name!r} reads parameter {p!r} missing from param_bytes")
            uses[p] = uses.get(p, 0) + 1
            if p in foreign_set:
                if p not in foreign:
                    foreign.append(p)
            elif p not in first_use:
                first_use[p] = i
    firsts_at: dict[int, list[str]] = {}
    for p, i in first_use.items():
        firsts_at.setdefault(i, []).append(p)

    n = len(nodes)
    firsts_bytes = [sum(param_bytes[p] for p in firsts_at.get(i, ())) for i in range(n)]
    blocks, inner, allowed = _cut_rules(nodes, firsts_bytes, blocks, sealed, bucket_cap)
    if costs is None:
        starts, predicted = _starts_by_cap(nodes, firsts_bytes, bucket_cap, first_bucket_cap, allowed), None
    else:
        shared = _shared_uses(nodes, param_bytes, first_use, costs) if costs.split_shared else ()
        starts, predicted = starts_by_cost(nodes, firsts_bytes, costs, allowed, shared)
    if len(starts) > 1 and not any(first_use[p] < starts[1] for p in first_use):
        starts.pop(1)  # a parameter-free preamble joins the next segment
    bounds = tuple(zip(starts, [*starts[1:], n])) if n else ((0, 0),)

    def segment_of(i: int) -> int:
        return max(k for k, (start, _) in enumerate(bounds) if start <= i)

    per_segment: dict[int, list[str]] = {}
    for p, i in sorted(first_use.items(), key=lambda kv: (-kv[1], kv[0])):
        per_segment.setdefault(segment_of(i), []).append(p)
    buckets = []
    for seg in sorted(per_segment, reverse=True):
        params = tuple(per_segment[seg])
        buckets.append(Bucket(len(buckets), seg, params, sum(param_bytes[p] for p in params)))
    return Plan(
        segments=bounds,
        buckets=tuple(buckets),
        first_use=dict(first_use),
        shared={p: c for p, c in uses.items() if c > 1},
        foreign=tuple(foreign),
        unused=tuple(p for p in param_bytes if p not in uses),
        pieces=piece_bounds(n, starts, blocks, inner, [x.last_user for x in nodes]) if n else bounds,
        predicted_s=predicted,
    )


def _cut_rules(
    nodes: Sequence[NodeInfo],
    firsts_bytes: Sequence[int],
    blocks: Blocks,
    sealed: Sequence[tuple[int, int]],
    bucket_cap: int,
) -> tuple[list, list[list[int]], set[int] | None]:
    # The block groups that stay pieces (none of their ends inside a sealed span), their inner
    # cuts, and where a segment may start (None: anywhere).
    closed = {p for first, last in sealed for p in range(first + 1, last + 1)}
    blocks = [g for g in blocks if not any(a in closed or b in closed for a, b in g)]
    inner = [_inner_cuts(nodes, firsts_bytes, group[0], bucket_cap) for group in blocks]
    allowed = allowed_cuts(len(nodes), blocks, inner) if blocks or closed else None
    return blocks, inner, None if allowed is None else allowed - closed


def _inner_cuts(
    nodes: Sequence[NodeInfo], firsts_bytes: Sequence[int], block: tuple[int, int], bucket_cap: int
) -> list[int]:
    # Cuts inside a block, by the cap rule on the block alone; only a block holding more
    # than a bucket gets any, and every part holds at least a bucket: the rule's first part
    # (the block's head, in forward order) joins the next when smaller. A block just over
    # the cap (GPT-2 small's 27 MiB blocks over DDP's 25 MiB) stays whole, one piece and one
    # bucket, instead of a piece holding its first LayerNorm alone: a piece more per block,
    # a launch more per piece, and a fusion lost. Offsets are relative to the block's start.
    start, stop = block
    sizes = firsts_bytes[start:stop]
    if sum(sizes) <= bucket_cap:
        return []
    local = [
        NodeInfo(x.name, x.params, x.last_user - start if x.last_user < stop else stop - start)
        if x.last_user >= 0
        else x
        for x in nodes[start:stop]
    ]
    cuts = _starts_by_cap(local, sizes, bucket_cap, bucket_cap)[1:]
    if cuts and sum(sizes[: cuts[0]]) < bucket_cap:
        cuts = cuts[1:]
    return cuts


def _starts_by_cap(
    nodes: Sequence[NodeInfo],
    firsts_bytes: Sequence[int],
    bucket_cap: int,
    first_bucket_cap: int,
    allowed: set[int] | None = None,
) -> list[int]:
    # Walk in gradient order; `cuts` collects segment starts (only at `allowed` positions).
    n = len(nodes)
    cuts: list[int] = []
    seg_end = n
    seg_bytes = 0
    has_external_output = False
    for i in range(n - 1, -1, -1):
        cap = first_bucket_cap if not cuts else bucket_cap
        if seg_bytes >= cap and has_external_output and (allowed is None or i + 1 in allowed):
            cuts.append(i + 1)
            seg_end = i + 1
            seg_bytes = 0
            has_external_output = False
        seg_bytes += firsts_bytes[i]
        if nodes[i].last_user >= seg_end:
            has_external_output = True
    return sorted([0, *cuts])


def _shared_uses(
    nodes: Sequence[NodeInfo], param_bytes: Mapping[str, int], first_use: Mapping[str, int], costs: GraphCosts
) -> list[SharedUse]:
    # Parameters this graph owns and reads more than once, or reads as an embedding table.
    rows = costs.rows_nbytes or {}
    out = []
    for p, first in first_use.items():
        readers = tuple(i for i, x in enumerate(nodes) if p in x.params)
        lookups = tuple(i for i in readers if p in nodes[i].lookups)
        if len(readers) > 1 or lookups:
            nbytes = param_bytes[p]
            out.append(SharedUse(first, readers, lookups, nbytes, min(nbytes, rows.get(p, nbytes))))
    return out
