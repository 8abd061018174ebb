"""Adopting the DDP model: its options, resolved with ``wrap``'s, checked across ranks.

``adopt`` turns what the user passed (a DDP model, or a plain module with a default
process group) and the ``Config`` into one ``Settings``: the process group, bucket caps
(DDP's rules), ``broadcast_buffers``, ``gradient_as_bucket_view``, compression (DDP's
fp16/bf16 hooks included), ignored parameters, the device, and the measured costs under
``bucket_cap_mb="auto"``. It also checks that every rank holds the same parameters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import _torch_compat as compat
from .._agreement import check_agreement, default_store
from .._config import Config
from ..errors import ConfigError, UnsupportedModelError
from ..planning.costs import CostModel
from ..planning.plan import DEFAULT_FIRST_BUCKET_BYTES
from .bucket import as_real
from .collectives import agreed_token, broadcast_coalesced, group_device
from .hooks import CommHook, adopt_hook, builtin_hook, check_exclusive
from .measure import measure_costs
from .nesting import data_parallel_kind, find_inner_data_parallel

__all__ = ["Settings", "adopt", "bucket_caps"]

#: Store keys of the cross-rank checks. A per-process counter: every rank must call
#: ``wrap`` for its models in the same order (as with any collective), so the n-th check
#: of every rank uses the same key.


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the runtime and the backend need from the DDP model and ``Config``, resolved.

    Attributes:
        group: The process group (``None``: the default group).
        ranks: Global ranks of ``group``, in group order.
        bucket_cap: Bytes of every bucket (DDP's rules, see :func:`bucket_caps`).
        first_bucket_cap: Bytes of the first bucket.
        broadcast_buffers: Broadcast buffers from the group's first rank before each forward.
        grad_as_view: ``gradient_as_bucket_view``.
        compression: ``None``, ``"fp16"`` or ``"bf16"`` (``Config`` or DDP's fp16/bf16 comm hook).
        comm_hook: A communication hook registered on the DDP model that runs on distcompile's
            buckets (``runtime/hooks.py``); DDP's own allreduce/fp16/bf16 hooks are ``compression``.
        ignored: Parameter and buffer names DDP was told to ignore.
        find_unused: DDP's ``find_unused_parameters``: the parameters used may differ between
            steps and ranks (Note [Graphs that differ by data]).
        device: Where inputs go (the DDP model's ``device_ids[0]``), or ``None``.
        costs: The measured cost model under ``bucket_cap_mb="auto"``, else ``None``.
        store_root: The prefix of this wrapped model's keys in the job's store, drawn on the
            group's first rank for this life of the group (:func:`agreed_token`).
    """

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    bucket_cap: int
    first_bucket_cap: int
    broadcast_buffers: bool
    grad_as_view: bool
    compression: str | None
    comm_hook: CommHook | None
    ignored: frozenset[str]
    find_unused: bool
    device: torch.device | None
    costs: CostModel | None
    store_root: str


def adopt(model: nn.Module, cfg: Config) -> tuple[nn.Module, Settings]:
    """Validate ``model``, resolve its options with ``cfg``'s, and check it across ranks.

    A collective on the model's process group: every rank calls it (``wrap`` does). Returns
    the inner module to compile and the settings. A plain module's parameters and buffers
    are broadcast from rank 0, as DDP's constructor does.

    Example:
        >>> # inner, settings = adopt(DDP(model), Config())
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"distcompile.wrap expects a torch.nn.Module or DistributedDataParallel, got "
            f"{type(model).__name__}. Pass your model object (e.g. DDP(MyModel()))."
        )
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "distcompile.wrap needs an initialized default process group, found none. "
            "Call torch.distributed.init_process_group() first (torchrun sets the environment), "
            "then build DistributedDataParallel(model) and wrap it."
        )
    _reject_nested(model)
    inner, fields = _from_ddp(model) if isinstance(model, DDP) else _from_module(model)
    cap, first_cap = bucket_caps(
        model, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_cap_mb=cfg.first_bucket_cap_mb
    )
    broadcast_buffers, grad_as_view, (comm_hook, compression) = fields.pop("inherited")
    check_exclusive(
        comm_hook,
        cfg.compression,
        fix="Drop compression= (the hook's own compression applies) or the hook.",
        whose="the DDP model's ",
    )
    group = fields["group"]
    params = list(inner.parameters())
    if cfg.cudagraphs and not (params and all(p.is_cuda for p in params)):
        raise ConfigError(
            f"cudagraphs=True needs a model on CUDA, but its parameters are on "
            f"{params[0].device if params else 'no parameters'}. CUDA graphs record GPU kernels only; "
            "drop cudagraphs=True on this machine."
        )
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    # The model's keys in the store, drawn by the first rank: every check below is keyed by
    # it, not by how many models this process wrapped before.
    token = agreed_token(src=ranks[0], group=group, device=group_device(group, params))
    store_root = f"distcompile/{token:016x}"
    _check_across_ranks(model, inner, ranks, cfg, group, store_root)
    costs = None
    if cfg.bucket_cap_mb == "auto":
        device = fields["device"] or (params[0].device if params else torch.device("cpu"))
        costs = measure_costs(group=group, device=device, remember_dir=_costs_dir())
    return inner, Settings(
        **fields,
        ranks=ranks,
        bucket_cap=cap,
        first_bucket_cap=first_cap,
        broadcast_buffers=_pick(cfg.broadcast_buffers, broadcast_buffers),
        grad_as_view=_pick(cfg.gradient_as_bucket_view, grad_as_view),
        compression=cfg.compression or compression,
        comm_hook=comm_hook,
        costs=costs,
        store_root=store_root,
    )


def _check_across_ranks(
    model: nn.Module,
    inner: nn.Module,
    ranks: tuple[int, ...],
    cfg: Config,
    group: dist.ProcessGroup | None,
    store_root: str,
) -> None:
    """A DDP model's parameter values; a plain module's shapes, then rank 0's states broadcast."""
    if isinstance(model, DDP):
        if cfg.check_params:
            _agree_on(
                ranks,
                cfg,
                f"{store_root}/params",
                _param_checksums(inner),
                "the parameter values at wrap time",
                "DDP broadcast rank 0's parameters when it was built; they changed since on some rank "
                "(e.g. a checkpoint loaded on one rank only). Load the same weights on every rank before "
                "wrap(), or wrap(..., check_params=False) to skip this check.",
            )
    else:
        # A plain module gets no DDP constructor check; without this, ranks whose models
        # differ in shape would hang or fail inside the first broadcast.
        shapes = "\n".join(f"{n} {tuple(p.shape)} {p.dtype}" for n, p in inner.named_parameters())
        _agree_on(
            ranks,
            cfg,
            f"{store_root}/shapes",
            shapes,
            "the model's parameter names, shapes and dtypes",
            "Every rank must build the same model before wrap().",
        )
        # Tensors on the meta device (deferred initialization) have no values yet: the model takes
        # the first rank's once they are materialized (Note [Parameters that change after wrap]).
        states = [t.detach() for t in (*inner.parameters(), *inner.buffers()) if not t.is_meta]
        if states:
            broadcast_coalesced(states, src=ranks[0], group=group)


_WHERE_TO_WRAP = (
    "Wrap once, outermost: distcompile.wrap(DDP(model)) or distcompile.wrap(model), with no other "
    "data-parallel wrapper inside or around it. With Accelerate, Lightning or the Hugging Face Trainer, "
    "use distcompile.integrations (docs/integrations.md); distcompile.unwrap(model) gives the plain model back."
)


def _reject_nested(model: nn.Module) -> None:
    # A data-parallel wrapper inside would reduce gradients a second time with its own reducer.
    outer = data_parallel_kind(model)
    if outer is not None and not isinstance(model, DDP):
        raise UnsupportedModelError(
            f"got a {outer}; distcompile replaces DistributedDataParallel and cannot adopt this "
            f"wrapper's gradient synchronization. {_WHERE_TO_WRAP}"
        )
    found = find_inner_data_parallel(model.module if isinstance(model, DDP) else model)
    if found is not None:
        path, kind = found
        raise UnsupportedModelError(
            f"the model passed to distcompile.wrap contains a {kind} at {path!r}; it keeps its own "
            "gradient synchronization, so gradients would be all-reduced twice and distcompile would "
            f"plan no overlap. {_WHERE_TO_WRAP}"
        )


def _from_ddp(model: DDP) -> tuple[nn.Module, dict]:
    if getattr(model, "mixed_precision", None) is not None:
        raise UnsupportedModelError(
            f"DDP mixed_precision={model.mixed_precision!r} is not supported: DDP then keeps a low-precision "
            "copy of every parameter, runs forward and backward on the copies through hooks on its own "
            "forward (which distcompile does not call), and reduces in reduce_dtype; a compiled graph "
            "captured on the full-precision parameters would train something else. Use torch.autocast in "
            "the training loop (same low-precision compute) and compression='bf16' or 'fp16' (the "
            "reduce_dtype) instead."
        )
    if compat.ddp_uses_python_reducer(model):
        raise UnsupportedModelError(
            "the DDP model was built while torch._dynamo.config.optimize_ddp='python_reducer', so "
            "its Python reducer all-reduces every gradient itself and distcompile would communicate "
            "twice. Build the DDP model with the default optimize_ddp (True) before wrap()."
        )
    group = model.process_group
    try:
        dist.get_process_group_ranks(group)  # raises for a destroyed group
    except Exception as exc:  # noqa: BLE001 - any failure means the group is unusable
        raise UnsupportedModelError(
            f"the DDP model's process group is no longer usable ({type(exc).__name__}: {exc}); it "
            "was probably destroyed. Build the DDP model on a live process group before wrap()."
        ) from exc
    # delay_all_reduce_named_params: DDP lists them as ignored and all-reduces them after
    # backward; distcompile reduces them with the parameters of their first use.
    delayed = {id(p) for p in compat.ddp_delayed_params(model)}
    delayed_names = {n for n, p in model.module.named_parameters() if id(p) in delayed}
    return model.module, {
        "group": group,
        "ignored": frozenset(getattr(model, "parameters_to_ignore", ())) - delayed_names,
        "find_unused": bool(getattr(model, "find_unused_parameters", False)),
        "device": torch.device(model.device_type, model.device_ids[0]) if model.device_ids else None,
        "inherited": (model.broadcast_buffers, model.gradient_as_bucket_view, _ddp_hook(model, group)),
    }


def _from_module(model: nn.Module) -> tuple[nn.Module, dict]:
    # What DDP(model) would have done: broadcast buffers, gradients not bucket views.
    return model, {
        "group": None,
        "ignored": compat.ddp_ignored_names(model),
        "find_unused": False,
        "device": None,
        "inherited": (True, False, (None, None)),
    }


def _agree_on(ranks: tuple[int, ...], cfg: Config, key: str, summary: str, what: str, fix: str) -> None:
    check_agreement(
        default_store(),
        key,
        summary,
        rank=dist.get_rank(),
        ranks=list(ranks),
        timeout_s=cfg.desync_timeout_s,
        what=what,
        fix=fix,
    )


def _costs_dir() -> str:
    # Next to Inductor's compile cache: the remembered costs exist to keep that cache useful.
    return os.path.join(compat.inductor_cache_dir(), "distcompile")


def _pick(option: bool | None, inherited: bool) -> bool:
    return inherited if option is None else option


_MB = 1024 * 1024


_DDP_DEFAULT_CAP_MB = 25


def _ddp_hook(ddp: DDP, group: dist.ProcessGroup | None) -> tuple[CommHook | None, str | None]:
    """The communication hook registered on ``ddp`` before ``wrap``: to call, or fused as compression."""
    hooks = compat.ddp_comm_hooks(ddp)
    if hooks:
        hook, state = hooks[-1]  # DDP allows one
        return adopt_hook(hook, state, group)
    builtin = compat.ddp_builtin_comm_hook(ddp)
    return None, (builtin_hook(builtin) if builtin else None)


def _param_checksums(module: nn.Module) -> str:
    # Two exact float64 sums per parameter (plain and position-weighted): equal bytes give
    # equal sums, and a differing value or a swap changes them. No copy to the host. A complex
    # parameter is summed as its real and imaginary parts (``as_real``).
    lines = []
    with torch.no_grad():
        for name, p in module.named_parameters():
            flat = as_real(p.detach()).reshape(-1).double()
            weights = (
                torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(1009).add_(1)
            )
            lines.append(
                f"{name} {tuple(p.shape)} {p.dtype} {float(flat.sum())!r} {float((flat * weights).sum())!r}"
            )
    return "\n".join(lines)


def bucket_caps(
    model: nn.Module, *, bucket_cap_mb: float | str | None, first_bucket_cap_mb: float | None
) -> tuple[int, int]:
    """Bytes of every bucket and of the first one, following DDP's rules.

    The cap is ``bucket_cap_mb``, else the DDP model's, else DDP's default (25 MiB). The
    first bucket is ``first_bucket_cap_mb``, else 1 MiB when the cap is DDP's default, else
    the cap (as in DDP, an explicit ``bucket_cap_mb`` also sizes the first bucket). A DDP
    built with ``bucket_cap_mb_list`` gives the first bucket its first size and every
    other bucket its largest (distcompile's buckets also follow the graph's segments).

    Example:
        >>> bucket_caps(nn.Linear(1, 1), bucket_cap_mb=None, first_bucket_cap_mb=None)
        (26214400, 1048576)
    """
    if bucket_cap_mb == "auto":  # the caps only serve graphs the cost model cannot plan
        bucket_cap_mb = None
    if bucket_cap_mb is not None:
        cap = int(bucket_cap_mb * _MB)
    elif isinstance(model, DDP):
        cap = int(model.bucket_bytes_cap)
    else:
        cap = _DDP_DEFAULT_CAP_MB * _MB
    default = bucket_cap_mb is None and (
        not isinstance(model, DDP) or bool(getattr(model, "bucket_bytes_cap_default", True))
    )
    if first_bucket_cap_mb is not None:
        return cap, min(int(first_bucket_cap_mb * _MB), cap)
    per_bucket = list(getattr(model, "bucket_bytes_cap_list", None) or ())
    if bucket_cap_mb is None and per_bucket:  # DDP(bucket_cap_mb_list=...): its first, then its largest
        return cap, min(int(per_bucket[0]), cap)
    return cap, (min(DEFAULT_FIRST_BUCKET_BYTES, cap) if default else cap)
