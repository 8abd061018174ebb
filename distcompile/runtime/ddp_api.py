"""DDP's own API on the module users train: communication hooks, ``Join``, and the rest.

What a DDP user touches after ``wrap`` either works as on DDP or raises a distcompile error
naming the alternative (docs/ddp-parity.md); a plain ``AttributeError`` on a DDP method
would be a bug. The same calls made on the DDP object that ``wrap`` adopted
(``ddp.register_comm_hook``, ``Join([ddp])``) reach this module too (``attach_to``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import DDPAttributeError
from .hooks import adopt_hook, builtin_hook, check_exclusive
from .join import DistJoinHook

__all__ = ["DDPSurface"]

log = logging.getLogger(__name__)

#: Methods of the DDP object that ``wrap`` adopted which are redirected to the wrapped module.
_REDIRECTED = ("register_comm_hook", "_register_builtin_comm_hook", "join_hook")


class DDPSurface:
    """Mixin of :class:`DistCompiledModule`: DDP's methods, on distcompile's buckets and steps."""

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Register a DDP communication hook; it runs on distcompile's buckets from the next step.

        The hook gets a ``GradBucket``-like bucket (``buffer()``, ``index()``, ``is_last()``,
        ``parameters()``, ``gradients()``, ``set_buffer()``) of local gradients and returns a
        ``torch.futures.Future`` of the reduced buffer, as under DDP. DDP's allreduce, fp16 and
        bf16 hooks on the model's process group run as the fused all-reduce instead.

        Example:
            >>> # from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
            >>> # state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=2)
            >>> # model.register_comm_hook(state, powerSGD.powerSGD_hook)
        """
        comm_hook, compression = adopt_hook(hook, state, self._settings.group)
        check_exclusive(comm_hook, self.config.compression, fix="Wrap without compression= to use the hook.")
        self._reducer.set_comm_hook(comm_hook, compression or self.config.compression)
        name = comm_hook.name if comm_hook else f"fused all-reduce, compression={compression}"
        log.info("communication hook %s: from the next step", name)

    def _register_builtin_comm_hook(self, comm_hook_type: object) -> None:
        """DDP's C++ built-in hooks (``dist.BuiltinCommHookType``), as the fused all-reduce."""
        self._reducer.set_comm_hook(None, builtin_hook(str(comm_hook_type)) or self.config.compression)

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The process group gradients are averaged over, as ``DDP.process_group``."""
        return self._settings.group or dist.group.WORLD

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s collectives run (the parameters' device), as ``DDP.join_device``."""
        first = next(iter(self.module.parameters()), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The process group of ``Join``'s collectives, as ``DDP.join_process_group``."""
        return self.process_group

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A ``Join`` context for training on uneven inputs, as ``DDP.join``.

        A rank that runs out of batches shadows the others' collectives until every rank
        has; gradients are divided by the world size (or, with
        ``divide_by_initial_world_size=False``, by the ranks still training).

        Example:
            >>> # with model.join():
            >>> #     for x, y in my_rank_batches:   # a different number per rank
            >>> #         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: object) -> JoinHook:
        """The hook ``Join`` runs on a rank that joined (``divide_by_initial_world_size`` as DDP's)."""
        self._divide_by_initial = bool(kwargs.get("divide_by_initial_world_size", True))
        return DistJoinHook(self._shadow_step, self._take_last_joiner_state)

    def _set_static_graph(self) -> None:
        """Accepted and unneeded: distcompile's buckets follow the captured graphs, static or not."""
        log.debug("_set_static_graph(): nothing to do, the buckets follow the captured graphs")

    def attach_to(self, ddp: nn.Module) -> None:
        """Make ``ddp.register_comm_hook(...)`` and ``Join([ddp])`` reach this module (``close`` undoes it)."""
        if isinstance(ddp, DDP):
            for name in _REDIRECTED:
                setattr(ddp, name, getattr(self, name))

    def detach_from(self, ddp: nn.Module) -> None:
        for name in _REDIRECTED:
            vars(ddp).pop(name, None)

    def __getattr__(self, name: str) -> object:
        try:
            return nn.Module.__getattr__(self, name)  # type: ignore[arg-type]
        except AttributeError:
            pass
        source = vars(self).get("_source")
        ddp = source[0] if source and isinstance(source[0], DDP) else None
        if ddp is not None and name in vars(ddp) and not name.startswith("_"):
            return vars(ddp)[name]  # a DDP setting (device_ids, bucket_bytes_cap, ...), read-only
        if hasattr(DDP, name) or (ddp is not None and hasattr(ddp, name)):
            raise DDPAttributeError(
                f"{type(self).__name__} has no {name!r}: it is DistributedDataParallel's, and distcompile "
                "replaces DDP's reducer and forward. docs/ddp-parity.md lists what is supported and the "
                "alternatives; the model's own attributes are on model.module (distcompile.unwrap(model))."
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
