"""Pytrees, torch.distributed, DDP, the autograd engine, and TensorBoard's writer."""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from .version import unsupported

__all__ = [
    "COMM_THREAD_PREFIXES",
    "ddp_builtin_comm_hook",
    "ddp_comm_hooks",
    "ddp_delayed_params",
    "ddp_ignored_names",
    "ddp_uses_python_reducer",
    "ddp_optimizer_first_bucket",
    "checkpoint_as_ddp",
    "default_store",
    "restarts_share_agent_store",
    "store_get_within",
    "store_wait",
    "is_fsdp_module",
    "join_config",
    "optimizer_in_backward_count",
    "optimizers_in_backward",
    "queue_engine_callback",
    "remove_optimizer_in_backward_hooks",
    "tensor_grad_hooks",
    "first_grad_node",
    "node_order",
    "tree_leaves",
    "tree_map_only",
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


def first_grad_node(out: object) -> object:
    """The autograd node of the first tensor in ``out`` that has one (a compiled piece returns a
    tensor or a tuple of tensors: read without flattening; anything else through
    ``tree_leaves``), or ``None``.

    Example:
        >>> x = torch.ones(1, requires_grad=True)
        >>> type(first_grad_node((torch.ones(1), x * 2))).__name__
        'MulBackward0'
    """
    leaves = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else None
    if leaves is None or not all(isinstance(t, torch.Tensor) for t in leaves):
        leaves = tree_leaves(out)
    return next((t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn), None)


def node_order(node: object | None = None) -> int:
    """The order in which autograd node ``node`` was created on its thread (later: larger), or,
    without one, that of a node created now: what a node created after this call exceeds.
    ``AccumulateGrad`` nodes have the largest. Checked: 2.13, 2.15.

    Example:
        >>> mark = node_order()
        >>> node_order((torch.ones(1, requires_grad=True) * 2).grad_fn) > mark
        True
    """
    if node is None:
        node = torch.ones(1, requires_grad=True).clone().grad_fn
    return node._sequence_nr()  # type: ignore[union-attr]


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


def store_wait(store: Any, keys: list[str], timeout: timedelta) -> bool:
    """Wait for ``keys`` in ``store``; False when ``timeout`` passed first (the store's timeout
    error type differs across releases: ``DistStoreError`` since 2.4, a ``RuntimeError``
    before). Checked: 2.11, 2.13, 2.15.

    Example:
        >>> s = torch.distributed.HashStore(); s.set("k", "v")
        >>> store_wait(s, ["k"], timedelta(seconds=1))
        True
    """
    try:
        store.wait(keys, timeout)
    except RuntimeError as exc:  # DistStoreError is a RuntimeError
        if "timeout" in str(exc).lower() or type(exc).__name__ == "DistStoreError":
            return False
        raise
    return True


def store_get_within(store: Any, key: str, timeout: timedelta) -> bytes | None:
    """``store.get(key)``, waiting for the key up to ``timeout`` (one operation on the store);
    None when it did not appear in time. The store's own timeout is put back after.
    Checked: 2.13 (``Store.timeout``, ``Store.set_timeout``; TCPStore's and HashStore's ``get``
    wait for a missing key up to it).

    Example:
        >>> s = torch.distributed.HashStore(); s.set("k", "v")
        >>> store_get_within(s, "k", timedelta(seconds=1))
        b'v'
    """
    before = store.timeout
    store.set_timeout(timeout)
    try:
        return store.get(key)
    except RuntimeError as exc:  # DistStoreError is a RuntimeError
        if (
            "timeout" in str(exc).lower()
            or "timed out" in str(exc).lower()
            or type(exc).__name__ == "DistStoreError"
        ):
            return None
        raise
    finally:
        store.set_timeout(before)


def restarts_share_agent_store() -> bool:
    """Whether this process is a torchrun worker that may be restarted (``--max-restarts`` above
    0) and whose default store is the agent's rendezvous store, shared by every attempt
    (torch's default since 2.4; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` turns it off).
    Checked: 2.13 (``TORCHELASTIC_USE_AGENT_STORE``, ``TORCHELASTIC_MAX_RESTARTS``).

    Example:
        >>> isinstance(restarts_share_agent_store(), bool)
        True
    """
    import os

    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
    )


def ddp_comm_hooks(ddp: torch.nn.Module) -> list[tuple[Callable, object]]:
    """``(hook, state)`` of each Python communication hook registered on a DDP model.

    Checked: 2.11, 2.13, 2.15 (``ddp._comm_hooks``, appended by ``register_comm_hook``).

    Example:
        >>> ddp_comm_hooks(torch.nn.Linear(1, 1))
        []
    """
    return list(getattr(ddp, "_comm_hooks", []))


def ddp_builtin_comm_hook(ddp: torch.nn.Module) -> str:
    """The name of the C++ built-in hook registered on a DDP model, or ``""``.

    Built-in hooks show only in DDP's logging data (``comm_hook``). Checked: 2.11, 2.13, 2.15.

    Example:
        >>> # ddp_builtin_comm_hook(ddp) -> 'BuiltinCommHookType.FP16_COMPRESS'
    """
    return str(ddp._get_ddp_logging_data().get("comm_hook", "") or "")


def ddp_delayed_params(ddp: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of ``DDP(delay_all_reduce_named_params=...)``. Checked: 2.13.

    Example:
        >>> ddp_delayed_params(torch.nn.Linear(1, 1))
        []
    """
    return list(getattr(ddp, "_delay_all_reduce_params", []))


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
    if inspect.ismethod(fn):
        # The engine keeps the last backward's callbacks until the next backward runs: held
        # weakly, a model closed and deleted after its last step does not live on through them.
        method = weakref.WeakMethod(fn)

        def call() -> None:
            bound = method()
            if bound is not None:
                bound()

        torch.autograd.Variable._execution_engine.queue_callback(call)
    else:
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


def optimizer_in_backward_count() -> int:
    """How many hooks ``_apply_optimizer_in_backward`` left registered, process-wide (0 when unused).

    Checked: 2.13 (``torch.distributed.optim.apply_optimizer_in_backward.param_to_optim_hook_handle_map``).

    Example:
        >>> optimizer_in_backward_count() >= 0
        True
    """
    # Not imported: nobody could call ``_apply_optimizer_in_backward``. Importing it here would
    # cost the first step 0.4-0.8 s (``torch.distributed.optim`` scripts its functional optimizers).
    m = sys.modules.get("torch.distributed.optim.apply_optimizer_in_backward")
    handles = getattr(m, "param_to_optim_hook_handle_map", None)
    return sum(len(h) for h in handles.values()) if handles else 0


def optimizers_in_backward(param: torch.Tensor) -> list:
    """The optimizers ``_apply_optimizer_in_backward`` gave ``param`` (empty if none). Checked: 2.13.

    Example:
        >>> optimizers_in_backward(torch.zeros(1))
        []
    """
    return list(getattr(param, "_in_backward_optimizers", None) or [])


def join_config(joinable: object) -> Any:
    """The ``_JoinConfig`` a ``Join`` context set on ``joinable`` (``None`` if it never was).

    Checked: 2.13 (``torch.distributed.algorithms.join``: ``Join._set_joinable_configs``).

    Example:
        >>> join_config(object()) is None
        True
    """
    return getattr(joinable, "_join_config", None)


def remove_optimizer_in_backward_hooks(params: list[torch.Tensor]) -> None:
    """Remove the hooks ``_apply_optimizer_in_backward`` registered on ``params``, as DDP does.

    Checked: 2.13 (the handle map above; DDP's ``_setup_in_backward_optimizers``).

    Example:
        >>> remove_optimizer_in_backward_hooks([])
    """
    from torch.distributed.optim import apply_optimizer_in_backward as m

    handles = getattr(m, "param_to_optim_hook_handle_map", None)
    if handles is None:
        raise unsupported(
            "torch's optimizer-in-backward hook registry", AttributeError("param_to_optim_hook_handle_map")
        )
    for p in params:
        for handle in handles.get(p, []):
            handle.remove()
        if p in handles:
            handles[p] = []


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


def checkpoint_as_ddp(cls: type) -> None:
    """Make ``torch.distributed.checkpoint.state_dict`` read ``cls`` as it reads DDP (idempotent).

    DCP's ``get_state_dict``/``set_state_dict`` (and so ``dcp.save``/``dcp.load`` of what they
    return) name each parameter by walking the model from the root, dropping DDP's
    ``module.`` prefix where ``isinstance(obj, DistributedDataParallel)``; there is no way for
    another wrapper to say the same. Widened to a tuple with ``cls`` (whose inner model is its
    ``module``, as DDP's), a wrapped model's model and optimizer state get DDP's keys, and
    checkpoints move between DDP, ``torch.compile(DDP)`` and ``cls``. Checked: 2.13 (the
    name ``DDP`` is used only in ``_get_fqns``).

    Example:
        >>> class Wrapper(torch.nn.Module): ...
        >>> checkpoint_as_ddp(Wrapper)
    """
    try:
        from torch.distributed.checkpoint import state_dict as dcp_state_dict
    except ImportError:  # a torch without distributed checkpointing: nothing to align
        return
    current = getattr(dcp_state_dict, "DDP", None)
    if current is None:
        raise unsupported("torch.distributed.checkpoint.state_dict.DDP", AttributeError("DDP"))
    kinds = current if isinstance(current, tuple) else (current,)
    if cls not in kinds:
        dcp_state_dict.DDP = (*kinds, cls)


def ddp_optimizer_first_bucket(nbytes: int) -> Any:
    """A context in which DDPOptimizer (``torch.compile(DDP)``) plans its first bucket at ``nbytes``.

    It takes its first bucket's size from c10d's default (1 MiB) and refuses a DDP whose cap
    is smaller ("First bucket should be smaller/equal to other buckets"); a benchmark at a
    small scale (the host-overhead proxy: caps of kilobytes) sets it to the cap, as DDP's own
    rule gives an explicit cap. Checked: 2.13 (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``,
    read when TorchDynamo builds the DDPOptimizer).

    Example:
        >>> with ddp_optimizer_first_bucket(4096):
        ...     pass
    """
    import contextlib

    import torch.distributed as dist

    @contextlib.contextmanager
    def patched() -> Any:
        before = dist._DEFAULT_FIRST_BUCKET_BYTES
        dist._DEFAULT_FIRST_BUCKET_BYTES = nbytes
        try:
            yield
        finally:
            dist._DEFAULT_FIRST_BUCKET_BYTES = before

    return patched()
