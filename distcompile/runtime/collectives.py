"""Collectives distcompile needs beyond the bucketed all-reduce, with public APIs only."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["broadcast_coalesced"]


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], *, src: int, group: dist.ProcessGroup | None
) -> None:
    """Overwrite ``tensors`` on every rank with global rank ``src``'s values, one broadcast per dtype.

    What DDP does for its buffers before each forward, with public collectives: the
    tensors of one dtype and device travel as one flat buffer.

    Example:
        >>> # broadcast_coalesced(list(model.buffers()), src=0, group=None)
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    mine = dist.get_rank() == src
    for members in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=src, group=group)
        if mine:
            continue
        offset = 0
        for t in members:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
