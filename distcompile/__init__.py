"""distcompile: compiled data-parallel training whose gradient all-reduces overlap backward.

Example:
    >>> import distcompile
    >>> # model = distcompile.wrap(DDP(MyModel()), backend="inductor")
"""

from ._config import CheckOptions, CommunicationOptions, CompileOptions, Config, TelemetryOptions
from ._errors import (
    CommunicationError,
    CompileError,
    ConfigError,
    DesyncError,
    DistCompileError,
    NonFiniteGradientError,
    RecompileError,
    UnsupportedModelError,
    UnsupportedTorchError,
    VerificationError,
)
from ._torch_compat import warn_if_untested as _warn_if_untested
from ._wrap import unwrap, wrap
from .compile.record import GraphRecord
from .diagnostics.doctor import DoctorReport, StageResult, doctor
from .diagnostics.explain import ExplainedGraph, Explanation, explain
from .planning.plan import Bucket, NodeInfo, Plan, plan_graph
from .runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .runtime.module import DistCompiledModule

__all__ = [
    "Bucket",
    "CheckOptions",
    "CommunicationError",
    "CommunicationOptions",
    "CompileError",
    "CompileOptions",
    "Config",
    "ConfigError",
    "DesyncError",
    "DistCompileError",
    "DistCompiledModule",
    "DoctorReport",
    "ExplainedGraph",
    "Explanation",
    "GraphRecord",
    "NodeInfo",
    "NonFiniteGradientError",
    "Plan",
    "RecompileError",
    "StageResult",
    "TelemetryOptions",
    "UnsupportedModelError",
    "UnsupportedTorchError",
    "VerificationError",
    "doctor",
    "explain",
    "latest_checkpoint",
    "load_checkpoint",
    "plan_graph",
    "save_checkpoint",
    "unwrap",
    "wrap",
]

__version__ = "0.1.0"

_warn_if_untested()  # once, at import: the torch release is outside the tested range
