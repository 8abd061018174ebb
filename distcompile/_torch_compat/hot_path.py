"""Calls on a training step's hot path: a foreach copy, the process group's own all-reduce,
tensors' version counters, the current CUDA stream's identity."""

from __future__ import annotations

import torch

__all__ = ["copy_all", "current_cuda_stream_key", "start_all_gather", "start_all_reduce", "tensor_versions"]


def tensor_versions(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's version counter (bumped by every in-place change). Checked: 2.11-2.15 (``_version``).

    Example:
        >>> t = torch.zeros(1)
        >>> before = tensor_versions([t]); _ = t.add_(1)
        >>> tensor_versions([t]) != before
        True
    """
    return [t._version for t in tensors]


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, as one ``foreach`` call (one dispatch for a whole bucket).

    Checked: 2.11, 2.13, 2.15 (``torch._foreach_copy_``).

    Example:
        >>> a, b = [torch.zeros(2)], [torch.ones(2)]
        >>> copy_all(a, b); a[0].tolist()
        [1.0, 1.0]
    """
    torch._foreach_copy_(dst, src)


def start_all_reduce(
    tensor: torch.Tensor, group: torch.distributed.ProcessGroup | None
) -> torch.distributed.Work:
    """``dist.all_reduce(tensor, group=group, async_op=True)`` as the process group's own call:
    the same collective (a sum) without the Python wrapper's checks, logging and dispatch,
    about 25 us a call on CPU. For a group this rank belongs to (every reducer's group).

    Checked: 2.13, 2.15 (``ProcessGroup.allreduce(tensors)``: default options, a sum).

    Example:
        >>> # work = start_all_reduce(bucket, None); work.wait()
    """
    pg = torch.distributed.group.WORLD if group is None else group
    return pg.allreduce([torch.view_as_real(tensor) if tensor.is_complex() else tensor])


def start_all_gather(
    output: torch.Tensor, tensor: torch.Tensor, group: torch.distributed.ProcessGroup | None
) -> torch.distributed.Work:
    """``dist.all_gather_into_tensor(output, tensor, group=group, async_op=True)`` as the process
    group's own call: ``output`` (``world`` times ``tensor``'s size) gets every rank's ``tensor``
    in rank order. For a group this rank belongs to.

    Checked: 2.13, 2.15 (``ProcessGroup._allgather_base``; 2.13 deprecates the public call in
    favour of ``all_gather_single``).

    Example:
        >>> # work = start_all_gather(torch.empty(world * 4), torch.ones(4), None); work.wait()
    """
    pg = torch.distributed.group.WORLD if group is None else group
    return pg._allgather_base(output, tensor)


def current_cuda_stream_key() -> tuple[int, int, int]:
    """``(stream_id, device_index, device_type)`` of the current device's current CUDA stream,
    the arguments that rebuild it (``torch.cuda.Stream(stream_id=..., ...)``), read without
    building a ``Stream`` object: ``torch.cuda.current_stream()`` builds one each call (a
    device lookup and a constructor), which ``Event.record()`` pays on every event.

    Checked: 2.11 on a GPU, 2.15's CUDA build (``torch._C._cuda_getCurrentStream``,
    ``torch._C._cuda_getDevice``; CPU-only wheels lack both, and make no CUDA clock).

    Example:
        >>> # sid, dev, kind = current_cuda_stream_key()   # on a machine with CUDA
    """
    return torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
