"""Sparse gradients: the weight of ``nn.Embedding(sparse=True)`` (or ``EmbeddingBag``), reduced apart.

DDP decides which parameters expect a sparse gradient the same way (an embedding module
built with ``sparse=True``) and all-reduces each of them as a sparse tensor; the dense
buckets stay dense. A rank that produced no gradient sends an empty one, and a parameter
no rank produced one for keeps its ``.grad`` as it was. A communication hook sees the
dense buckets only. Gloo all-reduces sparse tensors; NCCL does not (DDP has the same limit).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from .bucket import OneParamBucket

__all__ = ["SparseBucket", "sparse_params"]


def sparse_params(module: nn.Module) -> set[int]:
    """``id`` of every parameter whose gradient is sparse (DDP's ``expect_sparse_gradient`` rule).

    Example:
        >>> emb = nn.Embedding(4, 2, sparse=True)
        >>> sparse_params(nn.Sequential(emb, nn.Linear(2, 2))) == {id(emb.weight)}
        True
    """
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }


class SparseBucket(OneParamBucket):
    """One parameter with a sparse gradient, reduced with a sparse all-reduce (``FlatBucket``'s interface)."""

    def __init__(self, index: int, name: str, param: nn.Parameter) -> None:
        super().__init__(index, name, param)
        self._sent: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        sent = self._sent
        if sent is None:
            return 0
        return sent.values().numel() * sent.element_size() + sent.indices().numel() * 8

    def launch(self, group: dist.ProcessGroup | None, scale: float, **_: object) -> None:
        """All-reduce ``scale * grad`` (an empty gradient if this rank produced none)."""
        p = self.params[0]
        produced = self.ready[0] and p.grad is not None
        self.produced = (produced,)
        # Every rank sends rows (one sparse dimension, as an embedding's gradient has).
        if produced:
            grad = p.grad if p.grad.is_sparse else p.grad.to_sparse(1)
        else:
            rows = torch.zeros(1, 0, dtype=torch.long, device=p.device)
            grad = torch.sparse_coo_tensor(rows, p.new_zeros(0, *p.shape[1:]), p.shape)
        self._sent = (grad.coalesce() * scale).coalesce()
        self.launched_at = time.perf_counter()
        self.work = dist.all_reduce(self._sent, group=group, async_op=True)

    def wait(self) -> None:
        work = self._take_work()
        self._sent = work.result()[0].coalesce()  # values()/indices() need a coalesced tensor

    def write(self, used: torch.Tensor | None = None) -> None:
        """``.grad`` is the reduced sparse gradient; left as it was if no rank produced one."""
        p, result = self.params[0], self._sent
        if result is None or (result.values().shape[0] == 0 and not self.produced[0]):
            return
        p.grad = result

    def finish(self) -> None:
        self.wait()
        self.write()

    def nonfinite(self) -> list[str]:
        sent = self._sent
        return [] if sent is None or bool(torch.isfinite(sent.values()).all()) else list(self.names)
