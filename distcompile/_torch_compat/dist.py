"""Pytrees, torch.distributed, DDP, the autograd engine, and TensorBoard's writer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "COMM_THREAD_PREFIXES",
    "ddp_comm_hook_names",
    "ddp_ignored_names",
    "ddp_uses_python_reducer",
    "default_store",
    "is_fsdp_module",
    "queue_engine_callback",
    "tensor_grad_hooks",
    "tree_leaves",
    "tree_map_only",
    "write_summary",
]

#: Names torch gives its communication threads (Linux thread names): gloo's work loops and
#: transport loop, NCCL's watchdog and heartbeat. Checked: 2.11, 2.13, 2.15 (gloo; on 2.11
#: the transport loop has no name of its own, so two gloo threads are found, not three).
COMM_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_nccl")


# -- pytrees ---------------------------------------------------------------------------------
def tree_leaves(tree: object) -> list:
    """Leaves of a nested structure of lists, tuples and dicts. Checked: 2.11-2.15.

    Example:
        >>> tree_leaves({"a": [1, (2, 3)]})
        [1, 2, 3]
    """
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(tree)


def tree_map_only(kind: type, fn: Callable, tree: object) -> object:
    """Apply ``fn`` to every leaf of type ``kind``. Checked: 2.11-2.15.

    Example:
        >>> tree_map_only(int, lambda x: x + 1, [1, "a"])
        [2, 'a']
    """
    from torch.utils._pytree import tree_map_only as map_only

    return map_only(kind, fn, tree)


# -- torch.distributed, DDP and the autograd engine -----------------------------------------
def default_store() -> Any:
    """The default process group's key-value store, shared by every rank. Checked: 2.11-2.15.

    Example:
        >>> # default_store().set("key", "value")
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def ddp_comm_hook_names(ddp: torch.nn.Module) -> list[str]:
    """Names of the communication hooks registered on a DDP model (Python or built-in).

    Python hooks are in ``ddp._comm_hooks``; built-in (C++) hooks only show in DDP's
    logging data (``comm_hook``). Checked: 2.11, 2.13, 2.15.

    Example:
        >>> # ddp_comm_hook_names(ddp) -> ['fp16_compress_hook']
    """
    names = [getattr(h, "__qualname__", repr(h)) for h, _ in getattr(ddp, "_comm_hooks", [])]
    if not names:
        builtin = ddp._get_ddp_logging_data().get("comm_hook", "")
        names = [builtin] if builtin else []
    return names


def ddp_uses_python_reducer(ddp: torch.nn.Module) -> bool:
    """Whether DDP was built with ``optimize_ddp="python_reducer"`` (it then reduces from Python hooks).

    Checked: 2.11, 2.13, 2.15.

    Example:
        >>> ddp_uses_python_reducer(torch.nn.Linear(1, 1))
        False
    """
    return bool(getattr(ddp, "_use_python_reducer", False))


def ddp_ignored_names(module: torch.nn.Module) -> frozenset[str]:
    """Parameters and buffers excluded from DDP on a plain module.

    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` stores them on
    the module. Checked: 2.11, 2.13, 2.15.

    Example:
        >>> ddp_ignored_names(torch.nn.Linear(1, 1))
        frozenset()
    """
    return frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def queue_engine_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running ``backward()`` finishes (inside it, on the engine's thread).

    This is how DDP's own reducer finalizes a step; there is no public form.
    Checked: 2.11, 2.13, 2.15.

    Example:
        >>> # called from a gradient hook: queue_engine_callback(finish_step)
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def tensor_grad_hooks(tensor: torch.Tensor) -> list[Callable]:
    """The hooks ``tensor.register_hook`` put on ``tensor``, in order (not post-accumulate ones).

    Checked: 2.13 (``Tensor._backward_hooks``, an ordered dict).

    Example:
        >>> t = torch.zeros(1, requires_grad=True)
        >>> _ = t.register_hook(lambda g: g * 2)
        >>> len(tensor_grad_hooks(t))
        1
    """
    hooks = getattr(tensor, "_backward_hooks", None)
    return list(hooks.values()) if hooks else []


# -- TensorBoard ------------------------------------------------------------------------------
def write_summary(writer: Any, summary: Any, step: int) -> None:
    """Write one prebuilt TensorBoard ``Summary`` (many scalars in one event) through ``writer``.

    ``SummaryWriter`` has no public call for that; one event per step costs a tenth of one
    ``add_scalar`` per tag. Checked: 2.11, 2.13, 2.15.

    Example:
        >>> # write_summary(SummaryWriter(logdir), summary, step)
    """
    writer._get_file_writer().add_summary(summary, step)


def is_fsdp_module(module: object) -> bool:
    """Whether ``module`` is sharded by FSDP (``FullyShardedDataParallel`` or ``fully_shard``).

    Checked: 2.13, 2.15 (``torch.distributed.fsdp.FullyShardedDataParallel``, ``FSDPModule``).

    Example:
        >>> is_fsdp_module(torch.nn.Linear(1, 1))
        False
    """
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(module, (FSDPModule, FullyShardedDataParallel))
