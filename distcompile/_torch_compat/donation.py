"""Facts about a step's autograd work that torch keeps private: whether a compiled piece's
backward reuses its saved buffers (AOTAutograd's donated buffers), whether the running
backward retains its graph.

AOTAutograd lets a compiled backward write its results into the memory of saved
activations it no longer needs (``bw_donated_idxs``), which is only right if the graph is
freed after that backward. A backward compiled lazily at its first run looks at that run:
under ``retain_graph=True`` it is compiled without donation. One compiled before any
backward ran (with its forward, to share it between ranks) was compiled for a backward that
frees its graph, and torch refuses ``retain_graph=True`` there ("non-empty donated
buffers"); one loaded from the compile cache is as it was compiled when cached (read from
its loaded metadata, in the running backward). These helpers let distcompile say so first,
naming the fix (``wrappers.recording``), and only where torch would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BackwardDonation",
    "backward_keeps_graph",
    "donating_backwards_upstream",
    "piece_donation",
]


@dataclass
class BackwardDonation:
    """What is known about one compiled piece's backward.

    Attributes:
        meta: AOTAutograd's forward metadata of the piece, whose ``bw_donated_idxs`` the lazy
            backward compile empties under ``retain_graph=True``; ``None`` when the piece
            came from a cache (nothing to read: taken as compiled for a plain backward).
        lazy: The backward compiles at its first run.
    """

    meta: object | None
    lazy: bool

    @property
    def how(self) -> str:
        """How the piece's backward was made, for an error message."""
        if self.meta is None:
            return "loaded from the compile cache"
        if not self.lazy:
            return "compiled with its forward (to share it between ranks)"
        return "compiled at an earlier backward that did not retain the graph"

    def donates(self, *, first_backward: bool) -> bool:
        """Whether a backward now, with the graph retained, would reach donated buffers.

        Checked: 2.13 (``torch._functorch.config.donated_buffer``, ``bw_donated_idxs``).

        Example:
            >>> BackwardDonation(None, lazy=False).donates(first_backward=True)  # outside a backward
            False
        """
        from torch._functorch import config as functorch_config  # not imported by `import torch`

        if not functorch_config.donated_buffer:
            return False
        if self.meta is None:  # loaded: what it was compiled for is read from the running graph
            return bool(donating_backwards_upstream())
        if self.lazy and first_backward:  # it compiles now, for a retained graph: no donation
            return False
        return bool(getattr(self.meta, "bw_donated_idxs", None))


def piece_donation(*, cache_hit: bool, seen: set[int]) -> BackwardDonation:
    """What the compile that just returned left to know about its backward. ``seen``: the ids of
    metadata objects earlier pieces returned (a stale one means this piece set none).

    Checked: 2.13 (``TracingContext.fw_metadata``; ``None`` after a cache hit).

    Example:
        >>> piece_donation(cache_hit=True, seen=set()).meta is None
        True
    """
    from torch._guards import TracingContext

    from .pieces import backward_compiled_eagerly

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if cache_hit or meta is None or id(meta) in seen:
        meta = None
    else:
        seen.add(id(meta))
    return BackwardDonation(meta, lazy=not backward_compiled_eagerly())


def backward_keeps_graph() -> bool:
    """Whether the backward running now retains its graph (``retain_graph=True``).

    Checked: 2.13 (``torch._C._autograd._get_current_graph_task_keep_graph``).

    Example:
        >>> isinstance(backward_keeps_graph(), bool)  # meaningful inside a backward only
        True
    """
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):
        return False


def donating_backwards_upstream() -> int | None:
    """From inside a backward hook: how many of AOTAutograd's compiled backwards still to run
    in this backward (the running node and those it leads to) write into saved activations
    (``bw_donated_idxs``); ``None`` outside a backward. What a piece loaded from the compile
    cache was compiled for is known only here, from its loaded metadata, which torch's own
    check reads the same way (``_backward_impl``).

    Checked: 2.13 (``torch._C._current_autograd_node``; ``CompiledFunctionBackward._forward_cls.metadata``).

    Example:
        >>> donating_backwards_upstream() is None  # outside a backward
        True
    """
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    found, seen, stack = 0, set(), [node]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        meta = getattr(getattr(fn, "_forward_cls", None), "metadata", None)
        if meta is not None and getattr(meta, "bw_donated_idxs", None):
            found += 1
        stack.extend(f for f, _ in getattr(fn, "next_functions", ()))
    return found
