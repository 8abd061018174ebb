"""What a captured graph costs to run and to reduce, for ``bucket_cap_mb="auto"``.

The planner chooses segments by simulating the schedule (``planning/search.py``); it
needs each node's compute time and the bytes each bucket sends, which this module
reads off the captured graph: FLOPs per node (``capture/flops.py``) priced by the
measured compute speed, each node's backward timed on this machine where the ranks agree
on one rank's timing (``capture/timing.py``), and, for embedding tables reduced by rows,
the rows a step looks up.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import torch
from torch import fx

from ..capture.flops import fake_run
from ..capture.graph import CapturedGraph, lookup_indices
from ..capture.timing import backward_work
from ..planning.costs import CostModel
from ..planning.plan import GraphCosts

__all__ = ["graph_costs", "planned_by"]

log = logging.getLogger(__name__)


def graph_costs(
    model: CostModel | None,
    gm: fx.GraphModule,
    example_inputs: list,
    captured: CapturedGraph,
    *,
    first_graph: bool,
    compressed: bool,
    tail_only: bool,
    ranks: int,
    rows: bool,
    agree: Callable[[Callable[[], str]], str | None] = lambda make: None,
) -> GraphCosts | None:
    """The costs the planner simulates for ``captured``; ``None`` when planning by DDP's caps
    (no measured costs, or FLOPs that cannot be counted). ``compressed``: 16-bit compression,
    of the tail bucket alone when ``tail_only``; ``rows``: tables may be reduced by rows.
    ``agree(make)``: one rank's ``make()`` on every rank (``Lockstep.first_says``), or
    ``None`` where the ranks do not plan this graph together: backward is then priced by
    FLOPs alone (timings differ a little between ranks, and ranks planning together must
    plan alike).

    Example:
        >>> # graph_costs(model, gm, inputs, captured, first_graph=True, compressed=False,
        >>> #             tail_only=False, ranks=8, rows=True)
    """
    if model is None:
        return None
    try:
        flops, values = fake_run(gm, example_inputs, captured.body)
    except Exception as exc:  # noqa: BLE001 - the graph is still planned, by DDP's caps
        # Deterministic for a given graph, so every rank falls back alike (and the
        # plan agreement check would say so if not).
        log.warning(
            "bucket_cap_mb='auto': cannot count this graph's FLOPs (%s: %s); planning it with "
            "DDP's bucket caps instead",
            type(exc).__name__,
            exc,
        )
        return None
    # 16-bit compression halves the bytes on the wire: of every bucket, or of the tail
    # alone, which is the first segment of the step's first graph.
    half = 0.5 if compressed else 1.0
    tail = half if first_graph or not tail_only else 1.0
    wire = 1.0 if tail_only else half
    device = next((p.device for p in captured.params.values()), torch.device("cpu"))
    timed = json.loads(agree(lambda: _timed(values, captured.body, device)) or "null")
    if not timed or len(timed) != len(flops):  # not timed, or another graph (the agreement says so)
        timed = None
    return model.graph_costs(
        flops,
        timed=timed,
        wire_scale=wire,
        tail_wire_scale=tail,
        rows_nbytes=_rows_nbytes(captured, ranks) if rows else None,
    )


def _rows_nbytes(captured: CapturedGraph, ranks: int) -> dict[str, int]:
    # What a row bucket costs the link, as all-reduced bytes (the model's unit), at most the
    # table: every rank's looked-up rows with their int64 indices, all-gathered, which moves
    # half the bytes of an all-reduce of the same size (Note [Rows gathered, not agreed]).
    out = {}
    for name, count in lookup_indices(captured).items():
        table = captured.params[name]
        row = table.numel() // max(table.shape[0], 1) * table.element_size() if table.dim() else 0
        out[name] = min(table.numel() * table.element_size(), count * ranks * (row + 8) // 2)
    return out


def _timed(values: dict, body: list, device: torch.device) -> str:
    # What the first rank publishes: never an exception (its peers wait for the text).
    try:
        return json.dumps(backward_work(values, body, device=device))
    except Exception as exc:  # noqa: BLE001 - priced by FLOPs
        log.warning(
            "bucket_cap_mb='auto': cannot time this graph's backward (%s: %s)", type(exc).__name__, exc
        )
        return "null"


def planned_by(model: CostModel | None, costs: GraphCosts | None, cap: int, first_cap: int) -> str:
    """How a graph's plan was made, for the compile log and ``explain``.

    Example:
        >>> planned_by(None, None, 25 * 2**20, 2**20)
        'bucket caps: 25 MiB, first bucket 1 MiB'
    """
    if costs is None or model is None:
        return f"bucket caps: {cap / 2**20:g} MiB, first bucket {first_cap / 2**20:g} MiB"
    timed = (
        f"; {costs.timed_nodes} of {len(costs.node_backward_s)} backward nodes timed"
        if costs.timed_nodes
        else ""
    )
    return f"measured costs: {model.describe()}{timed}"
