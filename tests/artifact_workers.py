"""Rank functions of tests/compile/test_transfer.py: a job checkpointed with its compiled
pieces, resumed on ranks whose compile caches are empty."""

from __future__ import annotations

import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile import _torch_compat as compat
from distcompile.models import GPT, GPTConfig, synthetic_batch
from tests.harness import distcompile_messages

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


def train_or_resume(rank: int, world: int, cache_dirs: list[str], ckpt: str, phase: str) -> dict:
    """``train``: 2 steps, then a checkpoint with the compiled pieces; ``resume``: load it
    (on ``cache_dirs[rank]``, empty) and take one step. Returns the AOTAutograd compiles,
    the loss of the step after the checkpoint, and the log."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[rank]
    lines = distcompile_messages()
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


def killed_mid_compile(rank: int, world: int, cache_dirs: list[str]) -> dict:
    """Rank 1 dies in the middle of its share of the compiles (separate folders); rank 0
    must finish compiling on its own within desync_timeout_s (5 s), then its step fails
    on the dead peer. Returns rank 0's compile log and how its step ended."""
    import time

    from distcompile.fleet import sharing

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[rank]
    if rank == 1:
        sharing.CompileSharing._compile_here = lambda *a, **k: os._exit(3)  # type: ignore[method-assign]
    lines = distcompile_messages()
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(GPT(CFG)), backend="inductor", desync_timeout_s=5)
    x, y = synthetic_batch(CFG, batch_size=2, step=0, rank=rank)
    t0 = time.monotonic()
    try:
        GPT.loss(model(x), y).backward()
        ended = "finished"
    except Exception as exc:  # noqa: BLE001 - the dead peer's all-reduce fails: expected
        ended = type(exc).__name__
    return {"log": lines, "ended": ended, "elapsed_s": time.monotonic() - t0}
