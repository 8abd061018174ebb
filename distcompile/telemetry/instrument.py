"""Compute spans: each compiled segment's forward and backward on the step timeline."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
from torch import fx

from .. import _torch_compat as compat
from .clock import Clock, PendingSpan, StepTimeline

__all__ = ["TimedPieces", "instrument"]


class Recorder(Protocol):
    """What instrumenting needs of ``sink.Telemetry``: whether this step times each segment, its
    clock and timeline, and ``poll`` (ends the spans of all-reduces seen done: Note [Polled ends
    on CPU])."""

    timing: bool
    clock: Clock
    timeline: StepTimeline

    def poll(self) -> None: ...


def _timed_call(fn: Callable, args: tuple, telemetry: Recorder, label: str) -> object:
    if not telemetry.timing:
        return fn(*args)
    clock, timeline = telemetry.clock, telemetry.timeline
    start = clock.mark()
    out = fn(*args)
    timeline.add(PendingSpan("compute", f"{label} fwd", start, clock.mark()))
    node = compat.first_grad_node(out)
    if node is not None:
        # The piece's backward is one autograd node (under AOTAutograd); its pre- and
        # post-hooks bracket the segment's backward without touching any tensor. The
        # engine runs them on the node's stream, so CUDA events there time the GPU work.
        name, began = f"{label} bwd", [None]

        def started(grad_outputs: object) -> None:
            began[0] = clock.mark()

        def finished(grad_inputs: object, grad_outputs: object) -> None:
            # A span of its own each run: a graph kept (retain_graph) runs these hooks again,
            # and a span, with its marks, belongs to one step (CudaClock reuses them after it).
            end = clock.mark()
            timeline.add(PendingSpan("compute", name, end if began[0] is None else began[0], end))
            began[0] = None
            telemetry.poll()

        node.register_prehook(started)
        node.register_hook(finished)
    return out


class TimedPieces:
    """Every graph's compiled pieces and their timed stand-ins (``_TimedPiece``), put in place
    by ``use(True)`` and taken out by ``use(False)``.

    On CPU only the steps drawn time their segments (Note [Segment spans on CPU] in
    ``sink.py``); in the others a stand-in would only cost a module call per piece (0.07-0.10
    ms a step on the proxy of ``distcompile bench --host-overhead``), so they run the pieces
    themselves. On CUDA the stand-ins stay in place (``always=True``): every step is timed.

    Example:
        >>> pieces = TimedPieces(always=False); pieces.use(True)  # no graph yet: nothing to swap
    """

    def __init__(self, *, always: bool) -> None:
        self.always = always
        self._on = always
        self._swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]] = []

    def add(self, owner: torch.nn.Module, name: str, timed: _TimedPiece) -> None:
        """``owner.name`` (a compiled piece) gets ``timed`` as its stand-in."""
        self._swaps.append((owner, name, timed.piece, timed))
        if self._on:
            setattr(owner, name, timed)

    def use(self, on: bool) -> None:
        """Put the stand-ins in place (``True``) or the pieces themselves (``False``)."""
        on = on or self.always
        if on != self._on:
            self._on = on
            for owner, name, plain, timed in self._swaps:
                setattr(owner, name, timed if on else plain)


class _TimedPiece(torch.nn.Module):
    def __init__(self, piece: torch.nn.Module, telemetry: Recorder, label: str) -> None:
        super().__init__()
        self.piece = piece
        self.label = label
        object.__setattr__(self, "telemetry", telemetry)

    def forward(self, *args: object) -> object:
        return _timed_call(self.piece, args, self.telemetry, self.label)  # untimed outside a step


def instrument(compiled: Callable, telemetry: Recorder, graph_id: int, pieces: TimedPieces) -> Callable:
    """Record each piece's forward and backward span on ``telemetry``'s timeline, in the steps
    ``pieces`` puts the stand-ins in.

    Example:
        >>> # used by distcompile.wrap when logdir= is given
    """
    # split_and_compile renamed each piece submod_N -> compiled_submod_N. Identical blocks share
    # one compiled piece under several names: every name is timed (named_children would give
    # the shared module once, and the blocks reusing it would show as eager code).
    children = compiled.named_modules(remove_duplicate=False) if isinstance(compiled, fx.GraphModule) else []
    names = [n for n, _ in children if "." not in n and n.startswith("compiled_submod_")]
    if names:
        for k, name in enumerate(sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]))):
            pieces.add(compiled, name, _TimedPiece(getattr(compiled, name), telemetry, f"g{graph_id}.s{k}"))
        return compiled
    return functools.partial(_timed_call_args, compiled, telemetry, f"g{graph_id}.s0")


def _timed_call_args(fn: Callable, telemetry: Recorder, label: str, *args: object) -> object:
    return _timed_call(fn, args, telemetry, label)
