"""Which split pieces are interchangeable, so one compiled piece serves all of them.

Two pieces may share one compiled function when running either's graph on either's
inputs computes the same thing: the same operations in the same order on inputs of the
same shapes, strides, dtypes, devices, ``requires_grad``, parameter-ness, fakeness (a real
tensor is a parameter or buffer, which the compiler may treat as static) and aliasing.
Parameters are graph inputs (TorchDynamo lifts them since ``inline_inbuilt_nn_modules``),
so a compiled block holds no weights of its own. ``piece_key`` is that comparison as a
string; anything it cannot vouch for (a tensor constant, a kept submodule, a callable
that is not the very same object) gives ``None``, and the piece is compiled on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from .. import _torch_compat as compat

__all__ = ["backward_order", "piece_key"]


def _target(node: fx.Node, gm: fx.GraphModule) -> str | None:
    if node.op in ("placeholder", "output"):
        return ""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        # The object itself: two closures with one name (allow_in_graph) must not match.
        fn = node.target
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}@{id(fn)}"
    if node.op == "get_attr":
        value: object = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if isinstance(value, fx.GraphModule):  # a higher-order op's body (checkpoint, cond)
            return _graph_key(value)
    return None  # a tensor constant or a kept submodule: tied to this piece


def _graph_key(gm: fx.GraphModule) -> str | None:
    names: dict[fx.Node, str] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"%{i}"
        target = _target(node, gm)
        if target is None:
            return None
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: names[n])
        lines.append(f"{node.op} {target} {args!r}")
    return "\n".join(lines)


def _input_key(value: object, storages: dict[object, int], k: int) -> str:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return f"sym {value}"
    if not isinstance(value, torch.Tensor):
        return f"{type(value).__name__} {value!r}"
    ref = torch.multiprocessing.reductions.StorageWeakRef(value.untyped_storage())
    alias = storages.setdefault(ref, k)  # the first input sharing this storage
    return (
        f"{tuple(value.shape)} {value.stride()} {value.storage_offset()} {value.dtype} {value.device} "
        f"grad={value.requires_grad} param={isinstance(value, torch.nn.Parameter)} "
        f"fake={compat.is_fake(value)} alias={alias}"
    )


def piece_key(piece: fx.GraphModule, inputs: Sequence[object]) -> str | None:
    """A string equal for pieces one compiled function can run; ``None`` if unsure.

    Example:
        >>> gm = fx.symbolic_trace(torch.nn.ReLU())
        >>> piece_key(gm, [torch.zeros(2)]) == piece_key(fx.symbolic_trace(torch.nn.ReLU()), [torch.ones(2)])
        True
    """
    graph = _graph_key(piece)
    if graph is None:
        return None
    storages: dict[object, int] = {}
    return graph + "\n" + "\n".join(_input_key(v, storages, k) for k, v in enumerate(inputs))


def backward_order(entries: Sequence[tuple[str | None, int, bool]], last_use: dict[str, int]) -> list[int]:
    """The order in which Inductor's lazy backward compiles will want the pieces' metadata.

    ``entries`` holds one ``(key, position, needs_backward)`` per piece compiled, in
    compile order. Backward runs the pieces in reverse, so a compiled function's backward
    is compiled when its *last* forward use (``last_use[key]``, else its own position)
    runs backward, and takes the last entry of the list; pieces without a backward never
    take theirs and go first. Returns the entry indices in that order.

    Example:
        >>> # A, B, then A again: A's backward is compiled first, so A's entry goes last.
        >>> backward_order([("A", 1, True), ("B", 2, True)], {"A": 3, "B": 2})
        [1, 0]
    """

    def rank(i: int) -> tuple[bool, int, int]:
        key, position, needs_backward = entries[i]
        return needs_backward, last_use.get(key, position) if key is not None else position, i

    return sorted(range(len(entries)), key=rank)
