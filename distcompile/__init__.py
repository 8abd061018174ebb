"""distcompile: compiled data-parallel training whose gradient all-reduces overlap backward.

Example:
    >>> import distcompile
    >>> # model = distcompile.wrap(DDP(MyModel()), backend="inductor")
"""

from . import errors
from ._config import CheckOptions, CommunicationOptions, CompileOptions, Config, TelemetryOptions
from ._torch_compat import warn_if_untested as _warn_if_untested
from ._wrap import unwrap, wrap
from .compile.record import GraphRecord  # noqa: F401
from .diagnostics.doctor import DoctorReport, StageResult, doctor  # noqa: F401
from .diagnostics.explain import ExplainedGraph, Explanation, explain  # noqa: F401
from .errors import (  # noqa: F401 (importable from here, listed in errors.__all__)
    CommunicationError,
    CompileError,
    ConfigError,
    DDPAttributeError,
    DesyncError,
    DistCompileError,
    NonFiniteGradientError,
    RecompileError,
    UnsupportedModelError,
    UnsupportedTorchError,
    VerificationError,
)
from .planning.plan import Bucket, NodeInfo, Plan, plan_graph  # noqa: F401
from .runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .runtime.module import DistCompiledModule

# What a user calls or constructs. The error types live in ``distcompile.errors`` (each is
# also importable from here), and the types our functions return (``Plan``, ``GraphRecord``,
# ``Explanation``, ``DoctorReport``...) stay importable from here for annotations.
__all__ = [
    "CheckOptions",
    "CommunicationOptions",
    "CompileOptions",
    "Config",
    "DistCompiledModule",
    "TelemetryOptions",
    "doctor",
    "errors",
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
