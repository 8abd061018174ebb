"""How far two tensors are apart, for the checks against eager DDP (complex ones included)."""

from __future__ import annotations

import torch

from .bucket import as_real

__all__ = ["inexact", "max_abs", "max_diff"]


def inexact(t: torch.Tensor) -> bool:
    """Whether ``t`` holds floating-point values (real or complex), compared within a tolerance;
    other tensors (integers, booleans) are compared exactly.

    Example:
        >>> inexact(torch.ones(1)), inexact(torch.ones(1, dtype=torch.complex64)), inexact(torch.ones(1, dtype=torch.long))
        (True, True, False)
    """
    return t.is_floating_point() or t.is_complex()


def max_abs(t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (0 for an empty tensor).

    Example:
        >>> max_abs(torch.tensor([1.0, -3.0])), max_abs(torch.tensor([3 + 4j])), max_abs(torch.zeros(0))
        (3.0, 5.0, 0.0)
    """
    return float(t.detach().abs().max()) if t.numel() else 0.0


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between ``a`` and ``b``, in float32 (or wider); a complex pair by
    either part (a cast to a real dtype would drop the imaginary parts).

    Example:
        >>> max_diff(torch.tensor([1 + 1j]), torch.tensor([1 - 1j]))
        2.0
    """
    return max_abs(as_real(a.detach()).float() - as_real(b.detach()).float())
