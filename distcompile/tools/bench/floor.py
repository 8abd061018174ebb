"""The physical floor of a step: compute alone, the link alone, and what no schedule can hide.

    floor = t_fwd + max(t_bwd + t_tail, t_head + t_comm) + t_opt

``t_fwd``, ``t_bwd``, ``t_opt``: every rank computing at once without communication;
``t_head``: backward time until the first gradient is final; ``t_comm``: all-reducing
every gradient byte on the link, measured alone; ``t_tail``: the same for the gradients
that are final only when backward ends (the first forward operation's parameters: here
the embeddings). The CPU-aware floor adds what communication costs backward in CPU time
on few cores, and the skew between ranks (the slower rank gates every step).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from distcompile.models import GPT
from distcompile.runtime.measure import time_allreduce

from .workload import Workload

__all__ = ["measure_floor"]


def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def measure_floor(w: Workload) -> tuple[dict, float]:
    """The floor's terms (milliseconds) and the compute-only step time; a collective.

    Example:
        >>> # floor, compute_step_ms = measure_floor(workload)
    """
    plain = w.fresh()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    fwd, bwd, opt_t, head = _compute_only(w, plain, opt)
    grad_bytes = w.nparams * 4
    tail_bytes = sum(p.numel() * 4 for n, p in plain.named_parameters() if n.startswith(("wte", "wpe")))
    t_comm = time_allreduce(grad_bytes, pick=statistics.median) * 1e3
    t_tail = t_comm * tail_bytes / grad_bytes  # the link is linear in bytes at these sizes
    f = {
        "t_fwd_ms": _ms(fwd),
        "t_bwd_ms": _ms(bwd),
        "t_opt_ms": _ms(opt_t),
        "t_head_ms": _ms(head),
        "t_comm_ms": t_comm,
        "t_tail_ms": t_tail,
        "grad_mb": grad_bytes / 1e6,
        "busbw_gbit": 2 * (w.world - 1) / w.world * grad_bytes * 8 / (t_comm / 1e3) / 1e9,
    }
    f["floor_ms"] = f["t_fwd_ms"] + max(f["t_bwd_ms"] + t_tail, f["t_head_ms"] + t_comm) + f["t_opt_ms"]
    loaded = _backward_under_allreduce(w, plain, opt, grad_bytes)
    per_step = torch.tensor([a + b + c for a, b, c in zip(fwd, bwd, opt_t)], dtype=torch.float64)
    slowest, total = per_step.clone(), per_step.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(total)
    f["cpu_comm_ms"] = max(0.0, _ms(loaded) - f["t_bwd_ms"])
    f["skew_ms"] = statistics.median((slowest - total / w.world).tolist()) * 1e3
    f["cpu_floor_ms"] = f["floor_ms"] + f["cpu_comm_ms"] + f["skew_ms"]
    compute_step = f["t_fwd_ms"] + f["t_bwd_ms"] + f["t_opt_ms"]
    w.say(
        f"compute-only step {compute_step:.1f} ms; all-reduce of {grad_bytes / 1e6:.1f} MB alone "
        f"{t_comm:.1f} ms; floor {f['floor_ms']:.1f} ms"
    )
    return f, compute_step


def _compute_only(
    w: Workload, plain: torch.nn.Module, opt: torch.optim.Optimizer
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Seconds of forward, backward, optimizer, and backward until the first final gradient."""
    first_ready: list[float] = []
    hooks = [
        p.register_post_accumulate_grad_hook(lambda _p: first_ready.append(time.perf_counter()))
        for p in plain.parameters()
    ]
    fwd, bwd, opt_t, head = [], [], [], []
    for i in range(w.args.warmup + 10):
        x, y = w.next_batch()
        t0 = time.perf_counter()
        loss = GPT.loss(plain(x), y)
        t1 = time.perf_counter()
        first_ready.clear()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if i >= w.args.warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            opt_t.append(t3 - t2)
            head.append(min(first_ready) - t1)
    for h in hooks:
        h.remove()
    return fwd, bwd, opt_t, head


def _backward_under_allreduce(
    w: Workload, plain: torch.nn.Module, opt: torch.optim.Optimizer, grad_bytes: int
) -> list[float]:
    """Backward seconds while all gradient bytes are all-reduced at once (CPU contention)."""
    buf = torch.zeros(grad_bytes // 4)
    loaded = []
    for i in range(w.args.warmup + 6):
        x, y = w.next_batch()
        loss = GPT.loss(plain(x), y)
        dist.barrier()
        work = dist.all_reduce(buf, async_op=True)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        work.wait()
        opt.zero_grad()
        if i >= w.args.warmup:
            loaded.append(t2 - t1)
    return loaded
