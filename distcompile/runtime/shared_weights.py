"""The parts of shared parameters on the reducer's side (Note [Shared weights reduced by use]).

A part travels in a bucket like a parameter: the bucket sees a *holder*, a detached alias
of the parameter (no memory of its own) whose ``.grad`` is the part's gradient. The
holder's bucket comes before the parameter's own bucket in launch order, so by the time
the parameter's reduced gradient is written, its parts are too, and are added to it.

A table whose row bucket found it could carry most rows (the bound, over all ranks) gains
nothing from its parts: its own bucket carries the whole table at the end anyway, and the
parts' bytes are sent twice. For the next ``DENSE_FOR`` steps it is reduced whole, as under
DDP (no parts, no row question); then the split is tried again. Not under ``Join``, where a
rank that joined replays the layout of its last step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from ..planning.plan import Plan
from ..planning.split import SplitPlan
from .row_buckets import DENSE_FOR, RowBucket

__all__ = ["SharedParts"]

log = logging.getLogger(__name__)


class SharedParts:
    """Holders, groups and row-reduced parameters of one reducer's graphs.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> parts = SharedParts({"w": w})
        >>> parts.layout({0: [["w"]]}, (0,)) is None  # no graph with parts
        True
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        self.params = params
        self.holders: dict[str, torch.Tensor] = {}
        self._of: dict[int, list[torch.Tensor]] = {}  # id(param) -> its holders
        self._graphs: dict[int, tuple[list[tuple[str, ...]], tuple[str, ...], tuple[str, ...], dict]] = {}
        self.whole: dict[str, int] = {}  # tables found dense -> steps left reduced whole

    def add_graph(self, graph_id: int, split: SplitPlan, plan: Plan) -> None:
        """Remember graph ``graph_id``'s groups with its parts, and its row-reduced parameters."""
        if not split.parts and not split.rows:
            self._graphs.pop(graph_id, None)
            return
        names = tuple(p.name for p in split.parts)
        self._graphs[graph_id] = (split.groups(plan), names, split.rows, dict(split.lookups))
        for part in split.parts:
            if part.name not in self.holders:
                p = self.params[part.param]
                holder = self.holders[part.name] = p.detach()
                self._of.setdefault(id(p), []).append(holder)

    def parted(self) -> set[int]:
        """``id``s of the parameters some of whose uses' gradients are taken as parts."""
        return set(self._of)

    def layout(
        self, graph_buckets: Mapping[int, Sequence[Sequence[str]]], graphs: Sequence[int]
    ) -> tuple[dict, dict[str, torch.Tensor], dict[int, int]] | None:
        """The groups, parameters (holders included) and row-reduced tables (``row_lookups``) for a
        step that ran ``graphs``; ``None`` when none of them has parts or row-reduced parameters."""
        ran = [g for g in graphs if g in self._graphs]
        if not ran:
            return None
        off = self._off()
        groups = {
            g: [t for t in (tuple(n for n in x if n not in off) for x in self._graphs[g][0]) if t]
            if g in self._graphs
            else list(b)
            for g, b in graph_buckets.items()
        }
        params = dict(self.params)
        params.update((n, self.holders[n]) for g in ran for n in self._graphs[g][1] if n not in off)
        rows = self.row_lookups(ran)
        return groups, params, rows

    def row_ids(self) -> set[int]:
        """``id`` of every table some graph reduces by rows."""
        return {id(self.params[n]) for entry in self._graphs.values() for n in entry[2]}

    def row_lookups(self, graphs: Sequence[int]) -> dict[int, int]:
        """``id`` of each table reduced by rows in a step that ran ``graphs`` -> the indices those
        graphs look up in it on this rank (an upper bound of its rows touched here), or 0 where
        a count is not known (a symbolic size): ``RowBucket`` then sends the whole table."""
        found: dict[int, int] = {}
        for g in graphs:
            if g not in self._graphs:
                continue
            _, _, rows, lookups = self._graphs[g]
            for n in rows:
                if n in self.whole:
                    continue
                key, known = id(self.params[n]), lookups.get(n, 0)
                before = found.get(key)
                found[key] = 0 if not known or before == 0 else (before or 0) + known
        return found

    def static_layouts(
        self, static: Sequence[Sequence[str]], rows: dict[int, int]
    ) -> list[tuple[dict, dict, dict[int, int]]]:
        """The frozen layout ``static`` (holders' names included) with its parts and row buckets,
        then without (Note [Graphs that differ by data])."""
        holders = {n: h for n, h in self.holders.items() if any(n in b for b in static)}
        off = self._off()
        whole = {id(self.params[n]) for n in self.whole}
        split = [[n for n in b if n not in off] for b in static]
        plain = [[n for n in b if n not in holders] for b in static]
        return [
            (
                {-1: [b for b in split if b]},
                {**self.params, **{n: h for n, h in holders.items() if n not in off}},
                {k: v for k, v in rows.items() if k not in whole},
            ),
            ({-1: [b for b in plain if b]}, dict(self.params), {}),
        ]

    def _off(self) -> set[str]:
        """The holders of tables reduced whole for now."""
        return {n for n in self.holders if n.rsplit("@", 1)[0] in self.whole}

    def settle(self, order: Sequence, *, joining: bool) -> bool:
        """After a step's buckets are written: reduce whole, for ``DENSE_FOR`` steps, the tables
        with parts whose row bucket found them dense; count the others down. True when the
        layout changes (the reducer then rebuilds its buckets). Nothing changes under ``Join``."""
        if joining or not self._of:
            return False
        changed = False
        for name in list(self.whole):
            self.whole[name] -= 1
            if self.whole[name] <= 0:
                del self.whole[name]
                changed = True
        for b in order:
            if isinstance(b, RowBucket) and b.found_dense and id(b.params[0]) in self._of:
                name = b.names[0]
                log.debug("%s: most rows touched; reduced whole for %d steps", name, DENSE_FOR)
                self.whole[name] = DENSE_FOR
                changed = True
        return changed

    def in_order(self, order: Sequence) -> bool:
        """Whether every holder's bucket launches before its parameter's (else the parts could
        not be added when the parameter is written)."""
        at = {id(p): b.index for b in order for p in b.params}
        for pid, holders in self._of.items():
            for h in holders:
                if id(h) in at and at[id(h)] >= at.get(pid, -1):
                    log.debug("a part's bucket would launch after its parameter's: reduced whole this step")
                    return False
        return True

    def clear(self) -> None:
        """Forget the parts' gradients (a new step opens)."""
        for h in self.holders.values():
            h.grad = None

    def accept(
        self, name: str, grad: torch.Tensor, locate: Mapping[int, tuple], cursor: int
    ) -> torch.Tensor | None:
        """The holder of part ``name`` with ``grad`` as its gradient, if the step's buckets carry
        it and its bucket has not been launched; else ``None`` (the gradient stays where it was)."""
        holder = self.holders.get(name)
        found = locate.get(id(holder)) if holder is not None else None
        if found is None:
            return None
        bucket, i = found
        if bucket.ready[i] or bucket.index < cursor:
            return None
        holder.grad = grad
        return holder

    def add_to(self, bucket: object) -> None:
        """After ``bucket`` is written: add the reduced parts of its parameters to their ``.grad``."""
        if not self._of or not self._of.keys() & map(id, bucket.params):  # type: ignore[attr-defined]
            return  # most buckets: no parameter with parts (one set intersection, at C level)
        for p in bucket.params:  # type: ignore[attr-defined]
            holders = self._of.get(id(p))
            if not holders:
                continue
            grads = [h.grad for h in holders if h.grad is not None]
            for h in holders:
                h.grad = None
            if not grads:
                continue
            if p.grad is not None and len(grads) == 1:
                p.grad.add_(grads[0])  # the common step: one pass over the table, no copy of it
                continue
            total = grads[0].clone() if len(grads) == 1 else torch.stack(grads).sum(0)
            if p.grad is None:  # a copy: a part's gradient may be a view of its bucket
                p.grad = total.to(p.dtype)
            else:
                p.grad.add_(total)
