"""Data-parallel wrappers in the wrong place: inside the model distcompile wraps, or around it.

distcompile owns gradient synchronization. A second data-parallel wrapper would either
reduce every gradient again (a DDP inside the wrapped model keeps its own reducer) or take
the overlap away (a DDP around the wrapped model sees one opaque module: distcompile then
plans no bucket for the parameters the outer DDP reduces after backward). The numbers can
come out right either way, which is why both are errors rather than warnings.

``distcompile.unwrap`` (``_wrap.py``) peels the wrappers ``WRAPPERS`` lists.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from .. import _torch_compat as compat

__all__ = ["WRAPPERS", "data_parallel_kind", "find_inner_data_parallel", "outer_data_parallel"]

#: How far up the stack a first forward looks for a wrapper's ``forward`` (a DDP around a
#: Lightning or Accelerate wrapper sits a handful of frames up).
_MAX_FRAMES = 64

#: Wrapper class -> its name in messages; each keeps the user's model as ``.module``.
#: ``DistCompiledModule`` adds itself (``runtime/module.py`` imports this module).
WRAPPERS: dict[type, str] = {
    DistributedDataParallel: "torch.nn.parallel.DistributedDataParallel",
    DataParallel: "torch.nn.DataParallel",
}


def data_parallel_kind(obj: object) -> str | None:
    """The kind of data-parallel wrapper ``obj`` is, or ``None``.

    Example:
        >>> data_parallel_kind(nn.Linear(1, 1)) is None
        True
    """
    for cls, name in WRAPPERS.items():
        if isinstance(obj, cls):
            return name
    if compat.is_fsdp_module(obj):
        return "FullyShardedDataParallel"
    try:
        reducer = getattr(obj, "reducer", None)
    except Exception:  # noqa: BLE001 - an odd __getattr__ on some object up the stack: not a wrapper
        return None
    if dist.is_available() and isinstance(reducer, dist.Reducer):
        return f"{type(obj).__qualname__} (holds a DDP reducer)"
    return None


def find_inner_data_parallel(module: nn.Module) -> tuple[str, str] | None:
    """``(path, kind)`` of the first data-parallel wrapper among ``module``'s submodules, or ``None``.

    ``module`` itself is not looked at: it is what the caller adopts.

    Example:
        >>> find_inner_data_parallel(nn.Sequential(nn.Linear(1, 1))) is None
        True
    """
    for path, sub in module.named_modules():
        if path and (kind := data_parallel_kind(sub)) is not None:
            return path, kind
    return None


def outer_data_parallel(module: nn.Module) -> str | None:
    """The kind of data-parallel wrapper whose ``forward`` is on the stack around ``module``'s call.

    Called from ``module``'s own forward; frames of ``module`` itself are skipped.

    Example:
        >>> outer_data_parallel(nn.Linear(1, 1)) is None
        True
    """
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not module and (kind := data_parallel_kind(owner)) is not None:
            return kind
        frame = frame.f_back
    return None
