"""Inductor's one-time CPU checks, run by distcompile in an order that lets ranks split them
(Note [Sharing compiles between ranks]; across folders: ``fleet/cpu_checks.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import _torch_compat as compat
from .jobs import assign

__all__ = ["cpu_check_order", "run_cpu_checks", "runs_on_cpu"]


def cpu_check_order(checks: int, npeers: int, me: int) -> list[int]:
    """The order in which peer ``me`` runs Inductor's ``checks`` one-time CPU checks: its share first.

    The peers split them as they split the compiles, the most extended instruction set
    (Inductor lists it first, and it runs the checks of the sets it extends too) counting
    most; after its share a peer runs the others' (built by then, or waits on the lock of
    the peer building one), so that every process has them all.

    Example:
        >>> cpu_check_order(4, 2, 0), cpu_check_order(4, 2, 1)
        ([0, 3, 1, 2], [1, 2, 0, 3])
    """
    owner = assign(list(range(checks, 0, -1)), npeers)
    return sorted(range(checks), key=lambda i: owner[i] != me)


def runs_on_cpu(args: Iterable[object]) -> bool:
    """Whether a compile with these inputs makes C++ kernels: CPU tensors and no others.

    Example:
        >>> runs_on_cpu([torch.zeros(1), 2]), runs_on_cpu([3])
        (True, False)
    """
    devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
    return devices == {"cpu"}


def run_cpu_checks(npeers: int = 1, me: int = 0) -> None:
    """Inductor's one-time CPU checks, peer ``me``'s share first (``cpu_check_order``).

    Run by distcompile rather than inside Inductor's first compile so that peers split
    them and a warm start loads none of their libraries again (``compat.run_cpu_isa_check``).

    Example:
        >>> run_cpu_checks()  # alone, in Inductor's order; nothing once run in this process
    """
    checks = compat.cpu_isa_checks()
    for i in cpu_check_order(len(checks), npeers, me):
        compat.run_cpu_isa_check(checks[i])
