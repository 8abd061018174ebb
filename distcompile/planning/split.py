"""Note [Shared weights reduced by use]

Background
    A parameter read in several places (a tied input/output embedding, a module called
    twice) gets one gradient, the sum of each use's contribution, and it is final only
    when the backward of its *first* use in forward is done: for a tied embedding, at the
    very end of backward. Every DDP puts all of it in the last bucket.

Algorithm
    All-reduce is linear, so each use's contribution can be reduced on its own and the
    results added. For every shared parameter, each compiled piece that reads it in a
    later segment than its first use gives a *part*: the piece's backward node hands its
    contribution to the reducer instead of to the parameter (``runtime/split.py``), and
    the part travels in the last bucket of its segment (ready at the same time: the same
    piece's backward gives both), or in a bucket of its own where the segment has none.
    The parameter's own bucket then carries only what the first-use segment (and any
    earlier accumulation) put in ``.grad``; once it is written the parts are
    added. When the first-use segment only looks rows up (``nn.Embedding``), that rest is
    nonzero only on the rows seen in the step: the parameter's bucket reduces just the
    rows some rank touched, when that is cheaper (``runtime/row_buckets.py``).

Notes
    Pure: plan and node descriptions in, parts and groups out. The same on every rank.
    A part whose piece's backward does not hand it over (no such autograd edge) simply
    stays in ``.grad`` and is reduced with the rest; its place in the bucket then
    carries zeros. Either way the sum is the gradient eager DDP computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .plan import NodeInfo, Plan

__all__ = ["Part", "SplitPlan", "split_shared"]


@dataclass(frozen=True, slots=True)
class Part:
    """One later use of a shared parameter: the contribution of compiled piece ``piece``.

    Attributes:
        param: The parameter's name.
        piece: Index into ``plan.compiled_pieces``.
        segment: The piece's segment.
    """

    param: str
    piece: int
    segment: int

    @property
    def name(self) -> str:
        """The part's name in the reducer's buckets (``@`` cannot occur in a parameter name)."""
        return f"{self.param}@{self.piece}"


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Parts of shared parameters and parameters reduced by rows, for one graph.

    Attributes:
        parts: Every part, in gradient order.
        rows: Parameters whose own bucket may carry just the rows looked up.
        lookups: For each of ``rows`` whose count is known (not a symbol), how many indices
            one call of the graph looks up in it on this rank: at most that many rows.
    """

    parts: tuple[Part, ...] = ()
    rows: tuple[str, ...] = ()
    lookups: tuple[tuple[str, int], ...] = ()

    def groups(self, plan: Plan) -> list[tuple[str, ...]]:
        """The plan's buckets in gradient order, each segment's part names added to that segment's
        last bucket (one collective fewer than a bucket of their own, ready at the same time: the
        same piece's backward gives both); a group of their own, in that place, for a segment
        without a bucket.

        Example:
            >>> nodes = [NodeInfo("emb", ("w",), 1, ("w",)), NodeInfo("mid", ("v",), 2),
            ...          NodeInfo("head", ("w", "u"), 3)]
            >>> plan = plan_graph_for_doc(nodes)
            >>> split_shared(plan, nodes).groups(plan)
            [('u', 'w@2'), ('v',), ('w',)]
        """
        parts: dict[int, tuple[str, ...]] = {}
        for p in self.parts:
            parts[p.segment] = (*parts.get(p.segment, ()), p.name)
        last = {b.segment: i for i, b in enumerate(plan.buckets)}  # each segment's last bucket
        alone = sorted((s for s in parts if s not in last), reverse=True)
        out: list[tuple[str, ...]] = []
        for i, b in enumerate(plan.buckets):
            while alone and alone[0] > b.segment:
                out.append(parts[alone.pop(0)])
            out.append(b.params + parts.get(b.segment, ()) if last[b.segment] == i else b.params)
        out.extend(parts[s] for s in alone)
        return out

    def describe(self) -> str:
        """What was split, for the plan listing (empty when nothing was).

        Example:
            >>> SplitPlan((Part("wte", 4, 2),), ("wte",)).describe()
            'split: wte: the use in piece 4 (segment 2) is reduced early, in the bucket of its segment; the rest, rows only when fewer'
        """
        lines = []
        for name in dict.fromkeys(p.param for p in self.parts):
            uses = ", ".join(f"piece {p.piece} (segment {p.segment})" for p in self.parts if p.param == name)
            rest = "rows only when fewer" if name in self.rows else "the rest with its bucket"
            lines.append(
                f"split: {name}: the use in {uses} is reduced early, in the bucket of its segment; the rest, {rest}"
            )
        for name in self.rows:
            if not any(p.param == name for p in self.parts):
                lines.append(
                    f"rows: {name}: an embedding table, its bucket carries only the rows looked up when fewer"
                )
        return "\n".join(lines)


def split_shared(plan: Plan, nodes: Sequence[NodeInfo]) -> SplitPlan:
    """Parts of this graph's shared parameters and the parameters reduced by rows.

    Example:
        >>> nodes = [NodeInfo("emb", ("w",), 1, ("w",)), NodeInfo("mid", ("v",), 2),
        ...          NodeInfo("head", ("w",), 3)]
        >>> sp = split_shared(plan_graph_for_doc(nodes), nodes)
        >>> [(p.param, p.piece, p.segment) for p in sp.parts], sp.rows
        ([('w', 1, 1)], ('w',))
    """
    pieces = plan.compiled_pieces
    piece_of = [k for k, (start, stop) in enumerate(pieces) for _ in range(start, stop)]
    parts: list[Part] = []
    rows: list[str] = []
    for name, first in plan.first_use.items():
        home = plan.segment_of(first)
        readers = [i for i, n in enumerate(nodes) if name in n.params]
        later = sorted({piece_of[i] for i in readers if plan.segment_of(i) > home})
        parts += [Part(name, k, plan.segment_of(pieces[k][0])) for k in later]
        if all(name in nodes[i].lookups for i in readers if plan.segment_of(i) == home):
            rows.append(name)
    parts.sort(key=lambda p: (-p.segment, p.piece, p.param))
    return SplitPlan(tuple(parts), tuple(rows))


def plan_graph_for_doc(nodes: Sequence[NodeInfo]) -> Plan:
    """A plan cut after every node (for the examples above).

    Example:
        >>> plan_graph_for_doc([NodeInfo("a", ("w",), 1)]).segments
        ((0, 1),)
    """
    from .plan import plan_graph

    names = {p for n in nodes for p in n.params}
    return plan_graph(nodes, dict.fromkeys(names, 4), bucket_cap=1, first_bucket_cap=1)
