"""Hugging Face Accelerate: ``Accelerator.prepare`` builds the DDP model, distcompile compiles it.

``enable(accelerator)`` changes one accelerator object (no global state): its
``prepare``/``prepare_model`` wrap each DDP model it builds with :func:`distcompile.wrap`
and hand that back, and its ``unwrap_model`` (which ``get_state_dict``, ``save_model``
and the Trainer's save path call) sees through distcompile to the user's model.
``save_state``/``load_state`` keep working on the prepared model, and ``accumulate()``
and ``no_sync()`` reach distcompile's ``no_sync``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile

__all__ = ["enable"]


def enable(accelerator: Any, config: distcompile.Config | None = None, **options: Any) -> Any:
    """Make ``accelerator.prepare`` return distcompile models; call it before ``prepare``.

    Args:
        accelerator: An ``accelerate.Accelerator``.
        config: Options of :func:`distcompile.wrap`.
        **options: Any :class:`distcompile.Config` field, overriding ``config``.

    Returns:
        ``accelerator`` itself.

    Example:
        >>> # accelerator = Accelerator(gradient_accumulation_steps=4)
        >>> # distcompile.integrations.hf_accelerate.enable(accelerator, backend="inductor")
        >>> # model, opt, loader = accelerator.prepare(model, opt, loader)  # model: a DistCompiledModule
        >>> # accelerator.unwrap_model(model)                              # the user's model
    """
    from accelerate import Accelerator

    if not isinstance(accelerator, Accelerator):
        raise distcompile.ConfigError(
            f"enable() takes an accelerate.Accelerator, got {type(accelerator).__name__}. "
            "Pass the Accelerator object you call prepare() on."
        )
    cfg = (config or distcompile.Config()).replace(**options)
    enabled = getattr(accelerator, "distcompile_config", None)
    if enabled is not None:
        if enabled != cfg:
            raise distcompile.ConfigError(
                "enable() was already called on this Accelerator with other options "
                f"({_differences(enabled, cfg)}); the models it prepares are compiled with the first. Call "
                "enable() once, with every option."
            )
        return accelerator  # enabled already with these options: do not wrap twice
    # Accelerate keeps every model passed to prepare() in _models (the user's own model, not
    # the DDP it returned, in Accelerate 1.15): any entry means a model went by unwrapped.
    if accelerator._models:
        raise distcompile.ConfigError(
            f"this Accelerator already prepared {len(accelerator._models)} model(s) "
            f"({', '.join(type(m).__name__ for m in accelerator._models)}), which train under Accelerate's own "
            "DDP: enable() only changes what later prepare() calls return. Call enable() right after "
            "creating the Accelerator (with the Trainer: right after building it, before train())."
        )
    prepare_model, unwrap_model = accelerator.prepare_model, accelerator.unwrap_model

    def prepare_compiled(
        model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        _check_no_accelerate_compile(accelerator)
        out = prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if not isinstance(out, DDP):  # one process, or evaluation_mode: nothing to synchronize
            _check_not_alone(accelerator, evaluation_mode)
            return out
        wrapped = distcompile.wrap(out, cfg)
        wrapped._is_accelerate_prepared = True  # prepare() called again returns it as it is
        for i, m in enumerate(accelerator._models):  # save_state/load_state see the wrapped model
            if m is out:
                accelerator._models[i] = wrapped
        return wrapped

    def unwrap_compiled(model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, distcompile.DistCompiledModule):
            model = model.module
        return unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    accelerator.prepare_model = prepare_compiled
    accelerator.unwrap_model = unwrap_compiled
    accelerator.distcompile_config = cfg
    return accelerator


def _check_not_alone(accelerator: Any, evaluation_mode: bool) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not evaluation_mode and world > 1 and accelerator.num_processes == 1:
        raise distcompile.ConfigError(
            f"the launcher started {world} processes (WORLD_SIZE={world}) but this Accelerator runs each on its "
            f"own (distributed_type={accelerator.distributed_type}): every rank would train alone, with no "
            "gradient synchronization. Without a GPU, Accelerate needs Accelerator(cpu=True) (or "
            "`accelerate launch --cpu`; the Trainer: TrainingArguments(use_cpu=True)) to build its DDP model."
        )


def _check_no_accelerate_compile(accelerator: Any) -> None:
    backend = getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", None)
    name = str(getattr(backend, "value", backend or "no")).lower()
    if name != "no":
        raise distcompile.ConfigError(
            f"this Accelerator compiles models itself (dynamo_backend={name!r}), so the DDP model would be "
            "compiled twice. With distcompile, leave Accelerate's dynamo_backend unset (the default; for the "
            "Trainer: torch_compile=False) and pass compile options to enable() instead."
        )


def _differences(first: distcompile.Config, second: distcompile.Config) -> str:
    """The options two configs set differently, as ``name: first -> second``."""
    pairs = [(g, h) for g, h in zip(first.as_groups(), second.as_groups())]
    return ", ".join(
        f"{f.name}: {getattr(g, f.name)!r} -> {getattr(h, f.name)!r}"
        for g, h in pairs
        for f in dataclasses.fields(g)
        if getattr(g, f.name) != getattr(h, f.name)
    )
