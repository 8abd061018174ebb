"""TensorBoard scalars for compile and communication (rank 0 by default)."""

from __future__ import annotations

import logging
import os

from ._comm import StepStats

__all__ = ["ScalarWriter"]

log = logging.getLogger(__name__)


class ScalarWriter:
    """Writes ``step/*`` and ``compile/*`` scalars under ``logdir`` with TensorBoard's writer.

    Example:
        >>> # w = ScalarWriter("runs/exp1"); w.step(stats); w.close()
    """

    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(logdir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=logdir, flush_secs=10)
        self.logdir = logdir

    def step(self, stats: StepStats) -> None:
        w, n = self.writer, stats.step
        w.add_scalar("step/fwd_bwd_ms", stats.fwd_bwd_ms, n)
        w.add_scalar("step/exposed_comm_ms", stats.exposed_comm_ms, n)
        w.add_scalar("comm/buckets", stats.buckets, n)
        w.add_scalar("comm/megabytes", stats.bytes / 2**20, n)

    def graph(self, graph_id: int, compile_s: float, segments: int, buckets: int, table: str) -> None:
        self.writer.add_scalar(f"compile/graph_{graph_id}_s", compile_s, 0)
        self.writer.add_scalar("compile/graphs", graph_id + 1, 0)
        self.writer.add_text(
            f"plan/graph_{graph_id}",
            f"{segments} segments, {buckets} buckets\n\n```\n{table}\n```",
            0,
        )
        self.writer.flush()

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
