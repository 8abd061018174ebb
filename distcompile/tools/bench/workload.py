"""What every variant of one benchmark rank trains: the model, its data, and the rank."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _served: int = field(default=0, repr=False)

    @classmethod
    def for_rank(cls, args: argparse.Namespace) -> Workload:
        """The workload of the initialized process group's rank (``--small``: a tiny model).

        On CUDA (one rank per GPU): a GPT-2-small-sized model (111M parameters, 1024
        tokens, batch 8) under bf16 autocast with fused AdamW; on CPU a 4-layer GPT, or
        with ``--workload tied`` GPT-2 small's proportions at a size for two cores.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        cuda = getattr(args, "device", "cpu") == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if args.small:
            cfg, batch = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64), 4
        elif getattr(args, "workload", "gpt") == "tied" and not cuda:
            # Tied embedding 2.1M of 6.8M parameters (31%, GPT-2 small's share); 256 tokens a
            # step per rank, so backward lasts about as long as the all-reduce of every gradient.
            cfg, batch = GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=4, n_embd=256), 2
        elif cuda:
            cfg, batch = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), 8
        else:
            cfg, batch = GPTConfig(vocab_size=8192, block_size=128, n_layer=4, n_head=4, n_embd=256), 8
        if getattr(args, "layers", None):  # the compile-scaling mode varies depth
            cfg = dataclasses.replace(cfg, n_layer=args.layers)
        data = [synthetic_batch(cfg, batch_size=batch, step=s, rank=rank, device=device) for s in range(8)]
        nparams = sum(p.numel() for p in GPT(cfg).parameters())
        return cls(args, rank, world, cfg, batch, data, nparams, device)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on CUDA (how GPU models train); nothing on CPU."""
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else contextlib.nullcontext()

    def optimizer(self, params: object) -> torch.optim.Optimizer:
        """AdamW; the fused kernel on CUDA."""
        return torch.optim.AdamW(params, lr=1e-4, fused=True if self.cuda else None)

    def sync(self) -> None:
        """Wait for the GPU (CPU: nothing to wait for)."""
        if self.cuda:
            torch.cuda.synchronize()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch of this rank's cycle."""
        self._served += 1
        return self.data[self._served % len(self.data)]

    def shorter(self) -> None:
        """Halve every batch's sequence length (a shape change: the compiled variants recompile)."""
        half = self.cfg.block_size // 2
        self.data = [(x[:, :half].contiguous(), y[:, :half].contiguous()) for x, y in self.data]

    def fresh(self, tag: str = "plain") -> torch.nn.Module:
        """A new model with the seed-0 weights and a private forward code object named by ``tag``."""
        # With a shared code object every call evaluated every variant's guards (measured:
        # 4-5x slower steps on the small model).
        torch.manual_seed(0)
        return own_forward_code(GPT(self.cfg).to(self.device), tag)

    def say(self, *parts: object) -> None:
        """Progress, from the first rank only."""
        if self.rank == 0:
            print("[bench]", *parts, flush=True)
