"""How far two tensors are apart, for the checks against eager DDP (complex ones included), and
how far apart rounding to 16 bits lets them be."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import _torch_compat as compat
from .bucket import as_real

__all__ = [
    "HIGHER_ORDER",
    "ROUNDED_TOLERANCE",
    "checksums",
    "inexact",
    "max_abs",
    "max_diff",
    "rounded_tolerance",
    "saved_hooks_note",
]

#: The checks' relative tolerance where the forward computes in 16 bits, by dtype. bfloat16
#: keeps 8 significant bits, float16 11: its rounding is 8x float16's. Measured (Inductor
#: against eager, the same output gradients, GPTs of 2 to 12 layers, 3 seeds each,
#: 2026-11-30): float16 gradients 0.2-0.4% apart and outputs under 0.2%; bfloat16
#: gradients 1.5-4.4% (growing with depth) and outputs 0.6-1.4%. A model trained in
#: bfloat16 failed the checks at float16's 2e-2 before.
ROUNDED_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 1e-1}


#: Why a check does not compare a step's gradients when a backward with ``create_graph=True``
#: reached the checked forward's outputs: the gradients its parameters then get include
#: derivatives of that backward (MAML's outer step through an inner update), which the eager
#: reference's first-order gradients do not.
HIGHER_ORDER = (
    "a backward with create_graph=True reached the checked forward's outputs (second derivatives, as "
    "meta-learning's outer step takes through an inner update): its gradients are not replayed eagerly"
)


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


def rounded_tolerance(dtypes: Iterable[torch.dtype]) -> float | None:
    """The checks' tolerance for a forward that computed in ``dtypes``: the largest
    ``ROUNDED_TOLERANCE`` among them, ``None`` when none is 16-bit (the caller's own).

    Example:
        >>> rounded_tolerance([torch.float32, torch.bfloat16, torch.float16]), rounded_tolerance([torch.float32])
        (0.1, None)
    """
    return max((ROUNDED_TOLERANCE[d] for d in dtypes if d in ROUNDED_TOLERANCE), default=None)


def checksums(tensors: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """One row per tensor, its sum and its sum of squares in float64 on ``device`` (a complex
    one by its real and imaginary parts; ``None``: zeros): what ranks compare to agree.

    Example:
        >>> checksums([torch.tensor([1.0, 2.0]), None], torch.device("cpu")).tolist()
        [[3.0, 5.0], [0.0, 0.0]]
    """
    rows = []
    for t in tensors:
        v = torch.zeros(1, dtype=torch.float64, device=device) if t is None else as_real(t.detach()).double()
        rows.append(torch.stack([v.sum(), v.square().sum()]).to(device))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64, device=device)


def saved_hooks_note() -> str:
    """A sentence for a check's failure when saved-tensors hooks are in effect now, else ``""``.

    A compiled backward reads each tensor it saved as it was compiled to read it; a pack and
    unpack pair that gives back another dtype, shape or strides (``t * 1`` makes a saved bool
    mask int64) makes its gradients wrong, under ``torch.compile`` too (its DDPOptimizer trains
    such a model silently wrong: torch 2.13, measured).

    Example:
        >>> saved_hooks_note()
        ''
    """
    if not compat.saved_tensors_hooks_active():
        return ""
    return (
        " Saved-tensors hooks were in effect in this forward (torch.autograd.graph.saved_tensors_hooks, "
        "save_on_cpu): a compiled backward reads each saved tensor as compiled, so a pack/unpack pair "
        "that gives back another dtype, shape or strides (t * 1 turns a saved bool mask into int64) "
        "makes its gradients wrong, under torch.compile too. Have unpack give back what pack got: the "
        "same dtype, shape and strides."
    )
