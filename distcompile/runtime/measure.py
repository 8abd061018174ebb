"""Measuring the link and the compute rate for ``bucket_cap_mb="auto"``, agreed across ranks.

All-reduces of a few sizes are timed on the real process group and fitted to
``latency + bytes / bandwidth``; a matrix multiply gives the compute rate. The slowest
rank's numbers count, so every rank plans the same segments; the figures can be
remembered next to the compile cache so a restarted job plans alike.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..capture.timing import matmul_rate
from ..planning.costs import CostModel, fit_line, reuse_remembered, snap

__all__ = ["measure_costs", "time_allreduce"]

log = logging.getLogger(__name__)


#: All-reduce sizes timed to fit latency and bandwidth (bytes).
_PROBE_BYTES = (64 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)

#: Repetitions of the largest probe (the fastest is kept): it is what takes time on a slow
#: link, and buckets of DDP's size (25 MiB) are priced by it: from probes up to 4 MiB alone,
#: 8 ranks on 2 cores over 1 Gbit/s priced an all-reduce of 21.2 MB at 236-240 ms where it
#: took 299-307 ms (gloo's sums and copies of large buffers compete for the cores).
_LARGE_REPEATS = 2


#: Repetitions per probe size; the fastest is kept (noise only ever adds time).
_PROBE_REPEATS = 5


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


def _time_matmul(device: torch.device, group: dist.ProcessGroup | None) -> float:
    """FLOP/s of one rank while every rank of ``group`` computes (a collective)."""
    n = 384
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    if device.type == "cpu":
        # Every rank at once, for a window each: ranks that share cores (more ranks than
        # cores on a node) compute at the rate they will have in a step, where all of them
        # compute together. The median of 5 windows: with ranks sharing cores, the ranks are
        # the load, and the best window (the least disturbed) is above what a step gets.
        # (Timing single multiplies and keeping the fastest measured one rank alone: with 8
        # ranks on 2 cores it gave 137 GFLOP/s where a rank computed at about a quarter.)
        rates = []
        for _ in range(5):
            dist.barrier(group=group)
            count, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < 0.1:
                a @ b
                count += 1
            rates.append(2 * n**3 * count / elapsed)
        return sorted(rates)[2]
    # The fastest of 20: a busy machine only ever slows a run down (the median of 5 wandered
    # between 54 and 88 GFLOP/s across the benchmark's variants on these 2 cores).
    return matmul_rate(device, repeats=20)


#: Bytes all-reduced beside a compute loop to time what communication costs compute.
_LOSS_BYTES = 4 * 1024 * 1024


def _compute_lost_per_byte(device: torch.device, group: dist.ProcessGroup | None, rate: float) -> float:
    """Compute seconds one rank loses per byte all-reduced while it computes (a collective).

    On a GPU, none (NCCL's kernels run beside the model's). On CPUs the communication's
    threads (gloo's copies, sums and sockets) take cores from the ranks' compute when ranks
    share them: with 8 ranks on 2 cores a backward under its all-reduces ran 381 ms longer
    than alone. Timed as multiplies counted while an all-reduce runs, against what they take
    with every rank computing (``rate``); the median of 3.
    """
    if device.type != "cpu":
        return 0.0
    n = 384
    a, b = torch.randn(n, n), torch.randn(n, n)
    each = 2 * n**3 / rate
    buf = torch.zeros(_LOSS_BYTES // 4)
    lost = []
    for _ in range(3):
        dist.barrier(group=group)
        work = dist.all_reduce(buf, group=group, async_op=True)
        count, t0 = 0, time.perf_counter()
        while not work.is_completed():
            a @ b
            count += 1
        elapsed = time.perf_counter() - t0
        work.wait()
        lost.append(max(0.0, elapsed - count * each) / _LOSS_BYTES)
    return sorted(lost)[1]


def measure_costs(
    *, group: dist.ProcessGroup | None, device: torch.device, remember_dir: str | None = None
) -> CostModel:
    """Time all-reduces and a matrix multiply on every rank; return the agreed model.

    A collective: every rank of ``group`` must call it. Takes about six all-reduces of
    each probe size (64 KiB, 1 MiB, 4 MiB) and three of 16 MiB, and on CPUs three more of
    4 MiB beside a compute loop: about 1 s on a 1 Gbit/s link, 3.5 s at 200 Mbit/s.

    With ``remember_dir``, the group's first rank keeps the model in a file there and the
    next run reuses it while every new measurement is within a factor of
    ``planning.costs.REUSE_WITHIN`` of it: a restarted job then plans the same segments and finds them
    in the compile cache, instead of re-planning on a few percent of noise.

    Example:
        >>> # cost = measure_costs(group=None, device=torch.device("cpu"))
        >>> # cost.describe() -> 'all-reduce 0.31 ms + 8.1 ms/MB (123 MB/s); compute 31.2 GFLOP/s'
    """
    times = [
        time_allreduce(
            b, group=group, device=device, repeats=_LARGE_REPEATS if b == _PROBE_BYTES[-1] else _PROBE_REPEATS
        )
        for b in _PROBE_BYTES
    ]
    rate = _time_matmul(device, group)
    lost = _compute_lost_per_byte(device, group, rate)
    # The slowest rank decides, identically everywhere: max of times and losses, min of rates.
    agreed = torch.tensor([*times, 1.0 / rate, lost], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    *times, inv_rate, lost = agreed.tolist()
    latency, per_byte = fit_line(_PROBE_BYTES, times)
    model = CostModel(
        latency_s=snap(latency),
        bytes_per_s=snap(1.0 / per_byte),
        flops_per_s=snap(1.0 / inv_rate),
        cpu_s_per_byte=snap(lost) if lost > 1e-10 else 0.0,
    )
    if remember_dir is not None:
        model = _remembered(model, group=group, device=device, path=_memory_path(remember_dir, group, device))
    log.info("bucket_cap_mb='auto': %s", model.describe())
    return model


def _memory_path(directory: str, group: dist.ProcessGroup | None, device: torch.device) -> str:
    return os.path.join(directory, f"costs-world{dist.get_world_size(group)}-{device.type}.json")


def _remembered(
    measured: CostModel, *, group: dist.ProcessGroup | None, device: torch.device, path: str
) -> CostModel:
    first = dist.get_global_rank(group, 0) if group is not None else 0
    fields = ("latency_s", "bytes_per_s", "flops_per_s", "cpu_s_per_byte")
    stored = [0.0] * (1 + len(fields))  # [found, *fields]
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
    if found and all(reuse_remembered(getattr(measured, k), v, k) for k, v in zip(fields, old)):
        return CostModel(*old)
    if dist.get_rank() == first:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({k: getattr(measured, k) for k in fields}, f)
        os.replace(tmp, path)
    return measured
