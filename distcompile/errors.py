"""Exception types raised by distcompile, all in this module.

Every error names the value that was found, why it is a problem, and the
setting or call that fixes it. Each derives from :class:`DistCompileError`, and each is
also importable from the top level (``distcompile.ConfigError``).

Example:
    >>> from distcompile import errors
    >>> issubclass(errors.ConfigError, errors.DistCompileError) and issubclass(errors.ConfigError, ValueError)
    True
"""

from __future__ import annotations

__all__ = [
    "DistCompileError",
    "ConfigError",
    "UnsupportedModelError",
    "DesyncError",
    "RecompileError",
    "CommunicationError",
    "NonFiniteGradientError",
    "UnsupportedTorchError",
    "CompileError",
    "VerificationError",
    "DDPAttributeError",
]


class DistCompileError(RuntimeError):
    """Base class of every error distcompile raises on purpose."""


class ConfigError(DistCompileError, ValueError):
    """An option of :class:`distcompile.Config` (or of ``wrap``) is invalid."""


class UnsupportedModelError(DistCompileError, TypeError):
    """The model (or its DDP wrapper) uses something distcompile cannot honour."""


class DesyncError(DistCompileError):
    """Ranks captured different graphs or plans, or a rank did not answer in time."""


class RecompileError(DistCompileError):
    """A recompile happened after warm-up while ``recompile="error"`` forbids it."""


class CommunicationError(DistCompileError):
    """A gradient all-reduce failed, usually because another rank died or raised."""


class NonFiniteGradientError(DistCompileError):
    """A synchronized gradient holds NaN or Inf (``detect_nonfinite=True``)."""


class UnsupportedTorchError(DistCompileError):
    """The installed torch lacks an internal distcompile needs (outside the tested range)."""


class CompileError(DistCompileError):
    """Capturing, planning or compiling a graph failed inside torch; says where and what to try."""


class VerificationError(DistCompileError):
    """The compiled step differs from eager DDP's (``verify=True``): says where and by how much."""


class DDPAttributeError(UnsupportedModelError, AttributeError):
    """A DistributedDataParallel attribute distcompile does not offer (an ``AttributeError`` too,
    so that ``hasattr`` keeps working)."""
