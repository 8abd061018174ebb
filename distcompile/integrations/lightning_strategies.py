"""Lightning: a ``strategy=`` for the ``Trainer`` and one for ``Fabric``, each DDP plus distcompile.

Both build Lightning's own DDP model (device placement, ``DDPStrategy`` keyword arguments
and communication hooks as Lightning handles them) and hand it to :func:`distcompile.wrap`.
Gradient accumulation (``accumulate_grad_batches``, ``fabric.no_backward_sync``) reaches
distcompile's ``no_sync``; checkpoints hold the ``LightningModule``'s (or, in Fabric, the
original module's) plain ``state_dict``, as under DDP.

Imports ``lightning`` (the unified package) when installed, else ``pytorch_lightning``
and ``lightning_fabric``; the strategies subclass that package's ``DDPStrategy``, so pass
them to the ``Trainer``/``Fabric`` of the same package.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import distcompile

try:
    from lightning.fabric.strategies import DDPStrategy as _FabricDDP
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.pytorch.strategies import DDPStrategy as _TrainerDDP
except ImportError:
    from lightning_fabric.strategies import DDPStrategy as _FabricDDP
    from lightning_fabric.strategies.strategy import _BackwardSyncControl
    from pytorch_lightning.strategies import DDPStrategy as _TrainerDDP

__all__ = ["DistCompileFabricStrategy", "DistCompileStrategy"]

log = logging.getLogger(__name__)

#: The LightningModule's methods that run eagerly: they read and write the trainer's state.
_EAGER = ("log", "log_dict")
#: Where a LightningModule keeps its compiled model between fits (an attribute, not a submodule).
_KEPT = "_distcompile_kept"


def _config(config: distcompile.Config | None, options: dict) -> distcompile.Config:
    return (config or distcompile.Config()).replace(**options)


class DistCompileStrategy(_TrainerDDP):
    """``Trainer(strategy=DistCompileStrategy(...))``: Lightning's DDP, compiled by distcompile.

    Args:
        config: Options of :func:`distcompile.wrap`.
        ddp_kwargs: Keyword arguments of Lightning's ``DDPStrategy`` (``process_group_backend``,
            ``timeout``, ``ddp_comm_hook``, DDP's own ``bucket_cap_mb``, ...).
        **options: Any :class:`distcompile.Config` field, overriding ``config``.

    Example:
        >>> # trainer = pl.Trainer(strategy=DistCompileStrategy(backend="inductor"), devices=2,
        >>> #                      accumulate_grad_batches=4)
        >>> # trainer.fit(lightning_module, loader)
    """

    strategy_name = "distcompile"

    def __init__(
        self, config: distcompile.Config | None = None, *, ddp_kwargs: dict | None = None, **options: Any
    ) -> None:
        super().__init__(**(ddp_kwargs or {}))
        self.distcompile_config = _config(config, options)
        #: The compiled model while and after fitting (its ``graphs`` and ``last_step``).
        self.distcompile_model: distcompile.DistCompiledModule | None = None

    def configure_ddp(self) -> None:
        """Build Lightning's DDP model (and its comm hook), then compile it with distcompile.

        ``self.log`` and ``self.log_dict`` run eagerly (``torch.compiler.disable``): traced,
        they read the trainer's logging state, which the graphs would guard on and recompile
        for at each switch between training and validation. A second ``fit`` of the same
        module with the same options reuses the first's compiled model.
        """
        super().configure_ddp()
        module = self.lightning_module
        key = (self.distcompile_config, repr(sorted(self._ddp_kwargs.items())), self.model.process_group)
        kept = module.__dict__.get(_KEPT)
        if kept is not None and kept[0] == key and not kept[1].closed:
            self.model = self.distcompile_model = kept[1]
            log.info("distcompile: this LightningModule's compiled model from the last fit is reused")
        else:
            if kept is not None:  # other options: the last fit's compiled model gives way
                kept[1].close()
            self.model = self.distcompile_model = distcompile.wrap(self.model, self.distcompile_config)
            object.__setattr__(module, _KEPT, (key, self.model))  # not a submodule: out of state_dict
        for name in _EAGER:
            if name not in module.__dict__:
                setattr(module, name, torch.compiler.disable(getattr(module, name)))

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Skip synchronization for the accumulating micro-batches (``accumulate_grad_batches``)."""
        if isinstance(self.model, distcompile.DistCompiledModule):
            with self.model.no_sync():
                yield None
        else:
            with super().block_backward_sync():
                yield None

    def teardown(self) -> None:
        """Give the module its own logging methods back, then Lightning's own teardown.

        The compiled model stays open for the module's next ``fit`` (closed at interpreter exit,
        or by ``strategy.distcompile_model.close()``, which also flushes telemetry).
        """
        module = self.lightning_module
        if isinstance(self.model, distcompile.DistCompiledModule) and module is not None:
            for name in _EAGER:
                module.__dict__.pop(name, None)
            self.model = module
        super().teardown()


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, distcompile.DistCompiledModule):
            raise distcompile.UnsupportedModelError(
                f"fabric.no_backward_sync got a {type(module).__name__}, not the module fabric.setup() "
                "returned under DistCompileFabricStrategy. Pass the model that fabric.setup() returned."
            )
        return module.no_sync()


class DistCompileFabricStrategy(_FabricDDP):
    """``Fabric(strategy=DistCompileFabricStrategy(...))``: Fabric's DDP, compiled by distcompile.

    Args:
        config: Options of :func:`distcompile.wrap`.
        ddp_kwargs: Keyword arguments of Fabric's ``DDPStrategy``.
        **options: Any :class:`distcompile.Config` field, overriding ``config``.

    Example:
        >>> # fabric = Fabric(accelerator="cuda", devices=2,
        >>> #                 strategy=DistCompileFabricStrategy(backend="inductor"))
        >>> # model, opt = fabric.setup(model, opt)
        >>> # with fabric.no_backward_sync(model, enabled=accumulating): fabric.backward(loss)
    """

    def __init__(
        self, config: distcompile.Config | None = None, *, ddp_kwargs: dict | None = None, **options: Any
    ) -> None:
        super().__init__(**(ddp_kwargs or {}))
        self.distcompile_config = _config(config, options)
        self._backward_sync_control = _NoSync()

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Fabric's DDP model, compiled by distcompile (Fabric puts its own thin wrapper around it)."""
        return distcompile.wrap(super().setup_module(module), self.distcompile_config)

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The user's module's ``state_dict`` (no ``module.`` prefix), as Fabric's DDP strategy saves."""
        return super().get_module_state_dict(distcompile.unwrap(module))

    def load_module_state_dict(
        self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True
    ) -> None:
        """Load a plain ``state_dict`` into the user's module inside the compiled one."""
        super().load_module_state_dict(distcompile.unwrap(module), state_dict, strict=strict)
