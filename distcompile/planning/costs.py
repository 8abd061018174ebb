"""Measured costs behind ``bucket_cap_mb="auto"``: the link, the compute rate, each node's work.

The planner (``_planning.GraphCosts``) needs three things to simulate a step: how long an
all-reduce of *b* bytes takes (``latency + b / bandwidth``, measured on the real process
group when ``wrap`` runs), how fast this machine computes (a matrix multiply, timed), and
how much work each forward node's backward does (FLOPs counted on the graph's fake
tensors, backward taken as twice forward). Measurements are agreed across ranks (the
slowest rank's numbers), so every rank plans the same segments.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx

from .. import _torch_compat as compat
from .plan import GraphCosts

__all__ = ["CostModel", "measure_costs", "node_flops", "time_allreduce"]

log = logging.getLogger(__name__)

#: All-reduce sizes timed to fit latency and bandwidth (bytes).
_PROBE_BYTES = (64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
#: Repetitions per probe size; the fastest is kept (noise only ever adds time).
_PROBE_REPEATS = 5


@dataclass(frozen=True, slots=True)
class CostModel:
    """Link and compute speeds measured on the process group, equal on every rank.

    Attributes:
        latency_s: Fixed seconds of one all-reduce.
        bytes_per_s: All-reduce throughput in buffer bytes per second.
        flops_per_s: Dense matrix-multiply rate of one rank.
    """

    latency_s: float
    bytes_per_s: float
    flops_per_s: float

    def graph_costs(
        self, flops: Sequence[float], *, wire_scale: float = 1.0, tail_wire_scale: float = 1.0
    ) -> GraphCosts:
        """Planner inputs for a graph whose nodes do ``flops`` forward FLOPs each.

        ``wire_scale`` / ``tail_wire_scale``: bytes sent per gradient byte for the
        buckets / for the first segment's bucket (0.5 when compressed to 16 bits).

        Example:
            >>> CostModel(1e-4, 1e8, 1e10).graph_costs([2e9]).node_backward_s
            (0.4,)
        """
        return GraphCosts(
            node_backward_s=tuple(2 * f / self.flops_per_s for f in flops),
            latency_s=self.latency_s,
            bytes_per_s=self.bytes_per_s,
            wire_scale=wire_scale,
            first_segment_wire_scale=tail_wire_scale,
        )

    def describe(self) -> str:
        """One line for logs and plan tables.

        Example:
            >>> CostModel(1e-4, 1.25e8, 2e10).describe()
            'all-reduce 0.10 ms + 8.00 ms/MB (125 MB/s); compute 20.0 GFLOP/s'
        """
        return (
            f"all-reduce {self.latency_s * 1e3:.2f} ms + {1e9 / self.bytes_per_s:.2f} ms/MB "
            f"({self.bytes_per_s / 1e6:.0f} MB/s); compute {self.flops_per_s / 1e9:.1f} GFLOP/s"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_allreduce(
    nbytes: int,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    repeats: int = _PROBE_REPEATS,
    pick: Callable[[list[float]], float] = min,
) -> float:
    """Seconds one all-reduce of ``nbytes`` takes on ``group``: ``pick`` of ``repeats`` timings.

    A collective: every rank must call it. Each timing starts after a barrier, so rank
    skew does not count as link time; one untimed all-reduce warms the connections first.

    Example:
        >>> # time_allreduce(4 * 2**20)  -> 0.034 (seconds, 1 Gbit/s link, 2 ranks)
    """
    device = device or torch.device("cpu")
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return pick(times)


def _time_matmul(device: torch.device) -> float:
    n = 384
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    times = []
    for _ in range(20):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    # The fastest run: a busy machine only ever slows a run down (the median of 5 wandered
    # between 54 and 88 GFLOP/s across the benchmark's variants on these 2 cores).
    return 2 * n**3 / max(min(times), 1e-9)


def measure_costs(
    *, group: dist.ProcessGroup | None, device: torch.device, remember_dir: str | None = None
) -> CostModel:
    """Time all-reduces and a matrix multiply on every rank; return the agreed model.

    A collective: every rank of ``group`` must call it. Takes about six all-reduces of
    each probe size (64 KiB, 1 MiB, 4 MiB): 0.2 s on a 1 Gbit/s link, 1.2 s at 200 Mbit/s.

    With ``remember_dir``, the group's first rank keeps the model in a file there and the
    next run reuses it while every new measurement is within a factor of
    ``_REUSE_WITHIN`` of it: a restarted job then plans the same segments and finds them
    in the compile cache, instead of re-planning on a few percent of noise.

    Example:
        >>> # cost = measure_costs(group=None, device=torch.device("cpu"))
        >>> # cost.describe() -> 'all-reduce 0.31 ms + 8.1 ms/MB (123 MB/s); compute 31.2 GFLOP/s'
    """
    times = [time_allreduce(b, group=group, device=device) for b in _PROBE_BYTES]
    rate = _time_matmul(device)
    # The slowest rank decides, identically everywhere: max of times, min of rates.
    agreed = torch.tensor([*times, 1.0 / rate], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    *times, inv_rate = agreed.tolist()
    latency, per_byte = _fit_line(_PROBE_BYTES, times)
    model = CostModel(
        latency_s=_snap(latency), bytes_per_s=_snap(1.0 / per_byte), flops_per_s=_snap(1.0 / inv_rate)
    )
    if remember_dir is not None:
        model = _remembered(model, group=group, device=device, path=_memory_path(remember_dir, group, device))
    log.info("bucket_cap_mb='auto': %s", model.describe())
    return model


#: A remembered cost model is reused while new measurements are within this factor: on
#: loopback the bandwidth wandered by more than 1.5x between runs, while a different link
#: (1 Gbit/s vs 200 Mbit/s: 5x) or machine moves by more.
_REUSE_WITHIN = 3.0


def _memory_path(directory: str, group: dist.ProcessGroup | None, device: torch.device) -> str:
    return os.path.join(directory, f"costs-world{dist.get_world_size(group)}-{device.type}.json")


def _close(new: float, old: float, field: str) -> bool:
    if field == "latency_s" and abs(new - old) < 5e-4:
        return True  # sub-millisecond latencies are mostly noise, and plans do not hinge on them
    return 1 / _REUSE_WITHIN <= new / old <= _REUSE_WITHIN


def _remembered(
    measured: CostModel, *, group: dist.ProcessGroup | None, device: torch.device, path: str
) -> CostModel:
    first = dist.get_global_rank(group, 0) if group is not None else 0
    fields = ("latency_s", "bytes_per_s", "flops_per_s")
    stored = [0.0, 0.0, 0.0, 0.0]  # [found, *fields]
    if dist.get_rank() == first:
        try:
            with open(path) as f:
                data = json.load(f)
            stored = [1.0, *(float(data[k]) for k in fields)]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # nothing remembered yet, or an unreadable file: measure afresh
    # Only the first rank's file counts, so ranks on other nodes decide alike.
    shared = torch.tensor(stored, dtype=torch.float64, device=device)
    dist.broadcast(shared, src=first, group=group)
    found, *old = shared.tolist()
    if found and all(_close(getattr(measured, k), v, k) for k, v in zip(fields, old)):
        return CostModel(*old)
    if dist.get_rank() == first:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({k: getattr(measured, k) for k in fields}, f)
        os.replace(tmp, path)
    return measured


def _snap(x: float) -> float:
    """Round to a quarter-octave grid (19% steps).

    Measurements wobble by a few percent from run to run; unrounded, a restarted job could
    plan other segments and miss the compile cache. The plan hardly changes within 19%.

    Example:
        >>> _snap(1.0e8) == _snap(1.03e8)
        True
    """
    return 2.0 ** (round(math.log2(x) * 4) / 4)


def _fit_line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``time = latency + size * per_byte``, kept physical (both positive)."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    per_byte = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx
    # A link faster than 100 GB/s is noise on these probe sizes; so is a negative latency.
    per_byte = max(per_byte, 1e-11)
    return max(my - per_byte * mx, 1e-5), per_byte


def node_flops(gm: fx.GraphModule, example_inputs: Sequence[object], body: Sequence[fx.Node]) -> list[float]:
    """Forward FLOPs of each node of ``body``, counted on fake copies of the inputs.

    Nodes without a FLOP formula (element-wise ops, views) count zero. Raises if the
    graph cannot run on fake tensors; the caller then falls back to DDP's caps.

    Example:
        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
        >>> node_flops(gm, [torch.zeros(2, 4)], [n for n in gm.graph.nodes if n.op == "call_module"])
        [64.0, 0.0]
    """
    from torch.utils.flop_counter import FlopCounterMode

    fake_mode = compat.fake_mode_of(list(example_inputs))
    wanted = set(body)
    flops: dict[fx.Node, float] = {}
    counter = FlopCounterMode(display=False)

    class _Counting(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            before = counter.get_total_flops()
            out = super().run_node(n)
            if n in wanted:
                flops[n] = float(counter.get_total_flops() - before)
            return out

    with fake_mode:
        fakes = [
            fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
            for x in example_inputs
        ]
        with counter, torch.no_grad():
            _Counting(gm).run(*fakes)
    return [flops.get(n, 0.0) for n in body]
