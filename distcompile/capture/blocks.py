"""Find the repeated blocks of a captured graph (the layers of a transformer).

TorchDynamo records, on every node, the stack of modules whose ``forward`` produced it
(``node.meta["nn_module_stack"]``: path and class, outermost first). A *block* is a
child of a container (``blocks.3``, ``model.layers[11]``) that holds submodules of its
own (or at least a few operations); blocks of one class under one container whose nodes form one contiguous run each,
with the same operations in the same order, are a group. The planner keeps a group's
blocks identical when it cuts segments (Note [Repeated blocks]), and the compiler then
compiles one and reuses it; whether two pieces really are interchangeable is decided
there, on the split pieces and their inputs, so this only has to find candidates.

Note [Blocks cut where no fusion is lost]
    A block's edges are where the model's code says a layer starts, not where a cut is
    free. A pre-LN transformer layer starts with a LayerNorm of the residual stream that
    the layer before it has just added to: cut there, the add and the LayerNorm become two
    kernels in the forward and the LayerNorm's backward and the residual's gradient three
    more in the backward (on the benchmark GPT, 50 kernels a step more than DDPOptimizer's
    pieces, which cut elsewhere). Back-to-back blocks are therefore *rotated*: each range is
    moved forward to the block's first operation that Inductor runs as a kernel of its own
    (a matmul, a convolution, attention), so the previous block's last pointwise work and
    this block's head fuse in one piece. A head of views alone (a transpose before attention)
    is left where it is: nothing there would fuse. The rotated ranges are still identical (block
    ``k``'s tail and block ``k+1``'s head). The last block's tail joins what follows: a
    range of it would end elsewhere than the others (the residual is not handed on after
    the last layer), so it would be one more piece to compile, not a reused one (a GPT of 12
    layers: about 2 s more for its first step on this CPU). The first block's head joins
    what comes before it (the embeddings). So blocks are rotated only if other work, not
    another group's blocks (an encoder's layers, then a decoder's), comes before the first
    and after the last: else the first head or the last tail would be a piece alone. Nor is
    a rotation made that would leave fewer than two ranges.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence

import torch
from torch import fx

__all__ = ["find_blocks"]

#: A container's child: ``prefix.3`` or ``prefix[3]``.
_CHILD = re.compile(r"^(?P<prefix>.+?)(?:\.(?P<a>\d+)|\[(?P<b>\d+)\])$")


#: A block without submodules of its own (its work inside a checkpoint, say) needs this many nodes.
_MIN_LEAF_NODES = 3


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, cls in stack.values():
        out.append((str(path), getattr(cls, "__qualname__", str(cls))))
    return out


def _block_of(node: fx.Node) -> tuple[str, str, int] | None:
    """(container path, class, depth) of the outermost container child holding ``node``."""
    stack = _stack(node)
    for depth, (path, cls) in enumerate(stack):
        match = _CHILD.match(path)
        if match:
            return f"{match['prefix']}|{cls}", path, depth
    return None


def _signature(body: Sequence[fx.Node], start: int, stop: int) -> tuple:
    return tuple((n.op, str(n.target)) for n in body[start:stop])


#: Operations Inductor runs as kernels of their own (not fused with their neighbours): a cut
#: next to one loses no fusion (Note [Blocks cut where no fusion is lost]).
_OPAQUE = {
    *(getattr(torch.nn.functional, f) for f in ("linear", "bilinear", "scaled_dot_product_attention")),
    *(getattr(torch.nn.functional, f"conv{d}d") for d in (1, 2, 3)),
    *(getattr(torch.nn.functional, f"conv_transpose{d}d") for d in (1, 2, 3)),
    *(getattr(torch, f) for f in ("matmul", "mm", "bmm", "addmm", "baddbmm", "einsum")),
    operator.matmul,
    torch.nn.functional.multi_head_attention_forward,
}
#: Operations that only reshape or pick: a block's head made of these alone gains no fusion by
#: moving, and rotating it would only cost the last block its reuse.
_VIEWS = {
    "view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "unsqueeze",
    "squeeze", "expand", "expand_as", "view_as", "size", "dim", "chunk", "split", "unbind", "t",
    "narrow", "select", "getitem",
}  # fmt: skip


def _opaque(node: fx.Node) -> bool:
    if node.op == "call_module":  # a submodule kept whole runs apart from its neighbours
        return True
    if node.op == "call_method":
        return node.target in ("matmul", "mm", "bmm", "__matmul__")
    return node.op == "call_function" and node.target in _OPAQUE


def _computes(node: fx.Node) -> bool:
    return (
        node.op in ("call_function", "call_method")
        and getattr(node.target, "__name__", node.target) not in _VIEWS
    )


def _rotated(body: Sequence[fx.Node], group: list[tuple[int, int]], edges: set[int]) -> list[tuple[int, int]]:
    """``group`` moved forward to its blocks' first opaque operation, when they are back to back,
    their heads compute something, and other work, not another group's blocks, comes before
    the first and after the last (``edges``: the other groups' blocks' starts and ends), for the
    first head and the last tail to join (Note [Blocks cut where no fusion is lost])."""
    start, stop = group[0]
    shift = next((i for i in range(stop - start) if _opaque(body[start + i])), 0)
    if not any(map(_computes, body[start : start + shift])):
        return group  # nothing before the first opaque operation that could fuse
    last = group[-1][1]
    if start == 0 or start in edges or last == len(body) or last in edges:
        return group  # the first head or the last tail would be a piece alone
    if any(b != c for (_, b), (c, _) in zip(group, group[1:])):
        return group
    # The last block's tail joins what follows (a final LayerNorm fuses with its residual add).
    moved = [(a + shift, b + shift) for a, b in group[:-1]]
    return moved if len(moved) > 1 else group


def find_blocks(body: Sequence[fx.Node]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Groups of identical-looking blocks in ``body``, each as ``(start, stop)`` node ranges.

    Example:
        >>> find_blocks([])  # see tests/capture/test_blocks.py for a captured transformer
        ()
    """
    runs: list[tuple[str, str, int, int]] = []  # (group key, instance path, start, stop)
    composite: set[str] = set()
    for i, node in enumerate(body):
        found = _block_of(node)
        if found is None:
            continue
        key, path, depth = found
        if len(_stack(node)) > depth + 1:
            composite.add(path)
        if runs and runs[-1][1] == path and runs[-1][3] == i:
            runs[-1] = (key, path, runs[-1][2], i + 1)
        else:
            runs.append((key, path, i, i + 1))
    seen: dict[str, int] = {}
    for _, path, _, _ in runs:
        seen[path] = seen.get(path, 0) + 1
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for key, path, start, stop in runs:
        # Skip a block split in two runs, and a lone leaf module (a Linear or a ReLU of an
        # nn.Sequential): as pieces of their own, they would only lose fusion.
        if seen[path] != 1 or (path not in composite and stop - start < _MIN_LEAF_NODES):
            continue
        groups.setdefault((key, _signature(body, start, stop)), []).append((start, stop))
    found = [g for g in groups.values() if len(g) > 1]
    edges = [{a for a, _ in g} | {b for _, b in g} for g in found]
    return tuple(
        tuple(_rotated(body, g, set().union(*edges[:k], *edges[k + 1 :]))) for k, g in enumerate(found)
    )
