"""What every variant of one benchmark rank trains: the model, its data, and the rank."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distcompile.capture.graph import own_forward_code
from distcompile.models import GPT, GPTConfig, synthetic_batch

__all__ = ["Workload"]


@dataclass
class Workload:
    """The model configuration, a cycle of batches, and this rank's place in the group.

    Example:
        >>> # w = Workload.for_rank(args); x, y = w.next_batch(); model = w.fresh("ddp")
    """

    args: argparse.Namespace
    rank: int
    world: int
    cfg: GPTConfig
    batch: int
    data: list[tuple[torch.Tensor, torch.Tensor]]
    nparams: int
    _served: int = field(default=0, repr=False)

    @classmethod
    def for_rank(cls, args: argparse.Namespace) -> Workload:
        """The workload of the initialized process group's rank (``--small``: a tiny model)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.small:
            cfg, batch = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64), 4
        else:
            cfg, batch = GPTConfig(vocab_size=8192, block_size=128, n_layer=4, n_head=4, n_embd=256), 8
        data = [synthetic_batch(cfg, batch_size=batch, step=s, rank=rank) for s in range(8)]
        nparams = sum(p.numel() for p in GPT(cfg).parameters())
        return cls(args, rank, world, cfg, batch, data, nparams)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch of this rank's cycle."""
        self._served += 1
        return self.data[self._served % len(self.data)]

    def fresh(self, tag: str = "plain") -> torch.nn.Module:
        """A new model with the seed-0 weights and a private forward code object named by ``tag``."""
        # With a shared code object every call evaluated every variant's guards (measured:
        # 4-5x slower steps on the small model).
        torch.manual_seed(0)
        return own_forward_code(GPT(self.cfg), tag)

    def say(self, *parts: object) -> None:
        """Progress, from the first rank only."""
        if self.rank == 0:
            print("[bench]", *parts, flush=True)
