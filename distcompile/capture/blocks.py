"""Find the repeated blocks of a captured graph (the layers of a transformer).

TorchDynamo records, on every node, the stack of modules whose ``forward`` produced it
(``node.meta["nn_module_stack"]``: path and class, outermost first). A *block* is a
child of a container (``blocks.3``, ``model.layers[11]``) that holds submodules of its
own (or at least a few operations); blocks of one class under one container whose nodes form one contiguous run each,
with the same operations in the same order, are a group. The planner keeps a group's
blocks identical when it cuts segments (Note [Repeated blocks]), and the compiler then
compiles one and reuses it; whether two pieces really are interchangeable is decided
there, on the split pieces and their inputs, so this only has to find candidates.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)
