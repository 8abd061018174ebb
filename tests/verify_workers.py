"""Rank functions of the self-check and doctor tests (module level, so that spawn can import them)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from tests.models import BUILDERS, GradWrongWhenCompiled, batch, loss_fn
from tests.workers import _seq_len


def _halve(param: torch.Tensor) -> None:
    param.data.mul_(0.5)  # what the checkpoint-under-regions bug did: backward wrote a weight


def verify_run(
    rank: int, world: int, model_name: str, backend: str, inject: str = "", steps: int = 3
) -> dict:
    """Train ``steps`` steps with verify=True; return what was checked or the error's text.

    ``inject``: ``"param"`` (a hook overwrites a parameter during backward, on rank 1 only),
    ``"grad"`` (the compiled backward scales gradients), ``"lengths"`` (sequence lengths
    16, 9, 12: two recompiles), ``"no_sync"`` (each step accumulates two micro-batches).
    """
    torch.manual_seed(0)
    net = GradWrongWhenCompiled() if inject == "grad" else BUILDERS[model_name]()
    model = distcompile.wrap(DDP(net), backend=backend, verify=True, dynamic=False)
    if inject == "param" and rank == 1:
        dict(model.module.named_parameters())["0.0.weight"].register_post_accumulate_grad_hook(_halve)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    micro = 2 if inject == "no_sync" else 1
    try:
        for step in range(steps):
            for m in range(micro):
                x, y = batch(model_name, rank, step * micro + m)
                if inject == "lengths":
                    x, y = _seq_len(x, y, (16, 9, 12)[step % 3], mark=False)
                if m < micro - 1:
                    with model.no_sync():
                        loss_fn(model_name, model(x), y).backward()
                else:
                    loss_fn(model_name, model(x), y).backward()
            opt.step()
            opt.zero_grad()
    except distcompile.VerificationError as exc:
        return {"error": str(exc), "step": step, "checked": model._check.checked}
    return {"error": None, "checked": model._check.checked, "graphs": len(model.graphs)}
