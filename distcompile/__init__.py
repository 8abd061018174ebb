"""distcompile: compiled data-parallel training whose gradient all-reduces overlap backward.

Example:
    >>> import distcompile
    >>> # model = distcompile.wrap(DDP(MyModel()), backend="inductor")
"""

from ._checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ._config import Config
from ._doctor import DoctorReport, StageResult, doctor
from ._errors import (
    CommunicationError,
    ConfigError,
    DesyncError,
    DistCompileError,
    NonFiniteGradientError,
    RecompileError,
    UnsupportedModelError,
)
from ._explain import ExplainedGraph, Explanation, explain
from ._planning import Bucket, NodeInfo, Plan, plan_graph
from ._wrap import DistCompiledModule, GraphRecord, wrap

__all__ = [
    "Bucket",
    "CommunicationError",
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
    "UnsupportedModelError",
    "doctor",
    "explain",
    "latest_checkpoint",
    "load_checkpoint",
    "plan_graph",
    "save_checkpoint",
    "wrap",
]

__version__ = "0.1.0"
