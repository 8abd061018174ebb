"""``distcompile.explain``: what distcompile would capture, split and bucket, in one process."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import _torch_compat as compat
from .._options import check_caps
from ..capture.breaks import graph_break_reason, tidy_reason
from ..capture.graph import own_forward_code, read_graph
from ..errors import ConfigError, UnsupportedModelError
from ..planning.plan import Plan, _fmt_bytes, plan_graph
from ..planning.split import SplitPlan, split_shared
from ..runtime.ddp import bucket_caps

__all__ = ["explain", "Explanation", "ExplainedGraph"]

_MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ExplainedGraph:
    """One captured graph.

    Attributes:
        graph_id: Capture order.
        num_nodes: Partitionable nodes.
        graph_break: Why the graph ended early (reason and user code line), or ``None``.
        plan: Its segments and buckets.
        params_read: Trainable parameters the graph reads.
        split: Shared parameters reduced by use, and tables reduced by rows (``split_shared``).
    """

    graph_id: int
    num_nodes: int
    graph_break: str | None
    plan: Plan
    params_read: tuple[str, ...]
    split: SplitPlan = SplitPlan()


@dataclass(slots=True)
class Explanation:
    """The result of :func:`explain`; ``print()`` it for a report.

    Attributes:
        graphs: Captured graphs in execution order.
        bucket_cap: Bytes per bucket used for planning.
        first_bucket_cap: Bytes of the first bucket in gradient order.
        param_bytes: Gradient bytes of every trainable parameter.
        shared: Parameters read more than once (in one graph or across graphs), with counts.
        not_in_graphs: Trainable parameters no graph reads (unused, or read by eager code only).
        untraced: TorchDynamo's reasons for code it left to run eagerly with no graph break to
            show for it (a skipped frame: a TorchScript submodule called in it, ...).
        advice: Suggestions where the capture costs overlap.
    """

    graphs: list[ExplainedGraph]
    bucket_cap: int
    first_bucket_cap: int
    param_bytes: dict[str, int]
    shared: dict[str, int] = field(default_factory=dict)
    not_in_graphs: list[str] = field(default_factory=list)
    untraced: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def graph_breaks(self) -> list[str]:
        """Reasons of every graph break, in order."""
        return [g.graph_break for g in self.graphs if g.graph_break]

    def __str__(self) -> str:
        total = sum(self.param_bytes.values())
        lines = [
            f"{len(self.graphs)} graph(s), {len(self.graph_breaks)} graph break(s); "
            f"{len(self.param_bytes)} trainable parameters ({_fmt_bytes(total)}); "
            f"bucket cap {_fmt_bytes(self.bucket_cap)}, first bucket {_fmt_bytes(self.first_bucket_cap)}",
        ]
        for g in self.graphs:
            p = g.plan
            lines.append("")
            lines.append(
                f"graph {g.graph_id}: {g.num_nodes} nodes, {len(p.segments)} segment(s), "
                f"{len(p.buckets)} bucket(s), reads {len(g.params_read)} parameters"
            )
            if g.graph_break:
                lines.append(f"  ends at a graph break: {g.graph_break}")
            for b in p.buckets:
                start, stop = p.segments[b.segment]
                names = ", ".join(b.params[:6]) + (
                    f", ... ({len(b.params)} total)" if len(b.params) > 6 else ""
                )
                lines.append(
                    f"  bucket {b.index}: segment {b.segment} (nodes {start}-{stop - 1}), "
                    f"{_fmt_bytes(b.nbytes)}: {names}"
                )
            if p.foreign:
                lines.append(f"  reads parameters bucketed by an earlier graph: {', '.join(p.foreign)}")
            lines.extend(f"  {line}" for line in g.split.describe().splitlines())
        if self.shared:
            lines.append("")
            lines.append(
                "parameters read more than once (bucketed with the first use; with split_shared, a later "
                "use in another segment is reduced early on its own, see 'split:' above): "
                + ", ".join(f"{n} x{c}" for n, c in self.shared.items())
            )
        if self.not_in_graphs:
            lines.append("")
            lines.append(
                "parameters no graph reads (unused, or read only by eager code): "
                + ", ".join(self.not_in_graphs)
            )
        if self.untraced:
            lines.append("")
            lines.append(
                "code TorchDynamo did not trace, besides the breaks above (a frame it skipped runs eagerly):"
            )
            lines.extend(f"  - {r}" for r in self.untraced)
        if self.advice:
            lines.append("")
            lines.append("advice:")
            lines.extend(f"  - {a}" for a in self.advice)
        return "\n".join(lines)


def explain(
    model: nn.Module,
    *example_inputs: object,
    bucket_cap_mb: float | str | None = None,
    first_bucket_cap_mb: float | None = None,
    **example_kwargs: object,
) -> Explanation:
    """Capture ``model`` on example inputs and report graphs, breaks, segments and buckets.

    Runs one forward of a copy of the model (so the model itself is not touched) through
    TorchDynamo with a recording backend; no process group is needed, and each rank may
    call it. Bucket caps come from the DDP model, the arguments, or DDP's defaults.

    Example:
        >>> exp = explain(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.zeros(2, 4))
        >>> len(exp.graphs), exp.graph_breaks
        (1, [])
    """
    inner = model.module if isinstance(model, DDP) else model
    if not isinstance(inner, nn.Module):
        raise UnsupportedModelError(
            f"explain expects a torch.nn.Module or DDP model, got {type(model).__name__}."
        )
    if bucket_cap_mb == "auto":
        raise ConfigError(
            "explain(bucket_cap_mb='auto') cannot plan: 'auto' measures the link on the process group "
            "when wrap() runs, and explain runs without one. Pass a number of MiB here, or wrap with "
            "logdir=... and read the chosen plan in TensorBoard's text tab (plan/graph_0)."
        )
    check_caps(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
    cap, first = bucket_caps(model, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)

    # A private code object: capturing afresh without touching the cache of a model that
    # distcompile.wrap already compiled (that would recompile it on this rank only).
    clone = own_forward_code(copy.deepcopy(inner), "explain")
    names_by_id = {id(p): n for n, p in clone.named_parameters() if p.requires_grad}
    param_bytes = {n: p.numel() * p.element_size() for n, p in clone.named_parameters() if p.requires_grad}
    graphs: list[ExplainedGraph] = []
    owned: set[str] = set()

    def record(gm: fx.GraphModule, inputs: list) -> object:
        captured = read_graph(gm, inputs, names_by_id)
        plan = plan_graph(
            captured.nodes,
            param_bytes,
            bucket_cap=cap,
            first_bucket_cap=first,
            owned_elsewhere=owned,
            blocks=captured.blocks,
            sealed=captured.sealed,
        )
        owned.update(plan.first_use)
        reads = tuple(n for n in param_bytes if n in plan.first_use or n in plan.foreign)
        split = split_shared(plan, captured.nodes)
        graphs.append(
            ExplainedGraph(len(graphs), len(captured.nodes), graph_break_reason(gm), plan, reads, split)
        )
        return gm.forward

    with compat.untraced_reasons() as untraced:
        torch.compile(clone, backend=record)(*example_inputs, **example_kwargs)

    uses: dict[str, int] = {}
    for g in graphs:
        for n in g.params_read:
            uses[n] = uses.get(n, 0) + max(1, g.plan.shared.get(n, 1))
    exp = Explanation(graphs=graphs, bucket_cap=cap, first_bucket_cap=first, param_bytes=param_bytes)
    exp.shared = {n: c for n, c in uses.items() if c > 1}
    exp.not_in_graphs = [n for n in param_bytes if n not in uses]
    # Reasons that ended a graph are said with it; the rest are frames TorchDynamo skipped.
    breaks = [g.graph_break or "" for g in graphs]
    exp.untraced = [
        r for r in dict.fromkeys(map(tidy_reason, untraced)) if not any(b.startswith(r) for b in breaks)
    ]
    exp.advice = _advice(exp)
    return exp


def _advice(exp: Explanation) -> list[str]:
    out = []
    for g in exp.graphs:
        if g.graph_break:
            out.append(
                f"graph {g.graph_id} ends at a break: the next graph's segments cannot merge with its "
                "last segment, and code between graphs runs eagerly. Removing the break (see the hint "
                "in the reason) lets buckets be sized freely."
            )
    if exp.untraced:
        out.append(
            "TorchDynamo gave up on part of the forward (see 'code TorchDynamo did not trace'): it runs "
            "uncompiled, and the gradients of what it reads wait for the trailing bucket. Change that code "
            "as the reason says (a TorchScript submodule: use the nn.Module it was scripted from), or move "
            "it out of the forward."
        )
    eager_bytes = sum(exp.param_bytes[n] for n in exp.not_in_graphs)
    if exp.not_in_graphs:
        out.append(
            f"{len(exp.not_in_graphs)} parameter(s) ({_fmt_bytes(eager_bytes)}) are read by no graph: if eager "
            "code reads them (torch.compiler.disable, code between graphs), their gradients are all-reduced "
            "in a trailing bucket after backward ends, fully exposed; if nothing reads them, set "
            "requires_grad=False to save the all-reduce."
        )
    for g in exp.graphs:
        if g.plan.foreign:
            out.append(
                f"graph {g.graph_id} reads {len(g.plan.foreign)} parameter(s) first read by an earlier graph; "
                "their bucket waits for that earlier graph's backward."
            )
    if exp.graphs and all(len(g.plan.buckets) <= 1 for g in exp.graphs) and len(exp.param_bytes) > 1:
        out.append(
            "every graph has a single bucket, so nothing overlaps backward: lower bucket_cap_mb "
            f"(now {exp.bucket_cap / _MB:g} MiB) to split the graph."
        )
    return out
