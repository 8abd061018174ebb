"""An embedding table's gradient reduced by the rows looked up (Note [Shared weights reduced by use]).

The gradient an ``nn.Embedding`` lookup gives its table is zero outside the rows of the
tokens seen in the step. ``RowBucket`` first all-reduces which rows each rank touched (one
small vector: a count per row, plus whether the rank produced a gradient at all), then,
when the union of those rows costs fewer bytes than the whole table, all-reduces just
those rows; otherwise the whole table, as a ``FlatBucket`` would. Rows outside the union
are zero on every rank, so their average is zero: the result is exactly the average
gradient. The choice follows the union, which every rank sees the same, so the ranks
always issue the same collective. Any earlier accumulation (``no_sync``) or a use that was
not split off makes more rows nonzero, and the bucket reduces what is there.

The first all-reduce is waited for where the bucket launches (on CUDA its row count is
read on the host): this bucket is meant for the tail of backward, where the host would
wait anyway. A table whose rows are nearly all touched (a positional embedding) goes
whole, and skips the question for ``DENSE_FOR`` steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from .bucket import WIRE_DTYPES, OneParamBucket

__all__ = ["DENSE_FOR", "ROWS_MIN_BYTES", "ROWS_WHEN_BELOW", "RowBucket"]

#: Reduce rows rather than the whole table when they are at most this share of its rows.
ROWS_WHEN_BELOW = 0.75
#: Smaller tables go in the ordinary buckets: asking which rows were touched costs one
#: blocking collective, more than their bytes.
ROWS_MIN_BYTES = 256 * 1024
#: After a step that reduced the whole table, this many more do so without asking which
#: rows were touched (a positional table, whose rows are all used, pays the question once).
DENSE_FOR = 100


class RowBucket(OneParamBucket):
    """One 2-D parameter reduced by the rows any rank touched (``FlatBucket``'s interface).

    Example:
        >>> b = RowBucket(0, "emb.weight", nn.Parameter(torch.zeros(8, 2)), compression=None)
        >>> b.names, b.nbytes
        (['emb.weight'], 64)
    """

    def __init__(self, index: int, name: str, param: nn.Parameter, *, compression: str | None) -> None:
        super().__init__(index, name, param)
        self.wire_dtype = WIRE_DTYPES[compression] or param.dtype
        self.rows: torch.Tensor | None = None  # the union's row indices; None: the whole table
        self.any_produced = False
        self._dense_for = 0  # launches left that reduce the whole table without asking
        self.found_dense = False  # this launch asked, and most rows were touched
        self._sent: torch.Tensor | None = None

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

    def launch(self, group: dist.ProcessGroup | None, scale: float, **_: object) -> torch.futures.Future:
        """Start the all-reduce of ``scale * grad``: of the rows any rank touched (agreed first,
        blocking), or of the whole table with this rank's produced flag appended."""
        p = self.params[0]
        grad = p.grad if self.ready[0] else None
        self.produced = (grad is not None,)
        self.launched_at = time.perf_counter()
        self.found_dense = False
        self.rows = self._agree_rows(group, grad) if self._dense_for == 0 else None
        if self.rows is None:  # the whole table, flag last (as a FlatBucket)
            self._dense_for = max(self._dense_for - 1, 0)
            sent = torch.zeros(p.numel() + 1, dtype=self.wire_dtype, device=p.device)
            if grad is not None:
                sent[:-1] = grad.reshape(-1) * scale
                sent[-1] = 1.0
        elif grad is None or not self.rows.numel():
            sent = torch.zeros(
                (max(self.rows.numel(), 1), *p.shape[1:]), dtype=self.wire_dtype, device=p.device
            )
        else:
            sent = (grad.index_select(0, self.rows) * scale).to(self.wire_dtype)
        self._sent = sent
        self.work = dist.all_reduce(sent, group=group, async_op=True)
        return self.work.get_future()

    def _agree_rows(self, group: dist.ProcessGroup | None, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The rows some rank touched, or ``None`` when the whole table is as cheap (then the
        next ``DENSE_FOR`` launches skip this agreement: every rank decides alike)."""
        p = self.params[0]
        touched = torch.zeros(p.shape[0] + 1, dtype=torch.float32, device=p.device)
        if grad is not None:
            touched[:-1] = grad.reshape(p.shape[0], -1).ne(0).any(dim=1)
            touched[-1] = 1.0
        dist.all_reduce(touched, group=group)
        union = touched[:-1] > 0
        count = int(union.sum())  # read on the host: the same on every rank
        self.any_produced = bool(touched[-1] > 0)
        if count > ROWS_WHEN_BELOW * p.shape[0]:
            self._dense_for, self.found_dense = DENSE_FOR, True
            return None
        return union.nonzero().squeeze(1)

    def done(self) -> bool:
        return self.work is not None and self.work.is_completed()

    def wait(self) -> None:
        self._take_work()

    def write(self, used: torch.Tensor | None = None) -> None:
        """``.grad`` is the average (zero outside the rows); left as it was if no rank produced one."""
        p, sent = self.params[0], self._sent
        if sent is not None and self.rows is None:
            self.any_produced = bool(sent[-1] > 0)
        if sent is None or not self.any_produced:
            return
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if self.rows is None:
            p.grad.copy_(sent[:-1].view_as(p))
        else:
            p.grad.zero_()
            if self.rows.numel():
                p.grad.index_copy_(0, self.rows, sent.to(p.grad.dtype))

    def nonfinite(self) -> list[str]:
        sent = self._sent
        return [] if sent is None or bool(torch.isfinite(sent).all()) else list(self.names)
