"""The cost model behind ``bucket_cap_mb="auto"``: its numbers and their arithmetic.

The planner (``search.GraphCosts``) needs three things to simulate a step: how long an
all-reduce of *b* bytes takes (``latency + b / bandwidth``), how fast this machine
computes, and how much work each forward node's backward does (backward taken as twice
forward). This module holds the fitted figures and turns them into planner inputs; the
measuring is ``runtime.measure`` (it needs the process group) and the FLOP counting is
``capture.flops`` (it runs the graph on fake tensors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .search import GraphCosts

__all__ = ["CostModel", "fit_line", "reuse_remembered", "snap"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Link and compute speeds measured on the process group, equal on every rank.

    Attributes:
        latency_s: Fixed seconds of one all-reduce.
        bytes_per_s: All-reduce throughput in buffer bytes per second.
        flops_per_s: Dense matrix-multiply rate of one rank (every rank computing at once).
        cpu_s_per_byte: Compute seconds a rank loses per all-reduced byte while its
            all-reduces run beside its backward (ranks sharing CPU cores with the
            communication's threads; 0 on GPUs).
    """

    latency_s: float
    bytes_per_s: float
    flops_per_s: float
    cpu_s_per_byte: float = 0.0

    def graph_costs(
        self,
        flops: Sequence[float],
        *,
        timed: Sequence[float | None] | None = None,
        wire_scale: float = 1.0,
        tail_wire_scale: float = 1.0,
        rows_nbytes: dict[str, int] | None = None,
    ) -> GraphCosts:
        """Planner inputs for a graph whose nodes do ``flops`` forward FLOPs each.

        ``timed``: each node's backward as timed on this machine, in FLOPs at the
        matrix-multiply rate (``capture.timing.backward_work``); a node not timed (or
        ``timed=None``) costs twice its forward FLOPs. ``wire_scale`` / ``tail_wire_scale``: bytes sent per gradient byte for the
        buckets / for the first segment's bucket (0.5 when compressed to 16 bits).
        ``rows_nbytes``: shared parameters are reduced by use, and these tables by rows
        (``GraphCosts.rows_nbytes``); ``None``: neither.

        Example:
            >>> CostModel(1e-4, 1e8, 1e10).graph_costs([2e9, 0.0], timed=[None, 1e9]).node_backward_s
            (0.4, 0.1)
        """
        timed = timed or [None] * len(flops)
        return GraphCosts(
            node_backward_s=tuple(
                (2 * f if w is None else w) / self.flops_per_s for f, w in zip(flops, timed)
            ),
            cpu_s_per_byte=self.cpu_s_per_byte,
            timed_nodes=sum(w is not None for w in timed),
            latency_s=self.latency_s,
            bytes_per_s=self.bytes_per_s,
            wire_scale=wire_scale,
            first_segment_wire_scale=tail_wire_scale,
            split_shared=rows_nbytes is not None,
            rows_nbytes=rows_nbytes,
        )

    def describe(self) -> str:
        """One line for logs and plan tables.

        Example:
            >>> CostModel(1e-4, 1.25e8, 2e10).describe()
            'all-reduce 0.10 ms + 8.00 ms/MB (125 MB/s); compute 20.0 GFLOP/s'
            >>> CostModel(1e-4, 1.25e8, 2e10, cpu_s_per_byte=2e-9).describe()[-28:]
            '; 2.00 ms of compute lost/MB'
        """
        cpu = f"; {self.cpu_s_per_byte * 1e9:.2f} ms of compute lost/MB" if self.cpu_s_per_byte else ""
        return (
            f"all-reduce {self.latency_s * 1e3:.2f} ms + {1e9 / self.bytes_per_s:.2f} ms/MB "
            f"({self.bytes_per_s / 1e6:.0f} MB/s); compute {self.flops_per_s / 1e9:.1f} GFLOP/s{cpu}"
        )


#: A remembered cost model is reused while new measurements are within this factor: on
#: loopback the bandwidth wandered by more than 1.5x between runs, while a different link
#: (1 Gbit/s vs 200 Mbit/s: 5x) or machine moves by more.
REUSE_WITHIN = 3.0


def reuse_remembered(new: float, old: float, field: str) -> bool:
    """Whether a remembered figure still stands for a new measurement of it (within ``REUSE_WITHIN``).

    Example:
        >>> reuse_remembered(1.2e8, 1.0e8, "bytes_per_s"), reuse_remembered(5e8, 1e8, "bytes_per_s")
        (True, False)
    """
    if field == "latency_s" and abs(new - old) < 5e-4:
        return True  # sub-millisecond latencies are mostly noise, and plans do not hinge on them
    if field == "cpu_s_per_byte" and min(new, old) < 1e-10:
        return max(new, old) < 1e-10  # under 0.1 ms/MB: none to speak of (a core or a GPU per rank)
    return 1 / REUSE_WITHIN <= new / old <= REUSE_WITHIN


def snap(x: float) -> float:
    """Round to a quarter-octave grid (19% steps).

    Measurements wobble by a few percent from run to run; unrounded, a restarted job could
    plan other segments and miss the compile cache. The plan hardly changes within 19%.

    Example:
        >>> snap(1.0e8) == snap(1.03e8)
        True
    """
    return 2.0 ** (round(math.log2(x) * 4) / 4)


def fit_line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``time = latency + size * per_byte``, kept physical (both positive).

    Example:
        >>> fit_line([0, 100], [1e-3, 2e-3])
        (0.001, 1e-05)
    """
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    per_byte = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx
    # A link faster than 100 GB/s is noise on these probe sizes; so is a negative latency.
    per_byte = max(per_byte, 1e-11)
    return max(my - per_byte * mx, 1e-5), per_byte
