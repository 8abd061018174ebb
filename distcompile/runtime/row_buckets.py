"""An embedding table's gradient reduced by the rows looked up (Note [Shared weights reduced by use]).

The gradient an ``nn.Embedding`` lookup gives its table is zero outside the rows of the
tokens seen in the step. ``RowBucket`` first all-reduces which rows each rank touched (one
small vector: a count per row, plus whether the rank produced a gradient at all), then
all-reduces just those rows. Rows outside the union are zero on every rank, so their
average is zero: the result is exactly the average gradient. Any earlier accumulation
(``no_sync``) or a use that was not split off makes more rows nonzero, and the bucket
reduces what is there.

No host read: the rows all-reduce has a size fixed when the buckets are built, the
*bound*: the indices the step's graphs look up in the table on each rank (known at
capture, from the lookups' shapes), times the ranks, which no union can exceed. The ranks
agree on it with the bucket layout (``layout.py``), and the rows are compacted on the
device to that size (``nonzero_static``; the padding sends zeros). A table whose bound is
not under ``ROWS_WHEN_BELOW`` of its rows, or not known (a symbolic size, under dynamic
shapes), or whose ``.grad`` held a gradient when the step began (accumulated under
``no_sync``: more rows than the step looks up), goes whole, as a ``FlatBucket`` would, and never asks which rows were touched;
so does a positional table, whose rows are all used. Whether a rank that produced no
gradient itself gets one (``.grad`` created) is the one decision left to the host; it is
read only then, as flat buckets do.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from .. import _torch_compat as compat
from .bucket import WIRE_DTYPES, OneParamBucket

__all__ = ["DENSE_FOR", "ROWS_MIN_BYTES", "ROWS_WHEN_BELOW", "RowBucket"]

#: Reduce rows rather than the whole table when they are at most this share of its rows.
ROWS_WHEN_BELOW = 0.75
#: Smaller tables go in the ordinary buckets: asking which rows were touched costs one
#: blocking collective, more than their bytes.
ROWS_MIN_BYTES = 256 * 1024
#: After a step that reduced a table with parts whole, this many more do so without its
#: parts (they would only send its bytes twice; ``parts.settle``).
DENSE_FOR = 100


def _touched_rows(grad: torch.Tensor) -> torch.Tensor:
    """Which rows of a 2-D gradient hold a nonzero (NaN included): a bool per row.

    On CPU the sum of the row's absolute values is tested instead of ``ne(0).any(dim=1)``:
    the same answer (a sum of non-negative values is zero only when each is; an Inf or NaN
    stays nonzero), 2-2.8x faster there, where a reduction over short boolean rows is the
    slow case (one thread: 69-82 against 136-225 us on an 8,192 x 8 table, 4.1-5.1 against
    9.5-13.2 ms on 8,192 x 768). On CUDA it would be one more kernel a step (not measured
    there): unchanged.

    Example:
        >>> _touched_rows(torch.tensor([[0.0, -1e-40], [0.0, 0.0], [float("nan"), 0.0]])).tolist()
        [True, False, True]
    """
    if grad.device.type == "cpu":
        return grad.abs().sum(dim=1).ne(0)
    return grad.ne(0).any(dim=1)


class RowBucket(OneParamBucket):
    """One 2-D parameter reduced by the rows any rank touched (``FlatBucket``'s interface).

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
        self.rows: torch.Tensor | None = None  # the union's row indices, padded to the bound; None: whole
        self._keep: torch.Tensor | None = None  # which of ``rows`` are rows (not padding)
        self._flag: torch.Tensor | None = None  # > 0 when some rank produced a gradient
        self.found_dense = False  # whole tables (by bound) tell the parts to leave (parts.settle)
        # .grad held a gradient before the step (accumulated under no_sync, or zeros left by
        # zero_grad(set_to_none=False)): its rows are not bounded by the step's lookups.
        self.accumulated = False
        self._sent: torch.Tensor | None = None

    def bound(self, world: int) -> int | None:
        """Rows the all-reduce carries, or ``None``: the whole table."""
        n = self.params[0].shape[0]
        rows = min(n, world * self.lookups)
        return rows if self.lookups and not self.accumulated and rows <= ROWS_WHEN_BELOW * n else None

    @property
    def nbytes(self) -> int:
        """Bytes of the last reduction (the rows with the vector of rows touched, or the table)."""
        p, sent = self.params[0], self._sent
        if sent is None:
            return p.numel() * self.wire_dtype.itemsize
        return sent.numel() * sent.element_size() + (0 if self.rows is None else (p.shape[0] + 1) * 4)

    @property
    def wire(self) -> torch.Tensor:
        """What the last reduction sent (an empty tensor of the wire dtype before any)."""
        return self._sent if self._sent is not None else torch.empty(0, dtype=self.wire_dtype)

    def launch(self, group: dist.ProcessGroup | None, scale: float, **_: object) -> None:
        """Start the all-reduce of ``scale * grad``: of the rows any rank touched (agreed first,
        blocking on gloo), or of the whole table with this rank's produced flag appended."""
        p = self.params[0]
        grad = p.grad if self.ready[0] else None
        self.produced = (grad is not None,)
        self.launched_at = time.perf_counter()
        bound = self.bound(dist.get_world_size(group))
        self.found_dense = bound is None
        if bound is None:  # the whole table, flag last (as a FlatBucket)
            self.rows = None
            sent = torch.zeros(p.numel() + 1, dtype=self.wire_dtype, device=p.device)
            if grad is not None:
                sent[:-1] = grad.reshape(-1) * scale
                sent[-1:].fill_(1.0)  # a fill kernel: `sent[-1] = 1.0` copies from the host
            self._flag = sent[-1:]
        else:
            sent = self._rows_of(group, grad, bound, scale)
        self._sent = sent
        self.work = compat.start_all_reduce(sent, group)

    def _rows_of(
        self, group: dist.ProcessGroup | None, grad: torch.Tensor | None, bound: int, scale: float
    ) -> torch.Tensor:
        """``scale * grad`` on the rows some rank touched, ``bound`` of them (padding: zeros),
        compacted on the device."""
        p = self.params[0]
        touched = torch.zeros(p.shape[0] + 1, dtype=torch.float32, device=p.device)
        if grad is not None:
            touched[:-1] = _touched_rows(grad.reshape(p.shape[0], -1))
            touched[-1:].fill_(1.0)
        compat.start_all_reduce(touched, group).wait()  # blocking: the union sizes the rows sent
        self._flag = touched[-1:]
        # The counts are sums of 0s and 1s: nonzero where some rank touched the row.
        found = torch.nonzero_static(touched[:-1], size=bound, fill_value=p.shape[0]).squeeze(1)
        self._keep = (found < p.shape[0]).unsqueeze(1)
        self.rows = found.clamp(max=p.shape[0] - 1)
        if grad is None:
            return torch.zeros((bound, *p.shape[1:]), dtype=self.wire_dtype, device=p.device)
        return grad.index_select(0, self.rows).mul_(self._keep).mul_(scale).to(self.wire_dtype)

    def done(self) -> bool:
        return self.work is not None and self.work.is_completed()

    def wait(self) -> None:
        self._take_work()

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
        if self.rows is None:
            p.grad.copy_(sent[:-1].view_as(p))
        else:  # padding rows carry zeros (to the last row): adding them changes nothing
            p.grad.zero_()
            p.grad.index_add_(0, self.rows, sent.to(p.grad.dtype))
        if before is not None:
            torch.where(flag[0] > 0, p.grad, before, out=p.grad)

    def nonfinite(self) -> list[str]:
        sent = self._sent
        return [] if sent is None or bool(torch.isfinite(sent).all()) else list(self.names)
