"""One flat gradient bucket: its buffer, the used flags, filling, launching and finishing.

The schedule of buckets and the algorithm are in ``reducer.py`` (Note [Bucketed all-reduce]).

Note [Flat buckets]
    * Every flat buffer ends with one flag per parameter (1 if this rank produced a
      gradient this step). After the all-reduce, a parameter no rank produced a
      gradient for keeps its ``grad`` untouched; otherwise it gets the average, with
      zeros standing in for ranks without a gradient. This is DDP's
      ``find_unused_parameters`` behaviour, always on, for one extra element per parameter.
    * No host synchronization in a steady-state step: each bucket's flags are a device
      tensor made once per pattern of produced gradients; gradients go into the bucket with
      one copy and one scale per bucket (one scale with ``gradient_as_bucket_view``); after
      the all-reduce, the flags decide on the device (``torch.where``) for a parameter this
      rank left without gradient. Only when such a parameter has no ``.grad`` at all are the
      flags read back (creating ``.grad`` is a host decision). ``work.wait()`` on NCCL makes
      the current stream wait for the all-reduce, not the host; on gloo it blocks, as it must.
    * ``gradient_as_bucket_view`` leaves ``param.grad`` as a view of the flat buffer, so
      later steps accumulate straight into the bucket and launching needs no copy.
    * A bucket of complex parameters holds their real and imaginary parts as real numbers
      (``torch.view_as_real``), as DDP's buckets do: compression casts both parts, and a
      communication hook gets a real buffer. Cast to 16 bits as complex numbers, the
      imaginary parts would be dropped.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from itertools import repeat

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from ..errors import UnsupportedModelError
from .graph_memory import is_owned, own
from .hooks import CommHook, GradBucketView

__all__ = ["WIRE_DTYPES", "FlatBucket", "OneParamBucket", "as_real"]
#: The dtype on the wire for each ``compression`` (``None``: the gradients' own).
WIRE_DTYPES = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}

_grad = operator.attrgetter("grad")


def as_real(t: torch.Tensor) -> torch.Tensor:
    """``t``; a complex ``t`` as its real and imaginary parts (a view, with a last dimension of
    2): what buckets hold, and what comparisons cast to float (a cast drops the imaginary part).

    Example:
        >>> as_real(torch.tensor([1 + 2j])).tolist()
        [[1.0, 2.0]]
    """
    return torch.view_as_real(t) if t.is_complex() else t


def _slot(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``flat`` (real elements of a bucket) shaped as ``as_real(p)``."""
    return flat.view(*p.shape, 2) if p.is_complex() else flat.view_as(p)


def _as_param(src: torch.Tensor, p: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """A slot's values as a tensor of ``p``'s dtype and shape (a view of it unless ``copy`` or
    another dtype)."""
    if p.is_complex():
        return torch.view_as_complex(src.to(p.dtype.to_real(), copy=copy))
    return src.to(p.dtype, copy=copy)


def _produced(ready: list[bool], n_ready: int, params: list[torch.nn.Parameter]) -> tuple[bool, ...]:
    """Which of ``params`` are ready with a ``.grad`` (C-level passes when all are ready: the
    steady step)."""
    has_grad = map(operator.is_not, map(_grad, params), repeat(None))
    if n_ready == len(params):
        return tuple(has_grad)
    return tuple(map(operator.and_, ready, has_grad))


def _refuse_sparse(names: list[str], params: list[torch.nn.Parameter], produced: tuple[bool, ...]) -> None:
    for name, p, r in zip(names, params, produced):
        if r and p.grad.is_sparse:
            raise UnsupportedModelError(
                f"parameter {name!r} has a sparse gradient in a dense bucket; distcompile reduces "
                "the weights of nn.Embedding(sparse=True) / nn.EmbeddingBag(sparse=True) apart, as "
                "DDP does, and no other parameter may have a sparse gradient."
            )


class FlatBucket:
    """One flat buffer of same-dtype parameters, plus one used-flag per parameter."""

    #: A communication hook sends this kind of bucket (not sparse ones).
    hookable = True
    #: How the bucket is reduced (error messages name it).
    collective = "all-reduce"

    def __init__(
        self,
        index: int,
        params: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        compression: str | None,
        grad_as_view: bool,
        fresh_grads: bool = False,
    ) -> None:
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        dtype, device = self.params[0].dtype.to_real(), self.params[0].device
        sizes = [p.numel() * (2 if p.is_complex() else 1) for p in self.params]
        self.numel = sum(sizes)
        self.offsets = []
        offset = 0
        for n in sizes:
            self.offsets.append(offset)
            offset += n
        total = self.numel + len(self.params)
        self.buffer = torch.zeros(total, dtype=dtype, device=device)
        wire = WIRE_DTYPES[compression]
        self.wire = (
            self.buffer if wire is None or wire == dtype else torch.zeros(total, dtype=wire, device=device)
        )
        self.grad_as_view = grad_as_view
        # Note [Gradients in CUDA-graph memory]: .grad tensors not made here are replaced.
        self.fresh_grads = fresh_grads
        # Each parameter's slot, shaped as as_real(param) (Note [Flat buckets]).
        slots = list(zip(self.offsets, sizes, self.params))
        self.views = [_slot(self.buffer[o : o + n], p) for o, n, p in slots]
        self.wire_views = (
            self.views if self.wire is self.buffer else [_slot(self.wire[o : o + n], p) for o, n, p in slots]
        )
        self._complex = self.params[0].is_complex()
        self.dense = self.wire[: self.numel]  # the gradients
        self.used = self.wire[self.numel :]  # the used flags, after the gradients
        self._views_and_flags = [*self.wire_views, self.used]
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.produced: tuple[bool, ...] = ()
        self._flag_cache: dict[tuple[tuple[bool, ...], float], torch.Tensor] = {}
        self._checked: tuple[bool, ...] = ()  # the last pattern checked for sparse gradients
        self.work: dist.Work | None = None
        self.future: torch.futures.Future | None = None
        self.launched_at = 0.0
        self.tail = False  # in the tail: final only when backward ends (set by build_schedule)

    def _grads(self) -> list[torch.Tensor | None]:
        """Each parameter's ``.grad`` shaped as its slot (``None`` where it has none)."""
        grads = list(map(_grad, self.params))
        return [g if g is None else as_real(g) for g in grads] if self._complex else grads

    @property
    def nbytes(self) -> int:
        return self.wire.numel() * self.wire.element_size()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.work = None
        self.future = None

    def _flags(self, produced: tuple[bool, ...], scale: float) -> torch.Tensor:
        # One device tensor per pattern of locally produced gradients (nearly always a
        # single pattern: all of them), made once: a steady-state step copies nothing from
        # the host, so on CUDA the CPU never waits for the GPU here.
        flags = self._flag_cache.get((produced, scale))
        if flags is None:
            host = torch.tensor([scale if r else 0.0 for r in produced], dtype=self.wire.dtype)
            flags = self._flag_cache[(produced, scale)] = host.to(self.wire.device)
        return flags

    def _fill(self, produced: tuple[bool, ...], scale: float, flags: torch.Tensor | None = None) -> None:
        """Write ``scale * grad`` of every produced gradient into the wire buffer (zeros elsewhere),
        and ``flags`` after them if given (in the same call where the gradients take one)."""
        dense = self.dense
        grads = self._grads()
        if all(produced):
            # Gradients are views of the bucket only under gradient_as_bucket_view.
            in_bucket = (
                [g.data_ptr() == v.data_ptr() for g, v in zip(grads, self.views)]
                if self.grad_as_view
                else [False]
            )
            if all(in_bucket):
                # Gradients live in the bucket (gradient_as_bucket_view): one scale (and cast).
                torch.mul(self.buffer[: self.numel], scale, out=dense)
                self._put_flags(flags)
                return
            if not any(in_bucket):
                # One foreach copy (and cast) of all gradients into the bucket, the flags
                # with them when given, then one scale.
                if flags is None:
                    compat.copy_all(self.wire_views, grads)
                else:
                    compat.copy_all(self._views_and_flags, [*grads, flags])
                if scale != 1.0:  # a world of one, or a hook's local gradients
                    dense.mul_(scale)
                return
        for i, g in enumerate(grads):  # mixed: per parameter
            dst = self.wire_views[i]
            if not produced[i]:
                dst.zero_()
            elif g.data_ptr() == dst.data_ptr():
                dst.mul_(scale)
            else:
                torch.mul(g, scale, out=dst)
        self._put_flags(flags)

    def _put_flags(self, flags: torch.Tensor | None) -> None:
        if flags is not None:
            self.used.copy_(flags)

    def launch(
        self,
        group: dist.ProcessGroup | None,
        scale: float,
        *,
        hook: CommHook | None = None,
        is_last: bool = False,
    ) -> None:
        """Fill the bucket and start its reduction (``completion()`` is a future of its end).

        Without ``hook``: ``scale * grad`` and the used flags, one all-reduce. With a
        communication hook: the local gradients as they are (DDP's contract: the hook
        averages), the hook called; the flags are reduced apart (``write(used=...)``).
        """
        produced = _produced(self.ready, self.n_ready, self.params)
        if produced != self._checked:  # once per pattern of produced gradients
            _refuse_sparse(self.names, self.params, produced)
            self._checked = produced
        self.produced = produced
        self.launched_at = time.perf_counter()
        if hook is not None:
            self._fill(produced, 1.0)
            self.future = hook.run(
                GradBucketView(self.index, is_last, self.buffer[: self.numel], self.params, self.views)
            )
            return
        self._fill(produced, scale, self._flags(produced, scale))
        self.work = compat.start_all_reduce(self.wire, group)

    def completion(self) -> torch.futures.Future:
        """A future that completes with the reduction launched last (made only when asked for:
        ``Work.get_future`` costs the host a few microseconds a bucket)."""
        return self.future if self.future is not None else self.work.get_future()  # type: ignore[union-attr]

    def local_flags(self) -> torch.Tensor:
        """1 for each parameter this rank produced a gradient for (reduced apart under a hook)."""
        return self._flags(self.produced, 1.0)

    def nonfinite(self) -> list[str]:
        """Names of parameters whose synchronized gradient holds NaN or Inf."""
        if bool(torch.isfinite(self.dense).all()):
            return []
        return [n for n, v in zip(self.names, self.wire_views) if not bool(torch.isfinite(v).all())]

    def done(self) -> bool:
        """Whether the reduction finished (``wait`` would not block); False under a hook."""
        return self.future is None and self.work is not None and self.work.is_completed()

    def wait(self) -> None:
        """Wait for the reduction; the reduced values are in the bucket after it."""
        if self.future is not None:
            # A hook's future: its value is the reduced buffer (DDP's contract), maybe another tensor.
            fut, self.future = self.future, None
            value = fut.wait()
            result = value[0] if isinstance(value, (list, tuple)) else value
            dense = self.buffer[: self.numel]
            if result.data_ptr() != dense.data_ptr():
                dense.copy_(result.reshape(-1))
            return
        if self.work is None:
            raise RuntimeError(f"bucket {self.index}: wait() before launch()")
        # Drop the Work at once rather than at the next step: the last step's Work would
        # otherwise live until interpreter teardown, holding this buffer and (with
        # an observer) a Python callback.
        work, self.work = self.work, None
        work.wait()  # on CUDA/NCCL: the current stream waits for the all-reduce, not the host

    def write(self, used: torch.Tensor | None = None) -> None:
        """Write each parameter's ``.grad`` from the reduced bucket; ``used[i] > 0``: some rank
        produced a gradient for parameter ``i`` (``None``: the flags the bucket sent)."""
        views = self.wire_views
        if self._write_all_at_once(views):
            return
        if used is None:
            used = self.used
        used_host: list[float] | None = None
        for i, p in enumerate(self.params):
            src = views[i]
            if not self.produced[i]:
                # This rank produced no gradient: the average (zeros standing in for this
                # rank) if another rank did, else .grad stays as it was, as in DDP.
                if p.grad is None:
                    # Whether to create a .grad is a host decision: read the flags back
                    # (only in steps where this rank left a parameter without gradient).
                    if used_host is None:
                        used_host = used.tolist()
                    if used_host[i] <= 0:
                        continue
                else:
                    src = as_real(torch.where(used[i] > 0, _as_param(src, p).to(p.grad.dtype), p.grad))
            if self.grad_as_view:
                if src is not self.views[i]:
                    self.views[i].copy_(src)
                if p.grad is None or p.grad.data_ptr() != self.views[i].data_ptr():
                    p.grad = _as_param(self.views[i], p)
            elif p.grad is None or (self.fresh_grads and not is_owned(p.grad)):
                p.grad = own(_as_param(src, p, copy=True))
            else:
                as_real(p.grad).copy_(src)

    def _write_all_at_once(self, views: list[torch.Tensor]) -> bool:
        """The common step (every gradient produced here, each ``.grad`` a tensor of its own, the
        wire in the gradients' dtype): one ``foreach`` copy for the bucket instead of one a parameter.

        (Measured on one CPU thread, 2026-11-29: making each ``.grad`` a view of a new flat
        tensor instead costs more than this copy: a view is 1.5-3 us to make, a copy in a
        ``foreach`` 0.6 us.)"""
        if self.grad_as_view or self.fresh_grads or not all(self.produced) or self.wire is not self.buffer:
            return False
        compat.copy_all(self._grads(), views)  # produced: none is None
        return True


class OneParamBucket:
    """What a bucket of one parameter reduced apart (sparse, or by rows) keeps between steps.

    Example:
        >>> b = OneParamBucket(3, "w", torch.nn.Parameter(torch.zeros(2)))
        >>> b.names, b.ready, b.tail
        (['w'], [False], False)
    """

    #: How the bucket is reduced (error messages name it; ``RowBucket`` may all-gather).
    collective = "all-reduce"

    def __init__(self, index: int, name: str, param: torch.nn.Parameter) -> None:
        self.index = index
        self.names = [name]
        self.params = [param]
        self.ready = [False]
        self.n_ready = 0
        self.produced: tuple[bool, ...] = ()
        self.work: dist.Work | None = None
        self.launched_at = 0.0
        self.tail = False  # in the tail: final only when backward ends (set by build_schedule)

    def reset(self) -> None:
        self.ready = [False]
        self.n_ready = 0
        self.work = None

    def completion(self) -> torch.futures.Future:
        """A future that completes with the reduction launched last."""
        return self.work.get_future()  # type: ignore[union-attr]

    def local_flags(self) -> torch.Tensor:
        """1 if this rank produced a gradient."""
        return torch.tensor([float(self.produced[0])], device=self.params[0].device)

    def _take_work(self) -> dist.Work:
        if self.work is None:
            raise RuntimeError(f"bucket {self.index}: wait() before launch()")
        work, self.work = self.work, None
        work.wait()
        return work
