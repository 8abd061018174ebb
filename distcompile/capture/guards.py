"""Recompiles: TorchDynamo's failed guards, condensed for a person to read.

On a recompile TorchDynamo reports one failed guard per code version it had cached,
newest first: ``"0/6: s.step == 6  # s.step += 1  # model.py:20 in forward (HINT: ...)"``.
A value that changes on every call (a step counter kept as a Python int) fails the same
guard on every version, so the list grows by one line per recompile, each with the same
hint. Condensed, each distinct guard is said once, with the versions that failed it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..errors import RecompileError

__all__ = ["condense_guard_failures", "recompile_forbidden", "recompile_note"]

_VERSION = re.compile(r"^(?P<version>\d+/\d+): ")
#: A guarded value (``== 6``, ``expected 16``); indices and names stay, so that guards on
#: different dimensions are not taken for one.
_VALUE = re.compile(r"(==|!=|<=|>=|<|>|expected|actual)\s*-?\d+(?:\.\d+)?")


def _parts(reason: str) -> tuple[str, str]:
    match = _VERSION.match(reason)
    if match is None:
        return "", reason
    return match["version"], reason[match.end() :]


def condense_guard_failures(reasons: Sequence[str]) -> list[str]:
    """One line per distinct failed guard (guarded values aside), naming the versions that failed it.

    Example:
        >>> condense_guard_failures(["0/2: s.step == 2  # s.step += 1", "0/1: s.step == 1  # s.step += 1"])
        ['0/2: s.step == 2  # s.step += 1  [the same guard failed on 1 older version: 0/1]']
    """
    groups: dict[str, list[tuple[str, str]]] = {}
    for reason in reasons:
        version, text = _parts(reason)
        groups.setdefault(_VALUE.sub(r"\1 N", text), []).append((version, reason))
    lines = []
    for members in groups.values():
        line = members[0][1]
        older = [version or "?" for version, _ in members[1:]]
        if older:
            shown = ", ".join(older[:4]) + (", ..." if len(older) > 4 else "")
            plural = "s" if len(older) > 1 else ""
            line += f"  [the same guard failed on {len(older)} older version{plural}: {shown}]"
        lines.append(line)
    return lines


def recompile_note(reasons: Sequence[str]) -> str:
    """A one-line note of a recompile: the newest failed guard without its source and hint.

    Example:
        >>> recompile_note(["0/1: x.size()[0] == 4  # out = self.a(x)  # m.py:9 in forward"])
        ' (recompile: 0/1: x.size()[0] == 4, 1 failed guard(s))'
        >>> recompile_note([])
        ''
    """
    if not reasons:
        return ""
    return f" (recompile: {reasons[0].split('  #')[0].strip()}, {len(reasons)} failed guard(s))"


def recompile_forbidden(reasons: Sequence[str], *, rank: int, steps: int) -> RecompileError:
    """The error for a recompile after warm-up under ``recompile='error'``.

    Example:
        >>> str(recompile_forbidden(["0/0: x.size()[0] == 4"], rank=0, steps=3)).split(" because")[0]
        'rank 0: TorchDynamo is recompiling after 3 step(s)'
    """
    return RecompileError(
        f"rank {rank}: TorchDynamo is recompiling after {steps} step(s) because "
        f"guard(s) {list(reasons)!r} failed, and recompile='error' forbids recompiles after "
        "warm-up. Keep input shapes, dtypes and module flags (train/eval) constant, mark varying "
        "dimensions with torch._dynamo.mark_dynamic(x, dim) or wrap(..., dynamic=True) before "
        "the first step, or use recompile='allow'."
    )
