"""Which torch releases distcompile was tested on, and the error for a missing internal."""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from ..errors import UnsupportedTorchError

__all__ = ["TESTED_RANGE", "torch_version", "unsupported", "warn_if_untested"]

log = logging.getLogger(__name__)

#: Oldest and newest torch (major.minor) the whole suite passed on; see docs/torch-versions.md.
TESTED_RANGE = ((2, 11), (2, 15))


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor).

    Example:
        >>> torch_version() >= (2, 0)
        True
    """
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _range_text() -> str:
    (a, b), (c, d) = TESTED_RANGE
    return f"{a}.{b} to {c}.{d}"


@functools.cache
def warn_if_untested() -> bool:
    """Warn once if the installed torch is outside :data:`TESTED_RANGE`; return whether it is inside.

    Example:
        >>> isinstance(warn_if_untested(), bool)
        True
    """
    inside = TESTED_RANGE[0] <= torch_version() <= TESTED_RANGE[1]
    if not inside:
        warnings.warn(
            f"distcompile was tested with torch {_range_text()}, but torch {torch.__version__} is "
            "installed. It may work; where an internal it relies on moved, it raises "
            "UnsupportedTorchError. Install a tested torch (pip install 'torch>=2.11,<2.16').",
            stacklevel=3,
        )
    return inside


def unsupported(what: str, exc: BaseException) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"torch {torch.__version__} does not provide {what} ({type(exc).__name__}: {exc}); distcompile "
        f"was tested with torch {_range_text()}. Install a tested torch release, or report the "
        "version so the compat seam (distcompile/_torch_compat/) learns it."
    )
