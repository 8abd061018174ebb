"""Telemetry: what the runtime did, measured and written down.

Owns the step timeline and overlap arithmetic (``timeline.py``), per-segment spans
(``instrument.py``), TensorBoard and Chrome-trace output (``sink.py``), the Gantt picture
(``figure.py``) and ``distcompile report`` (``report.py``). It observes the runtime
(implements ``runtime.reducer.StepObserver`` and ``compile.backend.CompileObserver``) and
never drives communication. TensorBoard and matplotlib are the ``telemetry`` extra.
"""
