"""distcompile inside the stacks people train with: Accelerate, the Hugging Face Trainer, Lightning.

Each module imports its stack only when used, and the core never imports this package.
What each needs from distcompile goes through the public API (``import distcompile``).

- ``hf_accelerate.enable(accelerator, ...)``: ``Accelerator.prepare`` returns distcompile models.
- ``hf_trainer.enable(trainer, ...)``: the Hugging Face ``Trainer`` trains one.
- ``lightning_strategies.DistCompileStrategy`` / ``DistCompileFabricStrategy``: ``strategy=`` of
  Lightning's ``Trainer`` and of ``Fabric``.

(The module names differ from the stacks' own, so none shadows its stack.)

``docs/integrations.md`` shows each, tested in ``tests/integrations``.
"""

__all__: list[str] = []
