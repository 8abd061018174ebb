"""Runtime: the wrapped module and the gradient synchronization of a training step.

Owns the module users train (``module.py``), adopting the DDP model's options
(``ddp.py``), the bucketed all-reduce (``reducer.py``, ``bucket.py``), collectives with
public APIs (``collectives.py``), link and compute measurement for ``bucket_cap_mb="auto"``
(``measure.py``), checkpoints (``checkpoint.py``) and process exit (``shutdown.py``: models
left open are closed, communication threads finish before finalization). May import ``compile``, ``capture``,
``planning`` and the leaves. It never imports ``telemetry`` (TensorBoard, matplotlib):
telemetry observes it through ``reducer.StepObserver``.
"""
