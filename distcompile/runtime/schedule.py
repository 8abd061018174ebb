"""The buckets of one step, in launch order, from the graphs that ran (Note [Bucketed all-reduce])."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .bucket import FlatBucket
from .row_buckets import ROWS_MIN_BYTES, RowBucket
from .sparse import SparseBucket
from .stats import StepStats

__all__ = [
    "ReduceBucket",
    "OpenStep",
    "build_schedule",
    "claimed_by",
    "layout_groups",
    "report_uncompiled",
    "static_groups",
]

#: A bucket of the reduction schedule, as launched in a step (``planning.plan.Bucket`` is the
#: planned one, which names its parameters and the segment it follows).
ReduceBucket = FlatBucket | SparseBucket | RowBucket


class OpenStep:
    """Where the open synchronized step stands: graphs run, buckets launched and written."""

    def __init__(self, join_work: dist.Work | None, divide_by_initial: bool) -> None:
        self.graphs: list[int] = []
        self.order: list[ReduceBucket] | None = None
        self.cursor = 0  # buckets launched
        self.written = 0  # buckets whose gradients are written (and stepped, if an optimizer is)
        self.forward_at = time.perf_counter()
        self.started = 0.0
        self.scale: float | None = None
        # Under Join: the all-reduce counting the ranks that have not joined (DDP's rule:
        # divide by them instead of the world size when divide_by_initial_world_size=False).
        self.join_work = None if divide_by_initial else join_work
        self.joining = join_work is not None  # inside a Join context
        self.streaming = False  # buckets written (an optimizer stepping them) during backward

    def stats(self, index: int, waited_s: float) -> StepStats:
        """The figures of this step, the ``index``-th synchronized one, as it ends."""
        order = self.order or []
        return StepStats(
            step=index,
            fwd_bwd_ms=(time.perf_counter() - self.forward_at) * 1e3,
            buckets=len(order),
            bytes=sum(b.nbytes for b in order),
            tail_bytes=sum(b.nbytes for b in order if b.tail),
            wait_ms=waited_s * 1e3,
            launch_ms=[(b.launched_at - self.started) * 1e3 for b in order],
        )


def claimed_by(graph_buckets: Mapping[int, Sequence[Sequence[str]]], graphs: Sequence[int]) -> set[str]:
    """Parameters bucketed by ``graphs``.

    Example:
        >>> sorted(claimed_by({0: [["a"], ["b"]]}, [0]))
        ['a', 'b']
    """
    return {p for g in graphs for b in graph_buckets.get(g, ()) for p in b}


def _groups(
    graph_buckets: Mapping[int, Sequence[Sequence[str]]], graphs: Sequence[int], names: Sequence[str]
) -> tuple[list[list[str]], int]:
    """Parameter groups in launch order, and the index of the first group of the tail."""
    claimed: set[str] = set()
    per_graph = []
    # First use wins: claim graphs in forward order, launch them in reverse.
    for g in graphs:
        mine = [[p for p in b if p not in claimed] for b in graph_buckets.get(g, ())]
        claimed.update(p for b in mine for p in b)
        per_graph.append(mine)
    groups: list[list[str]] = []
    for mine in reversed(per_graph):
        groups.extend(b for b in mine if b)
    # The tail: the first forward segment's bucket and the trailing bucket, both final
    # only when backward ends.
    tail_from = max(len(groups) - 1, 0)
    rest = [n for n in reversed(list(names)) if n not in claimed]
    if rest:
        groups.append(rest)
    return groups, tail_from


def layout_groups(
    graph_buckets: Mapping[int, Sequence[Sequence[str]]], graphs: Sequence[int], names: Sequence[str]
) -> list[list[str]]:
    """The parameter groups of a step, in launch order (what the ranks compare to freeze a layout).

    Example:
        >>> layout_groups({0: [["b"], ["a"]]}, [0], ["a", "b", "c"])
        [['b'], ['a'], ['c']]
    """
    return _groups(graph_buckets, graphs, names)[0]


def build_schedule(
    graph_buckets: Mapping[int, Sequence[Sequence[str]]],
    graphs: Sequence[int],
    params: Mapping[str, torch.nn.Parameter],
    *,
    sparse: set[int],
    compression: str | None,
    compress_tail_only: bool,
    grad_as_view: bool,
    fresh_grads: bool = False,
    rows: Mapping[int, int] | None = None,
) -> list[ReduceBucket]:
    """The step's buckets in launch order: one flat bucket per group and dtype, one sparse
    bucket per parameter with a sparse gradient (``sparse``: their ``id``), one row bucket
    per embedding table reduced by rows (``rows``: their ``id`` -> the indices a step looks up
    in it on each rank, 0 if not known; ``runtime/row_buckets.py``).
    ``fresh_grads``: flat buckets write new ``.grad`` tensors over any they did not make
    (Note [Gradients in CUDA-graph memory]).

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> order = build_schedule({0: [["weight", "bias"]]}, [0], dict(lin.named_parameters()),
        ...                        sparse=set(), compression=None, compress_tail_only=False, grad_as_view=False)
        >>> [b.names for b in order]
        [['weight', 'bias']]
    """
    rows = rows or {}
    groups, tail_from = _groups(graph_buckets, graphs, list(params))
    order: list[ReduceBucket] = []
    for g, names in enumerate(groups):
        first = len(order)
        scheme = compression if g >= tail_from or not compress_tail_only else None
        by_dtype: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.nn.Parameter]]] = {}
        for n in names:
            p = params[n]
            if id(p) in sparse:
                order.append(SparseBucket(len(order), n, p))
            elif id(p) in rows and p.dim() == 2 and p.numel() * p.element_size() >= ROWS_MIN_BYTES:
                order.append(RowBucket(len(order), n, p, compression=scheme, lookups=rows[id(p)]))
            else:
                by_dtype.setdefault((p.dtype, p.device), []).append((n, p))
        for members in by_dtype.values():
            order.append(
                FlatBucket(
                    len(order),
                    members,
                    compression=scheme,
                    grad_as_view=grad_as_view,
                    fresh_grads=fresh_grads,
                )
            )
        for b in order[first:]:
            b.tail = g >= tail_from  # final only when backward ends (StepStats.tail_bytes)
    return order


def static_groups(params: Mapping[str, torch.nn.Parameter], *, cap: int, first_cap: int) -> list[list[str]]:
    """DDP's layout: parameters in reverse registration order, cut at ``first_cap`` bytes, then
    at ``cap``; the same on every rank whatever graphs ran (Note [Graphs that differ by data]).

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> static_groups(dict(lin.named_parameters()), cap=64, first_cap=16)
        [['bias'], ['weight']]
    """
    groups: list[list[str]] = []
    current: list[str] = []
    size, limit = 0, first_cap
    for name, p in reversed(list(params.items())):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > limit:
            groups.append(current)
            current, size, limit = [], 0, cap
        current.append(name)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def report_uncompiled(
    order: Sequence[ReduceBucket],
    claimed: set[str],
    params: Mapping[str, torch.nn.Parameter],
    log: logging.Logger,
) -> None:
    """Log the trainable parameters whose gradient came from code no graph of the step contains
    (a frame TorchDynamo skipped, eager code between graphs): they train uncompiled and wait
    for the trailing bucket. A warning from 10% of the bytes.

    Example:
        >>> report_uncompiled([], set(), {}, logging.getLogger("x"))  # nothing to say
    """
    eager = [(n, p) for b in order for n, p, r in zip(b.names, b.params, b.ready) if r and n not in claimed]
    if not eager:
        return
    nbytes = sum(p.numel() * p.element_size() for _, p in eager)
    share = nbytes / max(sum(p.numel() * p.element_size() for p in params.values()), 1)
    log.log(
        logging.WARNING if share >= 0.1 else logging.INFO,
        "%d of %d trainable parameters (%.2f MB, %.0f%% of the bytes; %s%s) got their gradients from "
        "code that no captured graph contains (a frame TorchDynamo skipped, or eager code between "
        "graphs): that code runs uncompiled, and its gradients are all-reduced in one bucket when "
        "backward ends, without overlap. TORCH_LOGS=graph_breaks or distcompile.explain(model, "
        "*inputs) shows why.",
        len(eager),
        len(params),
        nbytes / 1e6,
        100 * share,
        ", ".join(n for n, _ in eager[:3]),
        ", ..." if len(eager) > 3 else "",
    )
