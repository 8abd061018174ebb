"""Note [Parameters that change after wrap]

Background
    Training scripts change the model around the loop: a new classification head assigned
    after ``wrap``, ``load_state_dict(sd, assign=True)``, a meta-device model materialized
    with ``to_empty`` (torchtitan's order), layers unfrozen for progressive fine-tuning.
    TorchDynamo takes parameters as graph inputs, so a compiled graph runs with the new
    parameter objects without recompiling; but the reducer's gradient hooks and buckets sit
    on the objects that were there at ``wrap``. Left alone, the new parameters train
    without any all-reduce and the ranks drift apart, silently (DDP errors for a replaced
    head and drifts silently for unfreezing and ``assign=True``).

Algorithm
    * At ``wrap`` (and after each adoption), ``ModelWatch`` notes, by identity, every
      ``_parameters``, ``_buffers`` and ``_modules`` entry of the module tree, the number
      of entries of each of those dicts, each parameter's ``requires_grad``, and how many
      forward, forward-pre and backward hooks each module holds (TorchDynamo does not guard
      on them: a hook added after a graph was compiled would be ignored; the model is
      compiled again with it). A parameter's own hooks run in the autograd engine, outside
      the graphs, and are honoured as they are.
    * ``changed()`` compares them, at each training forward that opens a step: three
      C-level passes over lists (no Python loop per parameter). A module assigned in place
      of another, a parameter registered, replaced (``assign=True``, ``to_empty``, ``_apply``
      under ``torch.__future__`` settings) or removed, a buffer replaced, and a flag
      flipped all show.
    * ``compare()`` then says what changed in the trainable parameters and the buffers, by
      name; a buffer the model only rebound (``self.running = 0.9 * self.running + ...`` in
      its own forward, every step: the same name, shape, dtype and device) is taken as it is,
      with nothing rebuilt or agreed: graphs read buffers as inputs, broadcast (under
      ``broadcast_buffers``) goes on with the new tensor, and without it each rank keeps its
      own, as under DDP. An evaluation forward (no gradients) that broadcasts checks the
      buffers alone first (``buffers_moved``), so that it sends the tensors the model holds.
      Until 2026-11-29 such a buffer was adopted as below at every step (0.2-0.6 s a step on
      a small model), until TorchDynamo's recompile limit left the model eager.
      Parameters stood in for by plain tensors for one call (``torch.func.functional_call``
      with tensors computed from them: only such a call can put a tensor that is not an
      ``nn.Parameter`` in a parameter's entry) are not adopted either: the call's gradients
      reach the parameters through them, and the parameters' hooks average them, as DDP's do.
      A model frozen whole (every trainable parameter), or parameters made trainable again
      that the reducer still holds (the same objects), are agreed on but not rebuilt: a GAN
      that freezes its discriminator for each generator step (StyleGAN2's loop) was rebuilt
      twice a step until TorchDynamo's recompile limit, and then raised at capture.
      Anything else, the module adopts (``runtime/module.py``: the ranks agree on it, rank 0's
      values of the new tensors are broadcast, and the reducer and the compiled graphs are
      rebuilt) or, where nothing that is synchronized changed, just notes the new state.

Notes
    Nothing is compared by value, and nothing is per step beyond ``changed()``.
    ``param.data = t`` and in-place updates keep the parameter object, its hooks and its
    bucket: nothing to adopt. A cast of the model after ``wrap`` (``.double()``, ``.half()``)
    is such a swap: averaging goes on, in the buckets made at ``wrap`` (their dtype; eager
    DDP stops averaging there: docs/ddp-parity.md).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .. import _torch_compat as compat
from .._agreement import default_store
from .._store import StoreTimeout, agree, counted
from ..errors import DesyncError

__all__ = ["ModelChange", "ModelWatch", "agree_on_change", "meta_message", "on_meta"]

_requires_grad = operator.attrgetter("requires_grad")


@dataclass(frozen=True, slots=True)
class ModelChange:
    """What changed in a model's synchronized state since the last snapshot, by name.

    Attributes:
        replaced: Trainable parameters whose name now holds another tensor.
        added: Parameters that are trainable now and were not (new, or unfrozen).
        removed: Trainable parameters that are gone or frozen now.
        buffers: Buffers added, removed or replaced.
        hooks: Modules (or parameters, by the module that holds them) whose hooks came or went:
            TorchDynamo does not see them in graphs compiled before.
        rebound: Those of ``buffers`` that hold another tensor of the same shape, dtype and device.
        stand_ins: Parameters whose entry holds a plain tensor, not an ``nn.Parameter``: put there
            for one call (``torch.func.functional_call``, ``nn.utils.stateless``), as nothing
            else can (``nn.Module`` refuses to assign a plain tensor to a parameter's name).
    """

    replaced: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()
    rebound: tuple[str, ...] = ()
    stand_ins: tuple[str, ...] = ()

    @property
    def only_stand_ins(self) -> bool:
        """Whether the parameters that changed are stand-ins for one call, and nothing but
        buffers (which such a call may pass too) changed besides: nothing to adopt.

        Example:
            >>> ModelChange(replaced=("lin.weight",), stand_ins=("lin.weight",)).only_stand_ins
            True
        """
        params = {*self.replaced, *self.removed}
        return bool(params) and params <= set(self.stand_ins) and not (self.added or self.hooks)

    @property
    def only_rebound(self) -> bool:
        """Whether the change is buffers rebound to like tensors and nothing else: nothing to adopt.

        Example:
            >>> ModelChange(buffers=("bn.mean",), rebound=("bn.mean",)).only_rebound
            True
        """
        rest = self.replaced or self.added or self.removed or self.hooks
        return bool(self.buffers) and self.buffers == self.rebound and not rest

    def __bool__(self) -> bool:
        return bool(self.replaced or self.added or self.removed or self.buffers or self.hooks)

    def describe(self, limit: int = 6) -> str:
        """One line per kind of change, naming up to ``limit`` tensors each.

        Example:
            >>> ModelChange(replaced=("head.weight", "head.bias")).describe()
            'replaced: head.weight, head.bias'
        """

        def names(xs: tuple[str, ...]) -> str:
            more = f" and {len(xs) - limit} more" if len(xs) > limit else ""
            return ", ".join(xs[:limit]) + more

        kinds = (
            ("replaced", self.replaced),
            ("newly trainable", self.added),
            ("no longer trainable", self.removed),
            ("buffers changed", self.buffers),
            ("hooks added or removed on", self.hooks),
        )
        return "; ".join(f"{kind}: {names(xs)}" for kind, xs in kinds if xs)

    @property
    def new_tensors(self) -> tuple[str, ...]:
        """The parameters and buffers whose values every rank must take from the first rank."""
        return self.replaced + self.added + self.buffers


class ModelWatch:
    """The parameters and buffers a wrapped model held when last adopted, by identity.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> watch = ModelWatch(net)
        >>> watch.changed()
        False
        >>> net[0] = nn.Linear(2, 2)
        >>> watch.changed(), watch.compare().replaced
        (True, ('0.weight', '0.bias'))
    """

    def __init__(self, module: nn.Module, *, ignored: frozenset[str] = frozenset()) -> None:
        self.module = module
        self.ignored = ignored
        self.take()

    def take(self) -> None:
        """Note the model as it is now (after an adoption, or a change with nothing to adopt)."""
        mods = list(self.module.modules())
        self._dicts = [d for m in mods for d in compat.module_dicts(m)]
        self._lens = list(map(len, self._dicts))
        self._slot_dicts = [d for d in self._dicts for _ in d]
        self._slot_keys = [k for d in self._dicts for k in d]
        # Holding the objects keeps their ids from being reused while they are compared.
        self._held = list(map(dict.get, self._slot_dicts, self._slot_keys))
        self._ids = list(map(id, self._held))
        buffer_dicts = [compat.module_dicts(m)[1] for m in mods]
        self._buffer_dicts = [d for d in buffer_dicts for _ in d]
        self._buffer_keys = [k for d in buffer_dicts for k in d]
        self._buffer_ids = list(map(id, map(dict.get, self._buffer_dicts, self._buffer_keys)))
        self._params = list(self.module.parameters())
        self._grads = list(map(_requires_grad, self._params))
        self._paths = [n for n, _ in self.module.named_modules()]
        per_module = [compat.hook_dicts(m) for m in mods]
        self._hook_dicts = [d for ds in per_module for d in ds]
        self._hook_owner = [self._paths[i] for i, ds in enumerate(per_module) for _ in ds]
        self._hooks = self._hook_counts()
        self._sized = self._dicts + self._hook_dicts  # one pass over every dict's size
        self._sizes = self._lens + self._hooks
        self.trainable = self.trainable_now()
        self.buffers = self.buffers_now()

    def changed(self) -> bool:
        """Whether any parameter, buffer, submodule or hook entry, or ``requires_grad``, changed
        (cheap: three C-level passes; 65 us on one CPU thread for a 12-block GPT's 880 dicts)."""
        return (
            list(map(len, self._sized)) != self._sizes
            or list(map(id, map(dict.get, self._slot_dicts, self._slot_keys))) != self._ids
            or list(map(_requires_grad, self._params)) != self._grads
        )

    def buffers_moved(self) -> bool:
        """Whether a buffer entry holds another tensor now (one C-level pass over the buffers alone).

        Example:
            >>> net = nn.BatchNorm1d(2); watch = ModelWatch(net)
            >>> net.running_mean = torch.ones(2); watch.buffers_moved()
            True
        """
        return list(map(id, map(dict.get, self._buffer_dicts, self._buffer_keys))) != self._buffer_ids

    def _hook_counts(self) -> list[int]:
        return list(map(len, self._hook_dicts))

    def compare(self) -> ModelChange:
        """What changed in the trainable parameters, the buffers and the modules' hooks since :meth:`take`."""
        now, before = self.trainable_now(), self.trainable
        bufs, old_bufs = self.buffers_now(), self.buffers
        owners, hooks = self._hook_owner, self._hook_counts()
        changed = tuple(
            n for n in {**old_bufs, **bufs} if old_bufs.get(n) is None or bufs.get(n) is not old_bufs[n]
        )
        return ModelChange(
            hooks=tuple(
                dict.fromkeys(o or "(the model)" for o, a, b in zip(owners, hooks, self._hooks) if a != b)
            ),
            replaced=tuple(n for n, p in now.items() if n in before and before[n] is not p),
            added=tuple(n for n in now if n not in before),
            removed=tuple(n for n in before if n not in now),
            buffers=changed,
            rebound=tuple(n for n in changed if n in bufs and n in old_bufs and _alike(bufs[n], old_bufs[n])),
            stand_ins=tuple(n for n, p in self.module.named_parameters() if not isinstance(p, nn.Parameter)),
        )

    def trainable_now(self) -> dict[str, nn.Parameter]:
        """The trainable parameters the model holds now (``requires_grad``, not ignored), by name."""
        return {n: p for n, p in self.module.named_parameters() if p.requires_grad and n not in self.ignored}

    def buffers_now(self) -> dict[str, torch.Tensor]:
        """The buffers the model holds now (not ignored), by name."""
        return {n: b for n, b in self.module.named_buffers() if n not in self.ignored}


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def on_meta(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors still on the meta device (not materialized).

    Example:
        >>> on_meta({"w": torch.empty(2, device="meta"), "b": torch.zeros(2)})
        ['w']
    """
    return [n for n, t in tensors.items() if t.is_meta]


def meta_message(names: list[str]) -> str:
    """The error for a model whose parameters or buffers are still on the meta device."""
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return (
        f"the model holds tensors on the meta device ({', '.join(names[:4])}{more}): they have no values "
        "to train or synchronize. Materialize them before the first forward, on every rank, e.g. "
        "model.module.to_empty(device='cpu') (or 'cuda') and then your initialization (torchtitan's "
        "order); distcompile then takes the first rank's values at the first training step "
        "(docs/ddp-parity.md, 'Around the training loop')."
    )


def agree_on_change(
    change: ModelChange,
    watch: ModelWatch,
    *,
    store_prefix: str,
    life: int,
    rank: int,
    ranks: list[int],
    timeout_s: float,
) -> None:
    """Raise :class:`DesyncError` unless every rank made the same change (the same trainable
    parameters and buffers, names, shapes and dtypes, now). Four store operations a rank, the
    text sent only to explain a difference (``_store.agree``).

    Example:
        >>> # agree_on_change(change, watch, store_prefix=p, life=1, rank=0, ranks=[0, 1], timeout_s=60)
    """
    lines = [f"change: {change.describe(limit=1000)}"]
    lines += [f"param {n} {tuple(p.shape)} {p.dtype}" for n, p in watch.trainable_now().items()]
    lines += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in watch.buffers_now().items()]
    summary = "\n".join(lines)
    try:
        verdict = agree(
            counted(default_store(), "agreement"),
            f"{store_prefix}/adopt{life}",
            summary,
            rank=rank,
            ranks=ranks,
            timeout_s=timeout_s,
        )
    except StoreTimeout as exc:
        raise DesyncError(
            f"rank {rank}: the model's parameters changed since wrap ({change.describe()}), but rank(s) "
            f"{exc.missing} did not report a change within {timeout_s:.0f} s (desync_timeout_s): they train "
            "the model as it was. Every rank must make the same change (assign the new module, unfreeze, "
            "load_state_dict(assign=True), to_empty) before the same training step."
        ) from exc
    if not verdict.same:
        other = next((r for r in verdict.texts if r != rank), verdict.first)
        theirs = verdict.texts.get(other, "").splitlines()
        mine = summary.splitlines()
        diff = [f"rank {rank}: {a}" for a in mine if a not in theirs][:8]
        diff += [f"rank {other}: {b}" for b in theirs if b not in mine][:8]
        raise DesyncError(
            f"rank {rank}: the model's parameters changed since wrap, differently on rank {rank} and rank "
            f"{other}; training on would all-reduce mismatched gradients. Every rank must make the same "
            "change before the same training step. Differences:\n  " + "\n  ".join(diff)
        )
