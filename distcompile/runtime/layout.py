"""Which buckets a step's gradients travel in: the layout, frozen or not, and its cache.

The reducer (Note [Bucketed all-reduce]) asks for the schedule of the graphs a step ran;
this module decides it: the graphs' planned buckets, with shared parameters' parts and
row buckets where they apply (Note [Shared weights reduced by use]), or, once the layout
is frozen (Note [Graphs that differ by data]), one layout the ranks agreed on or DDP's.
Schedules are cached per set of graphs; anything that changes how buckets are built (a
new communication hook, a table's parts leaving or coming back) clears the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..planning.plan import Plan
from ..planning.split import SplitPlan
from .row_buckets import RowBucket
from .schedule import ReduceBucket, build_schedule, claimed_by, layout_groups, static_groups
from .shared_weights import SharedParts

__all__ = ["BucketForm", "Layouts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BucketForm:
    """How buckets are built, set by the reducer's options and its communication hook.

    Attributes:
        compression: ``None``, ``"fp16"`` or ``"bf16"`` (``None`` under a hook: it decides).
        compress_tail_only: Compress only the first segment's bucket.
        grad_as_view: ``gradient_as_bucket_view``.
        fresh_grads: Gradients live in CUDA-graph memory (Note [Gradients in CUDA-graph memory]).
        splits: Shared parameters' parts and row buckets apply (not under a hook).
    """

    compression: str | None
    compress_tail_only: bool
    grad_as_view: bool
    fresh_grads: bool
    splits: bool


class Layouts:
    """The graphs' planned buckets, the frozen layout, and the schedules built from them.

    Example:
        >>> # layouts = Layouts(params, sparse=set(), bucket_caps=(25 << 20, 1 << 20), agree=lambda g: g)
        >>> # order, locate = layouts.schedule((0,), form)
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        *,
        sparse: set[int],
        bucket_caps: tuple[int, int],
        agree: Callable[[list[list[str]]], list[list[str]] | None],
        freeze: bool = False,
    ) -> None:
        self.params = dict(params)
        self.sparse = set(sparse)
        self.bucket_caps = bucket_caps
        self.agree = agree
        self.parts = SharedParts(self.params)  # Note [Shared weights reduced by use]
        self._graph_buckets: dict[int, list[list[str]]] = {}
        self._static: list[list[str]] | None = None  # the frozen layout
        self._static_rows: dict[int, int] = {}  # its row-reduced tables -> their lookup bound
        self._freeze = freeze
        # graphs that ran -> (buckets in launch order, id(param) -> (bucket, slot))
        self.schedules: dict[tuple[int, ...], tuple[list[ReduceBucket], dict]] = {}
        self.params_by_id = {id(p): p for p in self.params.values()}
        self._accumulated: set[int] = set()  # of those, the ones holding a gradient at the step's start

    def add_graph(
        self, graph_id: int, buckets: Sequence[Sequence[str]], split: SplitPlan | None, plan: Plan | None
    ) -> None:
        """Register a graph's planned buckets (parameter names, gradient order), and its parts."""
        self._graph_buckets[graph_id] = [list(b) for b in buckets]
        if split is not None and plan is not None:
            self.parts.add_graph(graph_id, split, plan)

    def claimed_by(self, graphs: Sequence[int]) -> set[str]:
        """Parameters bucketed by ``graphs``."""
        return claimed_by(self._graph_buckets, graphs)

    def freeze(self) -> None:
        """From the next schedule on, one layout whatever graphs ran (idempotent)."""
        if self._static is None:
            self._freeze = True

    def clear(self) -> None:
        """Forget the cached schedules (buckets are rebuilt at the next step)."""
        self.schedules.clear()

    def begin_step(self) -> None:
        """A synchronized step opens: note the row-reduced tables that hold a gradient already
        (their rows are not bounded by the step's lookups: ``runtime/row_buckets.py``)."""
        self._accumulated = {k for k in self.parts.row_ids() if self.params_by_id[k].grad is not None}

    def schedule(self, graphs: tuple[int, ...], form: BucketForm) -> tuple[list[ReduceBucket], dict]:
        """The buckets of a step that ran ``graphs``, in launch order, and where each parameter is."""
        if self._freeze:
            self._freeze = False
            self._static = self._frozen_groups(graphs)
            self.schedules.clear()
        if self._static is not None:
            if self._static_rows:
                self._check_rows(graphs)
            graphs = (-1,)  # one schedule: every rank's the same
        cached = self.schedules.get(graphs)
        if cached is not None:
            for b in cached[0]:
                b.reset()
            self._mark_accumulated(cached[0])
            return cached
        for buckets, params, rows in self._layouts(graphs, form.splits):
            order = build_schedule(
                buckets,
                graphs,
                params,
                sparse=self.sparse,
                compression=form.compression,
                compress_tail_only=form.compress_tail_only,
                grad_as_view=form.grad_as_view,
                fresh_grads=form.fresh_grads,
                rows=rows,
            )
            if self.parts.in_order(order):
                break
        locate = {id(p): (b, i) for b in order for i, p in enumerate(b.params)}
        self.schedules[graphs] = (order, locate)
        self._mark_accumulated(order)
        log.debug("schedule for graphs %s: %s", graphs, [(b.index, len(b.params), b.nbytes) for b in order])
        return order, locate

    def _mark_accumulated(self, order: list[ReduceBucket]) -> None:
        for b in order:
            if isinstance(b, RowBucket):
                b.accumulated = id(b.params[0]) in self._accumulated

    def _frozen_groups(self, graphs: tuple[int, ...]) -> list[list[str]]:
        # The ranks compare the layout their graphs give: the same everywhere, it is kept
        # (graph-aligned, as planned); not, they take DDP's (reverse parameter order, cut at
        # the bucket caps).
        buckets, params, rows = self.parts.layout(self._graph_buckets, graphs) or (
            self._graph_buckets,
            self.params,
            {},
        )
        # The row buckets' bounds (indices looked up a step, on each rank) size their all-reduce:
        # agreed with the layout, so every rank sends the same number of rows.
        names = {id(p): n for n, p in self.params.items()}
        bounds = [f"rows {names[k]}: {v}" for k, v in sorted(rows.items(), key=lambda kv: names[kv[0]])]
        agreed = self.agree(layout_groups(buckets, graphs, list(params)) + ([bounds] if bounds else []))
        self._static_rows = rows if agreed is not None else {}
        if agreed is not None:
            return agreed[:-1] if bounds else agreed
        cap, first_cap = self.bucket_caps
        log.info(
            "the ranks' graphs gave different bucket layouts: gradients travel in DDP's (reverse parameter order)"
        )
        return static_groups(self.params, cap=cap, first_cap=first_cap)

    def _check_rows(self, graphs: tuple[int, ...]) -> None:
        """A step whose graphs look up more indices in a table than the frozen layout's bound
        would send too few rows: refused (a new batch or sequence size after the first step)."""
        now = self.parts.row_lookups(graphs)
        for key, bound in self._static_rows.items():
            if bound and now.get(key, 0) > bound:
                name = next(n for n, p in self.params.items() if id(p) == key)
                raise ConfigError(
                    f"embedding table {name!r} is reduced by the rows looked up, at most {bound} indices a "
                    f"step on each rank (fixed at the first step, with every rank), but this step's graphs "
                    f"look up {now[key]}: its all-reduce would leave rows out. Keep the batch and sequence "
                    "sizes of the first step (smaller is fine), mark the varying dimension dynamic from the "
                    "start (torch._dynamo.mark_dynamic, or wrap(..., dynamic=True)), or wrap(..., "
                    "split_shared=False)."
                )

    def _layouts(
        self, graphs: tuple[int, ...], splits: bool
    ) -> list[tuple[Mapping, Mapping, Mapping[int, int]]]:
        """Bucket layouts to try, best first: with parts and row buckets (Note [Shared weights
        reduced by use]; not under a communication hook), then without."""
        if self._static is not None:
            layouts = self.parts.static_layouts(self._static, self._static_rows)
        else:
            layouts = [
                self.parts.layout(self._graph_buckets, graphs),
                (self._graph_buckets, self.params, {}),
            ]
        if not splits and any(x is not None for x in layouts[:-1]):
            log.debug("a communication hook reduces the buckets: shared parameters go whole, as under DDP")
        return [x for x in layouts[:-1] if x is not None and splits] + layouts[-1:]
