"""Small models that exercise distinct cases of the engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distcompile.models import GPT, GPTConfig


def mlp_seq() -> nn.Module:
    """nn.Sequential (DDP's own forward compiles nothing here: pytorch#140416)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)], nn.Linear(64, 8))


class ConvBN(nn.Module):
    """Convolutions with BatchNorm buffers (broadcast_buffers matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


class GraphBreak(nn.Module):
    """Two captured graphs with eager code between them, and a weight used in both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.b = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.shared = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.a(x))
        print_in_forward = h.sum().item()  # noqa: F841 - a data-dependent graph break
        torch._dynamo.graph_break()
        h = self.b(h) + self.shared(h)
        return self.out(h)


class Unused(nn.Module):
    """A branch whose parameters never get a gradient (find_unused_parameters=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        self.unused = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=64))


BUILDERS = {"mlp_seq": mlp_seq, "convbn": ConvBN, "graph_break": GraphBreak, "unused": Unused, "gpt": gpt}


def batch(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets that differ per rank and step (so averaging matters)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "gpt":
        idx = torch.randint(0, 128, (4, 16), generator=g)
        return idx, torch.roll(idx, -1, dims=1)
    if name == "convbn":
        return torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 8, generator=g)
    return torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return GPT.loss(out, target)
    return F.mse_loss(out, target)
