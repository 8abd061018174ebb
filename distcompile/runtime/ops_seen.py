"""What a forward did, seen from around it: whether it drew random numbers, whether it
computed in 16 bits (the first-step checks: ``forward_check.py``, ``verify.py``).

A function mode and the random number generators' states, not a dispatch mode: a dispatch
mode on the stack breaks a higher-order operator run eagerly (``torch.cond`` and
``flex_attention`` compile their body even in eager mode, and TorchDynamo refuses to do so
under a dispatch mode), and the refusal stays with the process: the same call fails later
without the mode (torch 2.13).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_compat as compat
from .checkpoint import rng_state

__all__ = ["OpsSeen", "numpy_drew", "storage_key"]

_SIXTEEN = (torch.float16, torch.bfloat16)


def numpy_drew(before: dict, after: dict) -> bool:
    """Whether NumPy's global generator moved between two ``checkpoint.rng_state()`` readings
    (MT19937: its key and position).

    Example:
        >>> import numpy as np
        >>> a = rng_state(); _ = np.random.rand(); numpy_drew(a, rng_state()), numpy_drew(a, a)
        (True, False)
    """
    old, new = before.get("numpy"), after.get("numpy")
    return old is not None and new is not None and (old[2] != new[2] or bool((old[1] != new[1]).any()))


class OpsSeen(TorchFunctionMode):
    """A context that sees what the code inside it did. ``sixteen_bit``: the 16-bit dtypes,
    float16 or bfloat16, of the tensors torch functions and tensor methods gave (an autocast
    region inside a float32 forward, half parameters; inside a higher-order operator's body,
    only its outputs are seen). ``drew`` (known at exit): the default random number generators
    moved (dropout, ``rand``; a draw from a ``torch.Generator`` of the user's is not seen);
    ``numpy_drew``: NumPy's global one did (``unreplayable``). ``written``: for the tensors
    ``watch`` holds (by storage address), a copy of each taken before its first in-place write
    (a key encoder's momentum update in forward, MoCo's).

    Example:
        >>> with OpsSeen() as seen:
        ...     _ = torch.nn.functional.dropout(torch.ones(4), 0.5)
        >>> seen.drew, seen.sixteen_bit
        (True, set())
        >>> with OpsSeen() as seen:  # a higher-order operator inside: its outputs are seen
        ...     y = torch.cond(torch.tensor(True), lambda t: t * 2, lambda t: t - 1, (torch.ones(2),))
        ...     _ = y.bfloat16()
        >>> seen.drew, seen.sixteen_bit
        (False, {torch.bfloat16})
    """

    def __init__(self, watch: dict[int, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.watch = watch or {}  # tensors by storage address: a copy of each before its first write
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.drew = False
        self.numpy_drew = False
        self.sixteen_bit: set[torch.dtype] = set()
        self._before: dict = {}

    def __enter__(self) -> OpsSeen:
        self._before = rng_state()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        after = rng_state()  # torch's generators: the CPU's, the current CUDA device's (no sync)
        self.drew = any(
            k not in self._before or not torch.equal(self._before[k], after[k])
            for k in ("torch", "cuda")
            if k in after
        )
        self.numpy_drew = numpy_drew(self._before, after)  # compiled, TorchDynamo draws those from torch's

    def unreplayable(self) -> str:
        """Why the compiled forward cannot draw the random numbers this one drew ("" if it can).

        Example:
            >>> import numpy as np
            >>> with OpsSeen() as seen:
            ...     _ = np.random.rand()
            >>> seen.unreplayable().split(",")[0]
            "the forward draws from NumPy's global generator"
        """
        if self.numpy_drew and compat.numpy_random_from_torch():
            return (
                "the forward draws from NumPy's global generator, which TorchDynamo's graphs replace with "
                "torch's (torch._dynamo.config.use_numpy_random_stream=False, its default), so the compiled "
                "forward draws other numbers (set it to True to compare: NumPy's draws then run eagerly)"
            )
        return ""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self.watch and args and _writes(func):
            self._keep(args[0])
        out = func(*args, **(kwargs or {}))
        if torch.bfloat16 not in self.sixteen_bit:  # the coarser of the two: nothing more to learn
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.sixteen_bit.update(
                t.dtype for t in outs if isinstance(t, torch.Tensor) and t.dtype in _SIXTEEN
            )
        return out

    def _keep(self, target: object) -> None:
        """A copy of each watched tensor ``target`` (or the list a ``_foreach_`` op writes) is
        about to be written in place, before its first write."""
        for t in target if isinstance(target, (list, tuple)) else (target,):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key in self.watch and key not in self.written:
                    held = self.watch[key]
                    self.written[key] = (held, held.detach().clone())


#: Tensor methods that write their tensor in place without a trailing underscore: ``p[i] = v``,
#: ``p += v`` and the other augmented assignments.
_WRITING_DUNDERS = frozenset(
    ["__setitem__"]
    + [f"__i{op}__" for op in "add sub mul matmul truediv floordiv mod pow and or xor lshift rshift".split()]
)


def _writes(func: object) -> bool:
    """Whether ``func`` writes its first argument in place (``mul_``, ``_foreach_add_``,
    ``embedding_renorm_``, ``p[i] = v``, ``p += v``).

    Example:
        >>> _writes(torch.Tensor.mul_), _writes(torch.Tensor.__iadd__), _writes(torch.Tensor.__int__)
        (True, True, False)
    """
    name = getattr(func, "__name__", "")
    return (name[-1:] == "_" and name[-2:] != "__") or name in _WRITING_DUNDERS


def storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (shared by its views and its ``.data``), or ``None`` for a
    tensor without one (``torch.func``'s wrappers, some subclasses).

    Example:
        >>> w = torch.ones(2); storage_key(w.data) == storage_key(w[1:]) == storage_key(w)
        True
    """
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None
