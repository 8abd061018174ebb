"""What the backend keeps of each graph it compiled (``DistCompiledModule.graphs``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._store import control_plane_counts
from ..planning.plan import Plan
from ..planning.split import SplitPlan

__all__ = ["GraphRecord"]


@dataclass(frozen=True, slots=True)
class GraphRecord:
    """One graph TorchDynamo captured and distcompile compiled.

    Attributes:
        graph_id: Order of capture within this wrapped model.
        plan: Its segments and buckets.
        compile_s: Seconds spent planning, checking and compiling it on this rank
            (Inductor compiles the backward lazily, during the first backward).
        num_nodes: Partitionable nodes in the graph.
        segment_compile_s: Forward compile seconds of each piece compiled (a piece that
            reuses an identical sibling's compiled function takes no time and no entry).
        graph_break: Why TorchDynamo ended this graph early (``None`` if it ran to the
            end of the compiled function), with the user code location.
        recompile_reasons: Every failed guard, in TorchDynamo's order (one per cached
            entry of this model's code), if this graph recompiles code compiled before.
        cache_hits: FX-graph and AOTAutograd cache hits while compiling it.
        planned_by: How the segments were chosen: the bucket caps, or the measured
            costs (``bucket_cap_mb="auto"``).
        pieces_reused: Pieces (``plan.pieces``) that took the compiled function of an
            identical earlier piece (a repeated block) instead of being compiled.
        split: Shared parameters whose uses are reduced apart, and embedding tables reduced
            by rows (Note [Shared weights reduced by use]).
        piece_sources: Where this rank's distinct pieces came from when the ranks shared
            the compiles: ``compiled here``, ``cache``, ``same-folder peer``,
            ``other-folder peer`` -> count (Note [Compiles shared across cache folders]).
    """

    graph_id: int
    plan: Plan
    compile_s: float
    num_nodes: int
    segment_compile_s: tuple[float, ...] = ()
    graph_break: str | None = None
    recompile_reasons: tuple[str, ...] = ()
    cache_hits: int = 0
    planned_by: str = ""
    pieces_reused: int = 0
    split: SplitPlan = SplitPlan()
    piece_sources: dict[str, int] = field(default_factory=dict)

    @property
    def recompile_reason(self) -> str | None:
        """All failed guards on one line (``None`` for a first compile)."""
        return "; ".join(self.recompile_reasons) or None

    def figures(self, *, step: int, start: float) -> dict[str, object]:
        """What the compile observer (telemetry) is told of this graph, compiled at ``step``
        from ``start`` (``time.perf_counter()``)."""
        return {
            "graph_id": self.graph_id,
            "step": step,
            "start": start,
            "end": start + self.compile_s,
            "segment_s": self.segment_compile_s,
            "plan_table": f"planned by {self.planned_by}\n{self.plan.describe()}\n{self.split.describe()}".strip(),
            "breaks": [self.graph_break] if self.graph_break else [],
            "recompile_reasons": self.recompile_reasons,
            "cache_hits": self.cache_hits,
            "control_plane": control_plane_counts(),
        }
