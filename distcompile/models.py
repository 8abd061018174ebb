"""A small GPT (nanoGPT-style, tied input/output embeddings) for demos, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "synthetic_batch"]


@dataclass(kw_only=True, slots=True, frozen=True)
class GPTConfig:
    """Shape of :class:`GPT`.

    Attributes:
        vocab_size: Number of tokens.
        block_size: Longest sequence.
        n_layer: Transformer blocks.
        n_head: Attention heads per block.
        n_embd: Width of the residual stream.
    """

    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx)`` returns logits ``(batch, time, vocab)``.

    The output projection shares its weight with the token embedding, so that weight is
    read at the first and at the last operation of the forward pass.

    Example:
        >>> model = GPT(GPTConfig(n_layer=1, n_embd=32, vocab_size=64, block_size=8))
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 64])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy.

        Example:
            >>> GPT.loss(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long)).item() > 0
            True
        """
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_batch(
    cfg: GPTConfig, *, batch_size: int, step: int, rank: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable token stream (a noisy Markov chain), different for every step and rank.

    Each token is ``(7 * previous + 3 + noise) % vocab_size`` with noise in {0, 1, 2}, so a
    model can bring the loss from ``ln(vocab_size)`` down towards ``ln(3)``. Needs no
    download and is reproducible from ``(step, rank)`` alone, which is what resuming needs.

    Example:
        >>> x, y = synthetic_batch(GPTConfig(), batch_size=2, step=0, rank=0)
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([2, 64]), True)
    """
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    t = cfg.block_size + 1
    noise = torch.randint(0, 3, (batch_size, t), generator=g)
    seq = torch.empty(batch_size, t, dtype=torch.long)
    seq[:, 0] = torch.randint(0, cfg.vocab_size, (batch_size,), generator=g)
    for i in range(1, t):
        seq[:, i] = (7 * seq[:, i - 1] + 3 + noise[:, i]) % cfg.vocab_size
    seq = seq.to(device)
    return seq[:, :-1], seq[:, 1:]
