"""Note [Repeated blocks]

Background
    A model of N identical blocks (the layers of a transformer) should cost about one
    block's compile, not N. Two identical blocks give two identical compiled pieces only
    if they are cut identically: a segment boundary that falls inside block 7 but not
    inside block 8 makes two different pieces, and both must be compiled.

Algorithm
    The capture step reports each group of structurally identical blocks as node ranges.
    Segment boundaries may then fall only where they keep those ranges identical:
    anywhere outside a block, at a block's start, or at the same relative positions in
    every block of a group (cuts inside a block exist only when one block holds more
    than ``bucket_cap`` of parameters, every part at least a bucket: a block just over the
    cap, as GPT-2 small's are over DDP's, stays whole; they are chosen on the group's first
    block by the same cap rule and repeated in the others). A bucket therefore holds whole
    blocks and may exceed its cap by less than one block.

    The compile unit is the *piece*, a refinement of the segments: every block of a group
    is its own piece (cut at its start, its end and its inner cuts), so the identical
    blocks are identical pieces, which ``compile/segments.py`` compiles once. Segments and
    buckets are unchanged by this: a segment's backward still ends when its last piece's
    backward ends. A piece is only cut where it has a value used after it (an FX
    partition without outputs would be dropped); otherwise it joins its neighbour.

Notes
    Pure, like the rest of planning: node ranges in, cut positions and piece ranges out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["Blocks", "allowed_cuts", "piece_bounds"]

#: Groups of identical blocks; each group lists its blocks' ``(start, stop)`` node ranges.
Blocks = Sequence[Sequence[tuple[int, int]]]


def allowed_cuts(n: int, blocks: Blocks, inner: Sequence[Sequence[int]]) -> set[int]:
    """Positions where a segment may start without making identical blocks differ.

    ``inner[g]`` are the cut offsets inside every block of group ``g`` (relative to its start).

    Example:
        >>> sorted(allowed_cuts(6, [[(1, 3), (3, 5)]], [[]]))
        [0, 1, 3, 5, 6]
    """
    inside = [False] * (n + 1)
    allowed: set[int] = set()
    for group, offsets in zip(blocks, inner):
        for start, stop in group:
            for p in range(start + 1, stop):
                inside[p] = True
            allowed.update(start + r for r in offsets if 0 < r < stop - start)
    allowed.update(p for p in range(n + 1) if not inside[p])
    return allowed


def piece_bounds(
    n: int,
    segment_starts: Iterable[int],
    blocks: Blocks,
    inner: Sequence[Sequence[int]],
    last_user: Sequence[int],
) -> tuple[tuple[int, int], ...]:
    """Piece ranges: the segments, cut again at every block's start, end and inner cuts.

    ``last_user[i]`` is the index of the last node reading node ``i`` (``n`` for the
    output). A piece without a value used after it joins the piece before it (or, at a
    segment start, the one after it), so no FX partition is left without outputs.

    Example:
        >>> piece_bounds(6, [0], [[(1, 3), (3, 5)]], [[]], [1, 2, 3, 4, 5, 6])
        ((0, 1), (1, 3), (3, 5), (5, 6))
    """
    starts = set(segment_starts)
    cuts = set(starts)
    for group, offsets in zip(blocks, inner):
        for start, stop in group:
            cuts.update((start, stop))
            cuts.update(start + r for r in offsets if 0 < r < stop - start)
    cuts = sorted(c for c in cuts if 0 <= c < n) or [0]
    if cuts[0] != 0:
        cuts.insert(0, 0)
    changed = True
    while changed:
        changed = False
        for k, a in enumerate(cuts):
            b = cuts[k + 1] if k + 1 < len(cuts) else n
            if b == n or any(last_user[i] >= b for i in range(a, b)):
                continue
            # No value leaves [a, b): merge it into a neighbour that keeps segments intact.
            cuts.remove(a if a not in starts else b)
            changed = True
            break
    return tuple(zip(cuts, [*cuts[1:], n]))
