"""Rank functions of tests/compile/test_transfer.py: a job checkpointed with its compiled
pieces, resumed on ranks whose compile caches are empty."""

from __future__ import annotations

import logging
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile import _torch_compat as compat
from distcompile.models import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


def train_or_resume(rank: int, world: int, cache_dirs: list[str], ckpt: str, phase: str) -> dict:
    """``train``: 2 steps, then a checkpoint with the compiled pieces; ``resume``: load it
    (on ``cache_dirs[rank]``, empty) and take one step. Returns the AOTAutograd compiles,
    the loss of the step after the checkpoint, and the log."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[rank]
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("distcompile").addHandler(handler)
    logging.getLogger("distcompile").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(GPT(CFG)), backend="inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = compat.aot_autograd_counts()
    start = 0
    if phase == "resume":
        start = distcompile.load_checkpoint(ckpt, model=model, optimizer=opt, strict=True)["step"] + 1
    losses = []
    for step in range(start, 3 if phase == "train" else start + 1):
        x, y = synthetic_batch(CFG, batch_size=2, step=step, rank=rank)
        loss = GPT.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if phase == "train" and step == 1:
            distcompile.save_checkpoint(ckpt, model=model, optimizer=opt, step=step, compile_artifacts=True)
    after = compat.aot_autograd_counts()
    hits = after[1] - before[1]
    return {"compiled": after[0] - before[0] - hits, "hits": hits, "last_loss": losses[-1], "log": lines}
