"""The Hugging Face ``Trainer``: it prepares its model through Accelerate, so distcompile goes there.

``enable(trainer)`` calls :func:`distcompile.integrations.hf_accelerate.enable` on the
Trainer's own ``Accelerator``. Gradient accumulation (``gradient_accumulation_steps``),
checkpoints (``save_steps``, ``resume_from_checkpoint``) and ``save_model`` work through
the Trainer's API as they do under its own DDP.
"""

from __future__ import annotations

from typing import Any

import distcompile

from .hf_accelerate import enable as enable_accelerate

__all__ = ["enable"]


def enable(trainer: Any, config: distcompile.Config | None = None, **options: Any) -> Any:
    """Make ``trainer.train()`` train a distcompile model; call it before ``train()``.

    Args:
        trainer: A ``transformers.Trainer`` (or subclass), launched on several ranks
            (``torchrun``, ``accelerate launch``).
        config: Options of :func:`distcompile.wrap`.
        **options: Any :class:`distcompile.Config` field, overriding ``config``.

    Returns:
        ``trainer`` itself.

    Example:
        >>> # trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds)
        >>> # distcompile.integrations.hf_trainer.enable(trainer, backend="inductor")
        >>> # trainer.train()
    """
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise distcompile.ConfigError(
            f"enable() takes a transformers.Trainer, got {type(trainer).__name__}. Build the Trainer first, "
            "then call enable(trainer) before trainer.train()."
        )
    if trainer.args.torch_compile:
        raise distcompile.ConfigError(
            "TrainingArguments(torch_compile=True) compiles the model in Accelerate, so it would be compiled "
            "twice. Leave torch_compile=False and pass compile options (backend=, mode=, dynamic=) to enable()."
        )
    enable_accelerate(trainer.accelerator, config, **options)
    return trainer
