"""The one options object of distcompile: ``Config``, one group of options per concern (``_options.py``)."""

from __future__ import annotations

import dataclasses

from ._options import (
    BACKENDS,
    COMPRESSIONS,
    GROUPS,
    CheckOptions,
    CommunicationOptions,
    CompileOptions,
    TelemetryOptions,
    group_of,
    hint,
)
from .errors import ConfigError

__all__ = [
    "BACKENDS",
    "COMPRESSIONS",
    "CheckOptions",
    "CommunicationOptions",
    "CompileOptions",
    "Config",
    "TelemetryOptions",
]


class Config:
    """Options of :func:`distcompile.wrap`, by concern; immutable.

    Four groups, each documented where it is defined: ``compile``
    (:class:`CompileOptions`: backend, mode, fullgraph, dynamic, cudagraphs, regions,
    share_compiles, recompile), ``communication`` (:class:`CommunicationOptions`:
    bucket_cap_mb, first_bucket_cap_mb, compression, compression_scope,
    gradient_as_bucket_view, broadcast_buffers, split_shared), ``checks``
    (:class:`CheckOptions`: check_params, detect_nonfinite, verify, verify_tolerance,
    desync_timeout_s) and ``telemetry`` (:class:`TelemetryOptions`: logdir, trace_every,
    figure_every, telemetry_all_ranks). Every option may be given by name, to ``Config``
    or to ``wrap``, and read by name (``config.backend``); a group may be given whole. An
    unknown option is a ``ConfigError`` naming the option it most looks like, or the object
    it belongs to (DDP's options go to ``DDP(...)``).

    Example:
        >>> Config(backend="aot_eager", bucket_cap_mb=4).communication.bucket_cap_mb
        4
        >>> Config(compile=CompileOptions(backend="eager"), logdir="runs").backend
        'eager'
    """

    __slots__ = tuple(GROUPS)
    compile: CompileOptions
    communication: CommunicationOptions
    checks: CheckOptions
    telemetry: TelemetryOptions

    def __init__(self, **options: object) -> None:
        unknown = sorted(k for k in options if k not in GROUPS and group_of(k) is None)
        if unknown:
            hints = "; ".join(hint(name) for name in unknown)
            raise ConfigError(
                f"unknown option(s) {unknown}: {hints}. Valid options are {sorted(_all_options())}."
            )
        for group, cls in GROUPS.items():
            given = options.get(group, cls())
            if not isinstance(given, cls):
                raise ConfigError(f"{group}={given!r} must be a {cls.__name__}.")
            mine = {k: v for k, v in options.items() if group_of(k) == group}
            object.__setattr__(self, group, given.replace(**mine) if mine else given)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:  # an option read by name: config.backend
        group = group_of(name)
        if group is None:
            raise AttributeError(f"Config has no option {name!r}: {hint(name)}")
        return getattr(object.__getattribute__(self, group), name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Config is immutable: use config.replace({name}=...)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.as_groups() == other.as_groups()

    def __hash__(self) -> int:
        return hash(self.as_groups())

    def __repr__(self) -> str:
        return f"Config({', '.join(f'{g}={v!r}' for g, v in zip(GROUPS, self.as_groups()))})"

    def __reduce__(self) -> tuple:
        return (_rebuild, (dict(zip(GROUPS, self.as_groups())),))

    def as_groups(self) -> tuple:
        """The four groups, in ``GROUPS`` order."""
        return tuple(object.__getattribute__(self, g) for g in GROUPS)

    def replace(self, **changes: object) -> Config:
        """Return a copy with ``changes`` (options by name, or whole groups) applied and validated.

        Example:
            >>> Config().replace(backend="aot_eager").backend
            'aot_eager'
        """
        return Config(**{**dict(zip(GROUPS, self.as_groups())), **changes})


def _rebuild(groups: dict) -> Config:
    return Config(**groups)


def _all_options() -> set[str]:
    return {f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)}
