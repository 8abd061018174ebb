"""DDP communication hooks on distcompile's buckets (``register_comm_hook``'s contract).

A DDP communication hook is ``hook(state, bucket) -> Future[Tensor]``: it receives a
``GradBucket`` holding the bucket's local gradients, flattened (not yet averaged), and
returns a future whose value is the reduced buffer; DDP writes that back into the
gradients. ``GradBucket`` cannot be built from Python, so the hook gets a
:class:`GradBucketView` with the same methods, over distcompile's flat bucket: DDP's own
hooks (allreduce, fp16/bf16 compression, PowerSGD and batched PowerSGD, post-local SGD,
noop) and users' hooks only call those methods. DDP's built-in allreduce, fp16 and bf16
hooks on the model's own process group are not called: the fused path does the same
arithmetic (``compression=``) without a Python callback per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..errors import ConfigError, UnsupportedModelError

__all__ = ["CommHook", "GradBucketView", "HookChain", "adopt_hook", "builtin_hook", "check_exclusive"]

#: DDP's hooks that are the fused all-reduce with a compression format (or none).
_FUSED: dict[Callable, str | None] = {
    default_hooks.allreduce_hook: None,
    default_hooks.fp16_compress_hook: "fp16",
    default_hooks.bf16_compress_hook: "bf16",
}
#: DDP's C++ built-in hooks (``_register_builtin_comm_hook``), by their logged name.
_BUILTIN = {"BuiltinCommHookType.ALLREDUCE": None, "BuiltinCommHookType.FP16_COMPRESS": "fp16"}


class GradBucketView:
    """What a communication hook receives: one distcompile bucket, as DDP's ``GradBucket``.

    ``gradients`` are the bucket's views of ``buffer``, one a parameter (a complex one's as its
    real and imaginary parts: Note [Flat buckets]).

    Example:
        >>> buf = torch.zeros(3)
        >>> b = GradBucketView(0, True, buf, [torch.nn.Parameter(torch.ones(3))], [buf.view(3)])
        >>> b.index(), b.is_last(), b.buffer().numel(), len(b.gradients())
        (0, True, 3, 1)
    """

    def __init__(
        self,
        index: int,
        is_last: bool,
        buffer: torch.Tensor,
        params: Sequence[torch.nn.Parameter],
        gradients: Sequence[torch.Tensor],
    ) -> None:
        self._index, self._is_last, self._buffer = index, is_last, buffer
        self._params, self._views = list(params), list(gradients)

    def index(self) -> int:
        """Position of the bucket in this step's launch order (0: ready first)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the step's last bucket (hooks count iterations on it)."""
        return self._is_last

    def buffer(self) -> torch.Tensor:
        """The bucket's local gradients, flattened (not averaged), in ``parameters()`` order."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer's contents with ``tensor`` (same number of elements)."""
        self._buffer.copy_(tensor.reshape(self._buffer.shape))

    def parameters(self) -> list[torch.nn.Parameter]:
        """The bucket's parameters."""
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, as a view of ``buffer()``."""
        return list(self._views)


@dataclass(frozen=True, slots=True)
class CommHook:
    """A registered communication hook and its state.

    Attributes:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.
        state: What DDP's ``register_comm_hook`` calls the hook with.
    """

    hook: Callable[[object, GradBucketView], torch.futures.Future]
    state: object

    @property
    def name(self) -> str:
        return getattr(self.hook, "__qualname__", None) or repr(self.hook)

    def run(self, bucket: GradBucketView) -> torch.futures.Future:
        """Call the hook on one bucket; its future, checked to be one."""
        fut = self.hook(self.state, bucket)
        if not (callable(getattr(fut, "wait", None)) and callable(getattr(fut, "then", None))):
            raise UnsupportedModelError(
                f"communication hook {self.name!r} returned a {type(fut).__name__}; DDP's contract is a "
                "torch.futures.Future whose value is the reduced bucket buffer (e.g. "
                "dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0]))."
            )
        return fut


def _same_group(state: object, group: dist.ProcessGroup | None) -> bool:
    # DDP's built-in hooks take their process group as the state (None: the default group).
    return state is None or state is (group or dist.group.WORLD)


def adopt_hook(
    hook: Callable, state: object, group: dist.ProcessGroup | None
) -> tuple[CommHook | None, str | None]:
    """``(hook to call, fused compression)``: DDP's allreduce/fp16/bf16 hooks on ``group`` are fused.

    Example:
        >>> adopt_hook(default_hooks.fp16_compress_hook, None, None)
        (None, 'fp16')
    """
    if not callable(hook):
        raise UnsupportedModelError(f"register_comm_hook got hook={hook!r}, which is not callable.")
    if getattr(hook, "__qualname__", "").startswith("hook_with_zero_step"):
        # ZeroRedundancyOptimizer(overlap_with_ddp=True) steps only from inside this hook and
        # reads DDP's bucket rebuilding state; on distcompile it would never step.
        raise UnsupportedModelError(
            f"communication hook {hook.__qualname__!r} (ZeRO's step inside DDP's hook) reads DDP's own "
            "bucket state and is not supported by distcompile (torch refuses it on gloo, so it was never "
            "run here). Use ZeroRedundancyOptimizer without overlap_with_ddp: it works as an ordinary optimizer."
        )
    if hook in _FUSED and _same_group(state, group):
        return None, _FUSED[hook]
    return CommHook(hook, state), None


def builtin_hook(name: str) -> str | None:
    """The fused compression of DDP's C++ built-in hook ``name`` (``BuiltinCommHookType.*``).

    Example:
        >>> builtin_hook("BuiltinCommHookType.FP16_COMPRESS")
        'fp16'
    """
    if name not in _BUILTIN:
        raise UnsupportedModelError(
            f"DDP's built-in communication hook {name!r} is not known to distcompile."
        )
    return _BUILTIN[name]


def check_exclusive(hook: CommHook | None, compression: str | None, *, fix: str, whose: str = "") -> None:
    """The hook rule: a communication hook and ``compression=`` both decide how gradients
    travel, so they do not go together (``ConfigError`` ending with ``fix``; ``whose`` before
    "communication hook", e.g. "the DDP model's ").

    Example:
        >>> check_exclusive(None, "bf16", fix="")  # the fused path compresses: fine
    """
    if hook is not None and compression is not None:
        raise ConfigError(
            f"compression={compression!r} and {whose}communication hook {hook.name!r} both decide how gradients "
            f"travel. {fix}"
        )


class HookChain:
    """The reducer's way of sending buckets: a communication hook, or the fused all-reduce with
    ``compression``; a change takes effect at the next step. Under a hook, one bucket's hook at a
    time: a hook may chain collectives from its futures' callbacks (PowerSGD does); two chains
    at once could order them differently on two ranks, or leave gloo no thread to run them
    (eager DDP with PowerSGD, 3 buckets, hung on gloo).

    Example:
        >>> chain = HookChain(None, "bf16"); chain.set(None, None); chain.adopt_pending(), chain.compression
        (True, None)
    """

    def __init__(self, hook: CommHook | None, compression: str | None) -> None:
        self.hook, self.compression = hook, compression
        self._pending: tuple[CommHook | None, str | None] | None = None
        self._last: torch.futures.Future | None = None  # the previous bucket's hook

    @property
    def fused(self) -> bool:
        """Whether buckets go by the fused all-reduce (no hook): parts and row buckets apply."""
        return self.hook is None

    @property
    def name(self) -> str:
        """The hook's name, or "" for the fused all-reduce."""
        return self.hook.name if self.hook is not None else ""

    def set(self, hook: CommHook | None, compression: str | None) -> None:
        """Send with ``hook`` (or the fused path with ``compression``) from the next step on."""
        self._pending = (hook, compression)

    def current(self) -> tuple[CommHook | None, str | None]:
        """The hook and compression of the next step (a pending change included)."""
        return self._pending if self._pending is not None else (self.hook, self.compression)

    def adopt_pending(self) -> bool:
        """At a step's start: take a hook set since; True if the way of sending changed."""
        if self._pending is None:
            return False
        (self.hook, self.compression), self._pending = self._pending, None
        return True

    def new_step(self) -> None:
        """The step's first bucket comes next: no hook to wait for."""
        self._last = None

    def for_bucket(self, bucket: object) -> CommHook | None:
        """The hook that sends ``bucket`` (dense flat buckets only), or ``None``."""
        return self.hook if getattr(bucket, "hookable", False) else None

    def launched(self, future: torch.futures.Future) -> None:
        """A bucket was launched by the hook: the next one waits for ``future``."""
        self._last = future

    def previous_done(self, bucket: object, *, wait: Callable[[Callable[[], object]], None] | None) -> bool:
        """Whether ``bucket`` may launch: no hook, or the previous bucket's hook is done (waited
        for with ``wait(previous.wait)`` when ``wait`` is given)."""
        previous = self._last
        if self.for_bucket(bucket) is None or previous is None:
            return True
        if wait is not None:
            wait(previous.wait)
        return previous.done()
