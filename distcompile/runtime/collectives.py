"""Collectives distcompile needs beyond the bucketed all-reduce, with public APIs only."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["agreed_token", "all_reduce_coalesced", "broadcast_coalesced", "group_device"]


def _flat_groups(tensors: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """``tensors`` grouped by dtype and device, each group with one flat copy of its values."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [(members, torch.cat([t.detach().reshape(-1) for t in members])) for members in groups.values()]


def _scatter_back(members: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for t in members:
        t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], *, src: int, group: dist.ProcessGroup | None
) -> None:
    """Overwrite ``tensors`` on every rank with global rank ``src``'s values, one broadcast per dtype.

    What DDP does for its buffers before each forward, with public collectives: the
    tensors of one dtype and device travel as one flat buffer.

    Example:
        >>> # broadcast_coalesced(list(model.buffers()), src=0, group=None)
    """
    mine = dist.get_rank() == src
    for members, flat in _flat_groups(tensors):
        dist.broadcast(flat, src=src, group=group)
        if not mine:
            _scatter_back(members, flat)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> None:
    """Reduce ``tensors`` in place across the group's ranks, one all-reduce per dtype and device.

    Example:
        >>> # all_reduce_coalesced([a, b], group=None, op=dist.ReduceOp.MAX)
    """
    for members, flat in _flat_groups(tensors):
        dist.all_reduce(flat, op=op, group=group)
        _scatter_back(members, flat)


def group_device(group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor] = ()) -> torch.device:
    """Where a small collective on ``group`` runs: CUDA under NCCL (the first CUDA tensor's
    device, else the current one), the CPU otherwise.

    Example:
        >>> # group_device(None, list(model.parameters()))
    """
    if dist.get_backend(group) == "nccl":
        return next((t.device for t in tensors if t.is_cuda), torch.device("cuda"))
    return torch.device("cpu")


def agreed_token(*, src: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """A random 62-bit number drawn on global rank ``src`` and returned on every rank of ``group``.

    A collective (one broadcast of one integer). It names one life of a process group: keys
    a group writes under it cannot be read by a later group on the same store, even where
    the store outlives the group (torchrun's agent store across restarts) and where the
    ranks' restart counts differ (each node's agent counts its own restarts).

    Example:
        >>> # prefix = f"distcompile/{agreed_token(src=0, group=None, device=cpu):x}"
    """
    drawn = secrets.randbits(62) if dist.get_rank() == src else 0
    token = torch.tensor([drawn], dtype=torch.int64, device=device)
    dist.broadcast(token, src=src, group=group)
    return int(token.item())
