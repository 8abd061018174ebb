"""Timing each captured node's backward on this machine, for ``bucket_cap_mb="auto"``.

FLOPs price matrix multiplies and nothing else: on a CPU the rest of a backward (softmax
and cross-entropy, normalisations, activations, element-wise work) took 45% of a small
GPT's backward, and the planner that priced backward as twice the forward FLOPs
predicted 782 ms of backward and communication where backward alone took 1,033 ms.
:func:`backward_work` runs each node once with its backward, on random tensors of the
shapes, dtypes and devices the captured graph has there (never on the model's own
tensors: nothing the model holds is read or changed), and times the backward.

A time is turned into work, FLOPs at this process's matrix-multiply rate measured right
after it (a 384x384 multiply, the faster of two), so the planner prices it at the rate
every rank agreed on at ``wrap`` (all ranks computing at once), and whatever else ran on
the machine while this rank timed slows both alike. (Converted at one rate measured
before all the timings, three runs of 8 ranks on 2 cores predicted the step from 19%
short to 23% long.)

Only nodes that take and return tensors, and whose output backward reaches, are run (a
call that sets grad mode or enters autocast returns none); a node inside a ``with
torch.autocast(...)`` block the graph captured runs its forward under that autocast, as
the model's does (an autocast around the whole call is in force already: the first
step's compile runs inside the model's forward); a node that fails on random
values is priced by its FLOPs instead, as is a node met after ``BUDGET_S`` seconds of
timing or one with a tensor over ``MAX_TENSOR_BYTES``. Random number state and grad mode
are put back. Identical nodes (the layers of a transformer) are timed once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import fx
from torch.fx.node import map_aggregate

from .. import _torch_compat as compat

__all__ = ["backward_work", "matmul_rate"]

log = logging.getLogger(__name__)

#: Seconds :func:`backward_work` may spend; nodes left after that are priced by FLOPs.
BUDGET_S = 10.0

#: Largest tensor (bytes) a timed node may take or give; bigger nodes are priced by FLOPs.
MAX_TENSOR_BYTES = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, repeats: int = 10) -> float:
    """FLOP/s of one 384x384 matrix multiply on ``device``, the fastest of ``repeats``
    (a busy machine only ever slows one down).

    Example:
        >>> matmul_rate(torch.device("cpu")) > 1e8
        True
    """
    n = 384
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / max(best, 1e-9)


def _tensors(value: object) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def _signature(n: fx.Node, values: dict[fx.Node, object]) -> str:
    def meta(a: object) -> object:
        v = values.get(a) if isinstance(a, fx.Node) else a
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.dtype, v.device.type, v.requires_grad)
        return repr(v)

    return repr((n.op, n.target, map_aggregate((n.args, n.kwargs), meta)))


def _random_like(fake: torch.Tensor, device: torch.device) -> torch.Tensor:
    if fake.dtype.is_floating_point or fake.dtype.is_complex:
        return torch.randn(tuple(fake.shape), dtype=fake.dtype, device=device).requires_grad_(
            fake.requires_grad
        )
    return torch.zeros(tuple(fake.shape), dtype=fake.dtype, device=device)  # indices, masks: valid as zeros


def _call(n: fx.Node, args: tuple, kwargs: dict) -> object:
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    return getattr(args[0], n.target)(*args[1:], **kwargs)


def _timed_backward(
    n: fx.Node, values: dict[fx.Node, object], device: torch.device, autocast: tuple | None
) -> float:
    """``n``'s backward on random inputs in FLOPs at the matmul rate of the moment: its
    seconds (the faster of two runs) over a multiply's right after (the faster of two).
    ``autocast``: the arguments of the ``torch.autocast`` its forward runs under, if any."""

    def real(a: object) -> object:
        v = values.get(a) if isinstance(a, fx.Node) else a
        return _random_like(v, device) if isinstance(v, torch.Tensor) else v

    args, kwargs = map_aggregate((n.args, n.kwargs), real)
    need = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    best = float("inf")
    for _ in range(2):
        with torch.autocast(*autocast) if autocast else contextlib.nullcontext():
            outs = [o for o in _tensors(_call(n, args, kwargs)) if o.grad_fn is not None]
        if not outs or not need:
            return 0.0
        grads = [torch.ones_like(o) for o in outs]
        _sync(device)
        t0 = time.perf_counter()
        torch.autograd.grad(outs, need, grads, allow_unused=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best * matmul_rate(device, repeats=2)


def _timeable(n: fx.Node, values: dict[fx.Node, object]) -> bool:
    out = _tensors(values.get(n))
    ins = _tensors(
        map_aggregate((n.args, n.kwargs), lambda a: values.get(a) if isinstance(a, fx.Node) else a)
    )
    if n.op not in ("call_function", "call_method") or not out or not ins:
        return False
    if not any(o.requires_grad for o in out):
        return False  # backward never reaches it
    sizes = [t.numel() * t.element_size() for t in (*out, *ins)]
    # A size that follows the data (a symbol, not a number) cannot be made up: not timed.
    return all(type(b) is int for b in sizes) and max(sizes) <= MAX_TENSOR_BYTES


def backward_work(
    values: dict[fx.Node, object],
    body: Sequence[fx.Node],
    *,
    device: torch.device,
    budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float | None]:
    """Each node of ``body``'s backward, timed here and given in FLOPs at this process's
    matrix-multiply rate; ``None`` for a node not timed (the caller prices it by FLOPs).

    ``values``: every node's fake value (``capture.flops.fake_run``); ``device``: where
    the graph runs.

    Example:
        >>> from distcompile.capture.flops import fake_run
        >>> gm = fx.symbolic_trace(lambda x, w: torch.nn.functional.gelu(x @ w).view(-1))
        >>> body = [n for n in gm.graph.nodes if n.op.startswith("call_")]
        >>> w = torch.zeros(64, 64, requires_grad=True)
        >>> _, values = fake_run(gm, [torch.zeros(8, 64), w], body)
        >>> work = backward_work(values, body, device=torch.device("cpu"))
        >>> [(n.name, w > 0) for n, w in zip(body, work)]  # FLOPs' worth; how many: the machine's
        [('matmul', True), ('gelu', True), ('view', True)]
    """
    seen: dict[str, float | None] = {}
    work: list[float | None] = []
    autocast: list[tuple] = []  # the graph's own autocast blocks, innermost last
    start = clock()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        for n in body:
            change = compat.autocast_change(n)
            if change is not None:
                autocast = [*autocast, change] if change else autocast[:-1]
            if change is not None or not _timeable(n, values):
                work.append(None)
                continue
            key = _signature(n, values) + repr(autocast[-1:])
            if key not in seen:
                if clock() - start > budget_s:
                    seen[key] = None
                else:
                    try:
                        seen[key] = _timed_backward(n, values, device, autocast[-1] if autocast else None)
                    except Exception as exc:  # noqa: BLE001 - priced by its FLOPs instead
                        log.debug(
                            "bucket_cap_mb='auto': cannot time %s (%s: %s)", n.name, type(exc).__name__, exc
                        )
                        seen[key] = None
            work.append(seen[key])
    log.debug("bucket_cap_mb='auto': timed %d distinct nodes in %.2f s", len(seen), clock() - start)
    return work
