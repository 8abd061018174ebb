"""An embedding table's gradient reduced by the rows looked up (Note [Shared weights reduced by use]).

Note [Rows gathered, not agreed]
    The gradient an ``nn.Embedding`` lookup gives its table is zero outside the rows of the
    tokens seen in the step. ``RowBucket`` sends just those: each rank finds the rows it
    touched, compacts them on the device with their indices, and one all-gather gives every
    rank every rank's rows; each adds them into ``.grad`` itself. Rows no rank touched are
    zero everywhere, so the sum, taken ``1/world`` each, is the average gradient. Any
    earlier accumulation (``no_sync``) or a use not split off makes more rows nonzero, and
    the bucket sends what is there (whole, when the step began with a ``.grad`` or when
    rows do not fit: below).

    * No host read, no blocking collective: what each rank sends has a size fixed when the
      buckets are built, the *bound*: the indices the step's graphs look up in the table on
      each rank (known at capture, from the lookups' shapes), which no rank's touched rows
      can exceed. The ranks agree on it with the bucket layout (``layout.py``); the rows
      are compacted to it with ``nonzero_static`` (the padding points at the last row and
      carries zeros). Until 2026-11-29 the ranks first all-reduced which rows each touched
      and then all-reduced the union: two collectives, the first one waited for on the
      host, for as many bytes on the wire as the one all-gather sends twice.
    * The same sum on every rank: the gathered buffer is the same bytes everywhere and
      the rows are added in one deterministic order, ``index_add_`` on CPU (a sequential
      loop) and ``index_put_(accumulate=True)`` elsewhere (sorted indices on CUDA, where
      ``index_add_`` adds duplicates with atomics, in an order that can differ by rank).
    * Rows past the bound: a use of the table outside the graphs' lookups (a penalty on the
      weight in the training loop, a part not handed over) gives more rows a gradient than
      the bound holds. Each rank sends its count of touched rows with them; once the
      all-gather is waited for (by every rank, one that joined under ``Join`` included) the
      ranks read the gathered counts (on the CPU at every step: plain memory; on a GPU in
      the first ``PROBED_WRITES``, where reading waits for the device) and, if any count is
      over the bound, all-reduce the whole table at once and from then on, with a warning.
      On a GPU a use outside the graphs that starts after those writes is not seen: its rows
      past the bound would be left out (``split_shared=False`` sends the table whole).
    * A table whose bound, over all ranks, is not under ``ROWS_WHEN_BELOW`` of its rows,
      or is not known (a symbolic size, under dynamic shapes), or whose ``.grad`` held a
      gradient when the step began, goes whole, all-reduced as a ``FlatBucket`` would be;
      so does a positional table, whose rows are all used. Whether a rank that produced no
      gradient itself gets one (``.grad`` created) is the one decision left to the host; it
      is read only then, as flat buckets do.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

from .. import _torch_compat as compat
from .bucket import WIRE_DTYPES, OneParamBucket

__all__ = ["DENSE_FOR", "PROBED_WRITES", "ROWS_MIN_BYTES", "ROWS_WHEN_BELOW", "RowBucket"]

log = logging.getLogger(__name__)

#: Tables whose rows did not fit, already said (a table with parts is tried by rows again
#: every ``DENSE_FOR`` steps, on a bucket built anew).
#: By id: the entry goes with the table, so an id reused later is not taken for it.
_WARNED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

#: Reduce rows rather than the whole table when they are at most this share of its rows.
ROWS_WHEN_BELOW = 0.75
#: Smaller tables go in the ordinary buckets: finding, packing, gathering and adding back the
#: touched rows is about twenty small operations a step (0.5 ms of host time on the CPU proxy
#: of ``distcompile bench --host-overhead``, a kernel launch each on a GPU), more than a small
#: table's bytes cost on the wire.
ROWS_MIN_BYTES = 256 * 1024
#: Steps of a row bucket whose counts of touched rows are read on the host (and waited for)
#: on a device other than the CPU; the CPU reads them at every step, at no cost (Note [Rows
#: gathered, not agreed]).
PROBED_WRITES = 2
#: After a step that reduced a table with parts whole, this many more do so without its
#: parts (they would only send its bytes twice; ``parts.settle``).
DENSE_FOR = 100


def _touched_rows(grad: torch.Tensor) -> torch.Tensor:
    """Which rows of a 2-D gradient hold a nonzero (NaN included): a bool per row.

    On CPU the rows' absolute values are summed by a matrix-vector product and the sums
    tested instead of ``ne(0).any(dim=1)``: the same answer (a sum of non-negative values
    is zero only when each is; an Inf or NaN stays nonzero), where a reduction over short
    rows is the CPU's slow case (one thread, 8,192 x 8 fp32: 49 us against 128 us for
    ``abs().sum(dim=1)`` and 220 us for ``ne(0).any(dim=1)``; 8,192 x 768: 4.1 against 4.2
    and 11.9 ms). On CUDA it would be one more kernel a step (not measured there): unchanged.

    Example:
        >>> _touched_rows(torch.tensor([[0.0, -1e-40], [0.0, 0.0], [float("nan"), 0.0]])).tolist()
        [True, False, True]
    """
    if grad.device.type == "cpu":
        return torch.mv(grad.abs(), grad.new_ones(grad.shape[1])).ne(0)
    return grad.ne(0).any(dim=1)


def _add_rows(grad: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``grad[index[i]] += rows[i]`` for every ``i``, duplicates added in a fixed order
    (Note [Rows gathered, not agreed])."""
    if grad.device.type == "cpu":
        grad.index_add_(0, index, rows)
    else:
        grad.index_put_((index,), rows, accumulate=True)


class _Wire:
    """What one rank sends and what the all-gather brings back: ``bound`` rows of a table in
    ``dtype``, their indices (int64) and whether the rank produced a gradient, as bytes, with
    views into each part. The same layout on every rank."""

    def __init__(self, bound: int, width: int, dtype: torch.dtype, world: int, device: torch.device) -> None:
        self.bound = bound
        at = 8 * bound  # indices, the produced flag, the count of rows touched, the rows: aligned
        rows_at, rows_end = at + 16, at + 16 + bound * width * dtype.itemsize
        size = rows_end + -rows_end % 8  # each rank's block starts aligned in the gathered buffer
        self.send = torch.zeros(size, dtype=torch.uint8, device=device)
        self.index = self.send[:at].view(torch.int64)
        self.flag = self.send[at : at + 8].view(torch.int64)
        self.count = self.send[at + 8 : rows_at].view(torch.int64)
        self.rows = self.send[rows_at:rows_end].view(dtype).view(bound, width)
        self.received = torch.zeros(world * size, dtype=torch.uint8, device=device)
        blocks = self.received.view(world, size)
        self.all_index = blocks[:, :at].view(torch.int64)  # (world, bound)
        self.all_flags = blocks[:, at : at + 8].view(torch.int64)  # (world, 1)
        self.all_counts = blocks[:, at + 8 : rows_at].view(torch.int64)  # (world, 1)
        self.all_rows = blocks[:, rows_at:rows_end].view(dtype)  # (world, bound * width)


class RowBucket(OneParamBucket):
    """One 2-D parameter reduced by the rows each rank touched (``FlatBucket``'s interface).

    ``lookups``: the indices a step looks up in it on each rank (0: not known, whole table).

    Example:
        >>> b = RowBucket(0, "emb.weight", nn.Parameter(torch.zeros(8, 2)), compression=None, lookups=1)
        >>> b.names, b.nbytes
        (['emb.weight'], 64)
    """

    def __init__(
        self, index: int, name: str, param: nn.Parameter, *, compression: str | None, lookups: int = 0
    ) -> None:
        super().__init__(index, name, param)
        self.wire_dtype = WIRE_DTYPES[compression] or param.dtype
        self.lookups = lookups
        self.gathered: _Wire | None = None  # the last step's rows, indices and flags; None: whole
        self._wires: dict[tuple[int, int], _Wire] = {}  # (rows a rank sends, world) -> its buffers
        self._flag: torch.Tensor | None = None  # > 0 when some rank produced a gradient
        self.found_dense = False  # whole tables (by bound) tell the parts to leave (parts.settle)
        # .grad held a gradient before the step (accumulated under no_sync, or zeros left by
        # zero_grad(set_to_none=False)): its rows are not bounded by the step's lookups.
        self.accumulated = False
        # Some rank touched more rows than the bound (a use outside the graphs' lookups): whole.
        self.overflowed = False
        self._probes = PROBED_WRITES
        self._sent: torch.Tensor | None = None
        self._group: dist.ProcessGroup | None = None
        self._scale = 1.0

    def bound(self, world: int) -> int | None:
        """Rows one rank sends, or ``None``: the whole table (its rows, over all ranks, would not
        be under ``ROWS_WHEN_BELOW`` of the table's, or are not known)."""
        n = self.params[0].shape[0]
        rows = min(n, self.lookups)
        whole = not self.lookups or self.accumulated or self.overflowed
        return rows if not whole and world * rows <= ROWS_WHEN_BELOW * n else None

    @property
    def nbytes(self) -> int:
        """Bytes this rank sent in the last reduction (its rows with their indices, or the table)."""
        p, sent = self.params[0], self._sent
        if sent is None:
            return p.numel() * self.wire_dtype.itemsize
        return sent.numel() * sent.element_size()

    @property
    def collective(self) -> str:
        """The collective of the last reduction, for error messages."""
        return "all-reduce" if self.gathered is None else "all-gather"

    @property
    def wire(self) -> torch.Tensor:
        """What the last reduction sent, in the wire dtype: the rows this rank gathered, or the
        table (an empty tensor before any)."""
        if self.gathered is not None:
            return self.gathered.rows
        return self._sent if self._sent is not None else torch.empty(0, dtype=self.wire_dtype)

    def launch(self, group: dist.ProcessGroup | None, scale: float, **_: object) -> None:
        """Start the reduction of ``scale * grad``: an all-gather of the rows this rank touched,
        or an all-reduce of the whole table with this rank's produced flag appended."""
        p = self.params[0]
        grad = p.grad if self.ready[0] else None
        self.produced = (grad is not None,)
        self.launched_at = time.perf_counter()
        world = dist.get_world_size(group)
        bound = self.bound(world)
        self.found_dense = bound is None
        self._group, self._scale = group, scale
        if bound is None:
            self.work = compat.start_all_reduce(self._whole(grad, scale), group)
            return
        wire = self._wire(bound, world)
        self._pack(wire, grad, scale)
        self.gathered, self._sent = wire, wire.send
        self.work = compat.start_all_gather(wire.received, wire.send, group)

    def _whole(self, grad: torch.Tensor | None, scale: float) -> torch.Tensor:
        """What an all-reduce of the whole table sends: ``scale * grad``, then the produced flag
        (as a ``FlatBucket``)."""
        p = self.params[0]
        self.gathered = None
        sent = torch.zeros(p.numel() + 1, dtype=self.wire_dtype, device=p.device)
        if grad is not None:
            sent[:-1] = grad.reshape(-1) * scale
            sent[-1:].fill_(1.0)  # a fill kernel: `sent[-1] = 1.0` copies from the host
        self._flag, self._sent = sent[-1:], sent
        return sent

    def _overflowed(self, wire: _Wire) -> bool:
        """Whether some rank touched more rows than it could send (read on the host: on the CPU at
        every step, elsewhere in the first ``PROBED_WRITES``)."""
        counts = wire.all_counts
        if counts.device.type == "cpu":  # no device to wait for: the memory itself
            return bool((counts.numpy() > wire.bound).any())
        if self._probes <= 0:
            return False
        self._probes -= 1
        return bool((counts > wire.bound).any())  # waits for the all-gather: the first writes only

    def _reduce_whole_now(self) -> None:
        """Some rank's rows did not fit: reduce the whole table now (every rank saw the same counts,
        so every rank does), and from now on."""
        if id(self.params[0]) not in _WARNED:  # once a table: a table with parts tries rows again
            _WARNED[id(self.params[0])] = self.params[0]
            log.warning(
                "embedding table %r got gradients on more rows than its lookups touch (a use outside "
                "the compiled graphs, e.g. a penalty on the weight in the training loop): reduced "
                "whole from this step on (a tied table's rows are tried again every %d steps). "
                "split_shared=False reduces it whole from the start.",
                self.names[0],
                DENSE_FOR,
            )
        self.overflowed = self.found_dense = True
        p = self.params[0]
        compat.start_all_reduce(
            self._whole(p.grad if self.produced[0] else None, self._scale), self._group
        ).wait()

    def _wire(self, bound: int, world: int) -> _Wire:
        wire = self._wires.get((bound, world))
        if wire is None:
            p = self.params[0]
            wire = _Wire(bound, p.shape[1], self.wire_dtype, world, p.device)
            self._wires = {(bound, world): wire}  # one size at a time (the bound is agreed, fixed)
        return wire

    def _pack(self, wire: _Wire, grad: torch.Tensor | None, scale: float) -> None:
        """This rank's touched rows of ``scale * grad``, compacted on the device to the bound, with
        their indices (padding: the last row, with zeros) and its produced flag."""
        n = self.params[0].shape[0]
        if grad is None:
            wire.send.zero_()
            wire.index.fill_(n - 1)
            return
        touched = _touched_rows(grad)
        if grad.device.type == "cpu" or self._probes > 0:  # read after the all-gather (_overflowed)
            torch.sum(touched, dim=0, keepdim=True, dtype=torch.int64, out=wire.count)
        found = torch.nonzero_static(touched, size=wire.bound, fill_value=n).squeeze(1)
        torch.clamp(found, max=n - 1, out=wire.index)
        rows = grad.index_select(0, wire.index).mul_(found.lt(n).unsqueeze(1))
        if scale != 1.0:
            rows.mul_(scale)
        wire.rows.copy_(rows)  # and cast, under compression
        wire.flag.fill_(1)

    def done(self) -> bool:
        return self.work is not None and self.work.is_completed()

    def wait(self) -> None:
        """Wait for the reduction; a rank whose rows did not fit makes every rank, a joined one
        included (it waits, it does not write), reduce the whole table now."""
        self._take_work()
        wire = self.gathered
        if wire is not None and self._overflowed(wire):
            self._reduce_whole_now()
        elif wire is not None:
            self._flag = wire.all_flags.sum().reshape(1)

    def write(self, used: torch.Tensor | None = None) -> None:
        """``.grad`` is the average (zero outside the rows); left as it was if no rank produced one."""
        p, sent, flag = self.params[0], self._sent, self._flag
        if sent is None or flag is None:
            return
        before = None  # this rank's own .grad, kept if no rank produced a gradient
        if not self.produced[0]:
            if p.grad is None:
                if not bool(flag[0] > 0):  # creating .grad is a host decision: read, only here
                    return
                p.grad = torch.zeros_like(p)
            else:
                before = p.grad.clone()
        wire = self.gathered
        if wire is None:
            p.grad.copy_(sent[:-1].view_as(p))
        else:  # padding rows carry zeros (to the last row): adding them changes nothing
            p.grad.zero_()
            rows = wire.all_rows.reshape(-1, p.shape[1]).to(p.grad.dtype)
            _add_rows(p.grad, wire.all_index.reshape(-1), rows)
        if before is not None:
            torch.where(flag[0] > 0, p.grad, before, out=p.grad)

    def nonfinite(self) -> list[str]:
        if self._sent is None:
            return []
        sent = self._sent if self.gathered is None else self.gathered.all_rows
        return [] if bool(torch.isfinite(sent).all()) else list(self.names)
