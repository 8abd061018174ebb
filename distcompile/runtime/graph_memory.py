"""Gradients that live in CUDA-graph memory (Note [Gradients in CUDA-graph memory]).

Note [Gradients in CUDA-graph memory]
-------------------------------------
Background: under ``cudagraphs=True`` each compiled segment's backward is replayed from a
CUDA graph (Inductor's cudagraph trees), and its outputs, the gradients, are tensors in the
graph's private memory pool. When a parameter has no ``.grad``, autograd's AccumulateGrad
does not copy the incoming gradient: it installs that very tensor as ``.grad``. The next
replay of the same backward writes its new gradients into the same memory, so a ``.grad``
kept across backwards (``no_sync()`` accumulation, ``zero_grad(set_to_none=False)``) is
overwritten before it is added to: measured on an H100 (torch 2.11), a BatchNorm model
with one ``no_sync`` micro-step trained 0.03 away from eager DDP in the loss two steps later.
Plain ``torch.compile(mode="reduce-overhead")`` has the same fault (pytorch#169545, and the
accumulation report in pytorch#96693).

Algorithm: a gradient distcompile leaves in ``.grad`` is never graph memory. A
synchronized step's write-back assigns a fresh tensor (one copy, as the in-place copy it
replaces) unless ``.grad`` is already one of ours; a backward outside a synchronized step
(``no_sync``) replaces a ``.grad`` that is not ours by a copy, once per accumulation
(later micro-steps add into that copy in place). Ours are marked with an attribute; only
under ``cudagraphs=True`` is any of this done.
"""

from __future__ import annotations

import torch

__all__ = ["is_owned", "own", "take_ownership"]

_MARK = "_distcompile_owned_grad"


def own(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a gradient tensor distcompile allocated (not graph memory); return it.

    Example:
        >>> is_owned(own(torch.zeros(2)))
        True
    """
    setattr(t, _MARK, True)
    return t


def is_owned(t: torch.Tensor) -> bool:
    """Whether ``own`` marked ``t``.

    Example:
        >>> is_owned(torch.zeros(2))
        False
    """
    return getattr(t, _MARK, False)


def take_ownership(param: torch.Tensor) -> None:
    """Replace ``param.grad`` by a copy of ours unless it is ours already (or absent).

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = g = torch.ones(2)
        >>> take_ownership(p); p.grad is not g and is_owned(p.grad)
        True
    """
    grad = param.grad
    if grad is not None and not is_owned(grad):
        param.grad = own(grad.clone())
