"""Telemetry: what the runtime did, measured and written down.

It observes the runtime (implements ``runtime.stats.StepObserver`` and
``compile.backend.CompileObserver``) and never drives communication. TensorBoard and
matplotlib are the ``telemetry`` extra.

- ``timeline.py``: the step timeline and the overlap arithmetic (pure).
- ``clock.py``: clocks for timelines: host time on CPU, CUDA events on the GPU.
- ``instrument.py``: each compiled segment's forward and backward as spans.
- ``host_comm.py``: on CPU, a step's all-reduces and waits as numbers until it ends.
- ``sink.py``: TensorBoard scalars and text, the Gantt picture, when each is made.
- ``traces.py``: a rank's Chrome trace files: which steps, written whole, which kept.
- ``figure.py``: the Gantt picture of one step.
- ``report.py``: ``distcompile report``.
"""
