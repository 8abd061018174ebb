"""``distcompile.wrap``: where the packages meet (adopt the DDP model, attach telemetry, build the module)."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from . import _events
from . import _torch_compat as compat
from ._agreement import default_store, mark_address
from ._config import Config
from ._log import enable_progress
from .errors import UnsupportedModelError
from .runtime import shutdown
from .runtime.ddp import Settings, adopt
from .runtime.module import DistCompiledModule
from .runtime.nesting import WRAPPERS
from .telemetry.sink import Telemetry

log = logging.getLogger(__name__)

__all__ = ["unwrap", "wrap"]


def _make_telemetry(config: Config, inner: nn.Module, settings: Settings) -> Telemetry | None:
    if not config.logdir:
        return None
    rank = dist.get_rank()
    if config.telemetry_all_ranks:
        run_dir: str | None = os.path.join(config.logdir, f"rank{rank}")
    else:
        run_dir = config.logdir if rank == settings.ranks[0] else None
    device = settings.device or next(
        (p.device for p in inner.parameters() if not p.is_meta), torch.device("cpu")
    )
    return Telemetry(
        run_dir=run_dir,
        trace_dir=os.path.join(config.logdir, "traces"),
        rank=rank,
        trace_every=config.trace_every,
        figure_every=config.figure_every,
        device=device,
        serial_comm=dist.get_backend(settings.group) == "nccl",
    )


def wrap(model: nn.Module, config: Config | None = None, **options: object) -> DistCompiledModule:
    """Compile a data-parallel model so each gradient bucket's all-reduce overlaps backward.

    ``model`` is a ``DistributedDataParallel`` model (its process group, bucket cap,
    ``broadcast_buffers``, ``gradient_as_bucket_view`` and fp16/bf16 comm hook are
    honoured) or a plain module when a default process group is initialized (its
    parameters and buffers are then broadcast from rank 0, as DDP does).

    Args:
        model: The DDP model, or a plain ``nn.Module``.
        config: Options; see :class:`distcompile.Config`.
        **options: Any ``Config`` field, overriding ``config``.

    Returns:
        A module to train exactly like the DDP model (``no_sync()`` included).

    Example:
        >>> # torch.distributed.init_process_group("gloo")
        >>> # model = distcompile.wrap(DDP(MyModel()), backend="inductor")
        >>> # loss = loss_fn(model(x), y); loss.backward(); opt.step()
    """
    cfg = config or Config()
    if options:
        cfg = cfg.replace(**options)
    if isinstance(model, DistCompiledModule) or compat.is_compiled_module(model):
        raise UnsupportedModelError(
            f"got an already compiled model ({type(model).__name__}); distcompile compiles the "
            "model itself. Pass the uncompiled DDP model (drop torch.compile / the earlier wrap)."
        )
    inner, settings = adopt(model, cfg)
    _close_earlier_wrappers(inner)
    compat.checkpoint_as_ddp(DistCompiledModule)  # DCP checkpoints with DDP's keys (docs/ddp-parity.md)
    _warn_if_restarts_share_the_agent_store()
    mark_address(default_store(), settings.store_root, dist.get_rank())  # for errors to name peers by rank
    if not _events.started():  # the first wrap of this process opens its life in the event log
        _events.emit("start", rank=dist.get_rank(), world=dist.get_world_size(), life=settings.store_root)
    enable_progress(rank=dist.get_rank(), first_rank=dist.get_rank() == settings.ranks[0])
    telemetry = _make_telemetry(cfg, inner, settings)
    return DistCompiledModule(inner, config=cfg, settings=settings, source=model, observer=telemetry)


def _close_earlier_wrappers(inner: nn.Module) -> None:
    """Close each open wrapper of the same model (wrapped again: a notebook cell run twice, a
    second fit with other options): a parameter has one wrapper at a time. Two would both keep
    gradient hooks on it, and the earlier one, seeing the later one's gradients arrive after its
    own step ended, would warn of a second backward that never happened. A wrapper of another
    model that shares some parameters with this one (a submodule in both) stays open: said."""
    mine = {id(p) for p in inner.parameters()}
    for earlier in shutdown.open_models():
        if not isinstance(earlier, DistCompiledModule) or earlier.closed:
            continue
        theirs = dict(earlier.module.named_parameters())
        shared = [n for n, p in theirs.items() if id(p) in mine]
        if not shared:
            continue
        names = ", ".join(shared[:3]) + (", ..." if len(shared) > 3 else "")
        if len(shared) == len(theirs):  # the same model (or one this model holds whole)
            log.warning(
                "distcompile.wrap: this model's parameters (%s) are synchronized by an earlier wrapper "
                "that is still open; it is closed now, since one wrapper at a time synchronizes a "
                "parameter. Train the new one; call .close() on a wrapper before wrapping its model "
                "again to skip this message.",
                names,
            )
            earlier.close(replaced=True)
        else:
            log.warning(
                "distcompile.wrap: %d parameter(s) of this model (%s) are also synchronized by another "
                "open distcompile model: each averages them at its own steps and sees the other's "
                "gradients arrive outside them (it may warn of a second backward). Wrap one model that "
                "holds both, or close the other first.",
                len(shared),
                names,
            )


_warned_store = False


def _warn_if_restarts_share_the_agent_store() -> None:
    # Issue 44: with the agent's store shared between attempts, a restarted group reads the last
    # group's keys (torch's own: gloo connects to the dead ranks' addresses and fails, or
    # waits), with eager DDP as with distcompile. Torch's to fix; said once, with the setting.
    global _warned_store
    if _warned_store or not compat.restarts_share_agent_store():
        return
    _warned_store = True
    log.warning(
        "this torchrun job may restart its workers (--max-restarts) and they share the agent's "
        "rendezvous store, which keeps the last attempt's keys: after a restart, the new process "
        "group can fail to connect ('Connection refused' in gloo) or hang, with or without "
        "distcompile. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
        "(launchers/*.sh and launchers/slurm.sbatch do), docs/launching.md."
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside ``model``: peels distcompile, DDP, DataParallel and ``torch.compile``.

    Use it to save weights that load into a plain model (its ``state_dict`` keys carry no
    ``module.`` prefix), or to reach the model's own attributes and methods.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> unwrap(net) is net
        True
        >>> # unwrap(distcompile.wrap(DDP(net))) is net   -> True
    """
    while True:
        if isinstance(model, tuple(WRAPPERS)):
            model = model.module
        elif compat.is_compiled_module(model):
            model = compat.compiled_original(model)
        else:
            return model
