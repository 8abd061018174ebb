"""Compute spans: each compiled segment's forward and backward on the step timeline."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
from torch import fx

from .. import _torch_compat as compat
from .clock import Clock, PendingSpan, StepTimeline

__all__ = ["instrument"]


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


class _TimedPiece(torch.nn.Module):
    def __init__(self, piece: torch.nn.Module, telemetry: Recorder, label: str) -> None:
        super().__init__()
        self.piece = piece
        self.label = label
        object.__setattr__(self, "telemetry", telemetry)

    def forward(self, *args: object) -> object:
        if not self.telemetry.timing:  # most CPU steps (Note [Segment spans on CPU]): one call less
            return self.piece(*args)
        return _timed_call(self.piece, args, self.telemetry, self.label)


def instrument(compiled: Callable, telemetry: Recorder, graph_id: int) -> Callable:
    """Record each piece's forward and backward span on ``telemetry``'s timeline.

    Example:
        >>> # used by distcompile.wrap when logdir= is given
    """
    # split_and_compile renamed each piece submod_N -> compiled_submod_N. Identical blocks share
    # one compiled piece under several names: every name is timed (named_children would give
    # the shared module once, and the blocks reusing it would show as eager code).
    children = compiled.named_modules(remove_duplicate=False) if isinstance(compiled, fx.GraphModule) else []
    pieces = [n for n, _ in children if "." not in n and n.startswith("compiled_submod_")]
    if pieces:
        for k, name in enumerate(sorted(pieces, key=lambda n: int(n.rsplit("_", 1)[1]))):
            setattr(compiled, name, _TimedPiece(getattr(compiled, name), telemetry, f"g{graph_id}.s{k}"))
        return compiled
    return functools.partial(_timed_call_args, compiled, telemetry, f"g{graph_id}.s0")


def _timed_call_args(fn: Callable, telemetry: Recorder, label: str, *args: object) -> object:
    return _timed_call(fn, args, telemetry, label)
