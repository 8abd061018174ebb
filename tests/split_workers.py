"""Rank functions of tests/runtime/test_split.py: a tied-embedding GPT whose shared weight is
reduced by use (Note [Shared weights reduced by use]) against eager DDP, step by step."""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile.models import GPT, GPTConfig, synthetic_batch
from tests.harness import distcompile_messages

#: 2 layers, a 2048-token vocabulary (the tied table is 63% of the parameters), 4 x 32 tokens
#: per rank: at most 256 of 2048 rows touched by 2 ranks.
CFG = GPTConfig(vocab_size=2048, block_size=32, n_layer=2, n_head=2, n_embd=64)
#: A 128-token vocabulary: 2 ranks x 4 x 32 tokens touch most rows (a dense table, 256 KiB).
DENSE = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=512)


def _ddp(base: torch.nn.Module, mode: str) -> DDP:
    return DDP(
        copy.deepcopy(base),
        bucket_cap_mb=0.1,
        gradient_as_bucket_view=mode == "grad_as_view",
        find_unused_parameters=mode.endswith("find_unused"),
    )


def split_parity(rank: int, world: int, mode: str, steps: int = 3) -> dict:
    """Eager DDP against distcompile (aot_eager) on the same batches; ``mode``: ``plain``,
    ``no_sync`` (a micro-batch accumulated first), ``grad_as_view``, ``find_unused``, ``bf16``
    (fused bf16 compression on distcompile; eager DDP in fp32: DDP's bf16 hook needs CUDA), ``off``
    (``split_shared=False``), ``verify`` (``verify=True``), ``dense`` (a table whose rows are
    mostly touched every step), ``dense_find_unused`` (the same, frozen layout), ``eager_use`` (an L2
    penalty on the tied table outside the model: every row gets a gradient), ``eager_use_retry``
    (the same, the table tried by rows again every 2 steps instead of ``DENSE_FOR``)."""
    warnings = distcompile_messages(logging.WARNING)
    if mode == "eager_use_retry":
        import distcompile.runtime.shared_weights as shared_weights

        shared_weights.DENSE_FOR = 2  # this rank's process only
    cfg = DENSE if mode.startswith("dense") else CFG
    torch.manual_seed(0)
    base = GPT(cfg)
    eager = _ddp(base, mode)
    options = {"compression": "bf16"} if mode == "bf16" else {}
    options |= {"split_shared": False} if mode == "off" else {}
    options |= {"verify": True} if mode == "verify" else {}
    ours = distcompile.wrap(_ddp(base, mode), backend="aot_eager", **options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (eager, ours)]
    grad_diff, losses, layouts = [], [], []
    for step in range(steps):
        row = []
        for model in (eager, ours):
            if mode == "no_sync":
                x, y = synthetic_batch(cfg, batch_size=4, step=100 + step, rank=rank)
                with model.no_sync():
                    GPT.loss(model(x), y).backward()
            x, y = synthetic_batch(cfg, batch_size=4, step=step, rank=rank)
            loss = GPT.loss(model(x), y)
            if mode.startswith("eager_use"):  # the table read outside the model: every row gets a gradient
                loss = loss + 1e-3 * model.module.wte.weight.square().sum()
            loss.backward()
            row.append(float(loss.detach()))
        losses.append(row)
        layouts.append([(type(b).__name__, list(b.names)) for b in ours._reducer.join.last_order or []])
        grad_diff.append(
            max(
                float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-12))
                for a, b in zip(ours.module.parameters(), eager.module.parameters())
            )
        )
        for o in opts:
            o.step()
            o.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    order = ours._reducer.join.last_order or []
    return {
        "losses": losses,
        "grad_diff": grad_diff,
        "params": [p.detach().clone() for p in ours.module.parameters()],
        "ref_params": [p.detach().clone() for p in eager.module.parameters()],
        "ranks_equal": all(torch.equal(g, gathered[0]) for g in gathered),
        "buckets": [(type(b).__name__, list(b.names), b.nbytes) for b in order],
        "split": ours.graphs[0].split.describe(),
        "wte_bytes": base.wte.weight.numel() * 4,
        "warnings": warnings,
        "layouts": layouts,
    }


def row_bucket_sums(rank: int, world: int) -> dict:
    """One ``RowBucket`` on a 64 x 3 table, on its own: each rank touches 4 rows, some touched by
    several ranks (the same rows gathered twice), the last rank none (no gradient produced).
    Returns the written ``.grad``, the expected average and what each rank sent."""
    from distcompile.runtime.row_buckets import RowBucket

    table = torch.nn.Parameter(torch.zeros(64, 3))
    bucket = RowBucket(0, "table", table, compression=None, lookups=4)
    expected = torch.zeros(64, 3)
    for r in range(world - 1):  # every rank but the last produces a gradient
        g = torch.zeros(64, 3)
        g[[1, 2 * r + 5, 40 + r, 63]] = torch.arange(12, dtype=torch.float32).reshape(4, 3) + r * 0.25
        expected += g / world
        if r == rank:
            table.grad = g
    bucket.ready[0] = table.grad is not None
    bucket.launch(None, 1.0 / world)
    bucket.wait()
    bucket.write()
    return {
        "grad": table.grad,
        "expected": expected,
        "sent": bucket.nbytes,
        "collective": bucket.collective,
        "table_bytes": table.numel() * 4,
    }


def row_bucket_overflow(rank: int, world: int) -> dict:
    """A ``RowBucket`` whose first rank touches 10 rows, over its bound of 2, while the other
    rank has joined (under ``Join`` a joined rank launches and waits, never writes): both must
    reduce the whole table, and the first rank's ``.grad`` be the exact average."""
    from distcompile.runtime.row_buckets import RowBucket

    table = torch.nn.Parameter(torch.zeros(64, 3))
    bucket = RowBucket(0, "table", table, compression=None, lookups=2)
    grad = torch.zeros(64, 3)
    grad[:10] = torch.arange(30, dtype=torch.float32).reshape(10, 3) + 1
    if rank == 0:
        table.grad = grad.clone()
    bucket.ready[0] = rank == 0
    bucket.launch(None, 1.0 / world)
    bucket.wait()
    if rank == 0:
        bucket.write()
    return {"grad": table.grad, "expected": grad / world, "overflowed": bucket.overflowed}
