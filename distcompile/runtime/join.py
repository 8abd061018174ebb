"""``Join`` and uneven inputs: a rank out of data shadows the others' collectives, as DDP's join hook does.

Per synchronized step, a rank still training runs, in this order: the ``Join`` context's
all-reduce that counts the ranks still training (``Join.notify_join_context``), the
buffer broadcast (``broadcast_buffers``), an all-reduce telling joined ranks whether this
step synchronizes gradients (``no_sync``), and in backward the step's buckets. A rank that
joined repeats the same collectives with zeros (:class:`DistJoinHook`), using the buckets of
its last synchronized step, until every rank has joined; then the ranks take the
parameters (and buffers) of the last rank to join, as DDP does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from .. import _torch_compat as compat
from ..errors import CommunicationError
from .collectives import broadcast_coalesced

__all__ = ["DistJoinHook", "JoinState", "notify_join", "sync_flag", "take_last_joiner_state"]


def notify_join(joinables: Sequence[object]) -> dist.Work | None:
    """Tell an enclosing ``Join`` this rank still trains (the first joinable with a config speaks)."""
    for joinable in joinables:
        config = compat.join_config(joinable)
        if config is not None and config.enable and config.is_first_joinable:
            return Join.notify_join_context(joinable)
    return None


def join_enabled(joinables: Sequence[object]) -> bool:
    """Whether one of ``joinables`` is in an enabled ``Join`` context."""
    return any(getattr(compat.join_config(j), "enable", False) for j in joinables)


def sync_flag(syncs: bool, *, device: torch.device, group: dist.ProcessGroup | None, joined: bool) -> bool:
    """The all-reduce telling joined ranks whether this step synchronizes gradients.

    A training rank sends 1 if it synchronizes; a joined rank sends 0 and learns the answer.
    """
    flag = torch.ones(1, device=device) if syncs and not joined else torch.zeros(1, device=device)
    dist.all_reduce(flag, group=group)
    return bool(flag.item() != 0)


def take_last_joiner_state(
    tensors: Sequence[torch.Tensor], *, is_last_joiner: bool, group: dist.ProcessGroup | None
) -> None:
    """Every rank takes the parameters (and buffers) of the last rank to join, as DDP's post hook."""
    rank = dist.get_rank()
    device = tensors[0].device if tensors else torch.device("cpu")
    source = torch.tensor([rank if is_last_joiner else -1], device=device)
    dist.all_reduce(source, op=dist.ReduceOp.MAX, group=group)
    if tensors:
        broadcast_coalesced(list(tensors), src=int(source.item()), group=group)


class DistJoinHook(JoinHook):
    """What a joined rank runs per step of the others (``main_hook``) and at the end (``post_hook``).

    Example:
        >>> # Join([model]) builds it through model.join_hook(); see DistCompiledModule.join
    """

    def __init__(self, shadow: Callable[[], None], finish: Callable[[bool], None]) -> None:
        self._shadow = shadow
        self._finish = finish

    def main_hook(self) -> None:
        """Shadow one step of the ranks that still train."""
        self._shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Take the last joiner's parameters, so that every replica ends equal."""
        self._finish(is_last_joiner)


class JoinState:
    """Join's part of a step's reduction: what each gradient is divided by (the ranks still
    training), and the buckets of the last synchronized step, which a rank that joined shadows.

    Example:
        >>> state = JoinState(world_size=4); state.scale(None)
        0.25
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._last_order: list | None = None

    def scale(self, join_work: dist.Work | None) -> float:
        """1 / the ranks that have not joined (the ``Join`` context's count, when one runs)."""
        if join_work is None:
            return 1.0 / self.world_size
        join_work.wait()
        return 1.0 / max(float(join_work.result()[0].item()), 1.0)

    def remember(self, order: list) -> None:
        """The buckets of a synchronized step that ended."""
        self._last_order = order

    @property
    def last_order(self) -> list | None:
        """The last synchronized step's buckets (``None`` before the first)."""
        return self._last_order

    def to_shadow(self) -> list:
        """The buckets a joined rank all-reduces with zeros: the last synchronized step's."""
        if self._last_order is None:
            raise CommunicationError(
                f"rank {dist.get_rank()} joined before its first synchronized step, so it does not know "
                "the buckets the other ranks all-reduce and cannot take part. Give every rank at least "
                "one batch inside the Join context."
            )
        return self._last_order
