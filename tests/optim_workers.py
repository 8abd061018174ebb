"""Rank functions of tests/runtime/test_attached_optimizer.py: ``model.attach_optimizer(opt)``
against the plain loop (``backward(); opt.step()``), on eager DDP and on distcompile."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from tests.models import BUILDERS, batch, loss_fn

CAP_MB = 0.05  # the test GPT in 5+ buckets


def _optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=name == "adamw_foreach")


def _models(name: str) -> tuple[torch.nn.Module, ...]:
    torch.manual_seed(0)
    base = BUILDERS[name]()
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    plain = distcompile.wrap(DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB), backend="aot_eager")
    ours = distcompile.wrap(DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB), backend="aot_eager")
    return eager, plain, ours


def _batch(name: str, rank: int, step: int, micro: int) -> tuple:
    return batch(name, rank, 10 * step + micro)


def attached_parity(rank: int, world: int, opt_name: str, mode: str = "plain", steps: int = 4) -> dict:
    """Train eager DDP and distcompile with the plain loop and distcompile with the optimizer
    attached; the same batches, ``mode``: ``plain``, ``calls_step`` (the attached loop still
    calls opt.step()), ``no_sync`` (2 micro-batches, the first under no_sync), ``scheduler``
    (StepLR each step), ``resume`` (optimizer state saved after 2 steps, loaded into a new
    optimizer that is attached)."""
    name = "gpt"
    eager, plain, ours = _models(name)
    opts = [_optimizer(opt_name, m.parameters()) for m in (eager, plain, ours)]
    scheds = (
        [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
        if mode == "scheduler"
        else []
    )
    ours.attach_optimizer(opts[2])
    losses: list[list[float]] = []
    moved_in_backward = []
    for step in range(steps):
        if mode == "resume" and step == steps // 2:
            state = copy.deepcopy(opts[2].state_dict())
            ours.attach_optimizer(None)
            opts[2] = _optimizer(opt_name, ours.parameters())
            opts[2].load_state_dict(state)
            ours.attach_optimizer(opts[2])
        row = []
        for k, (model, opt) in enumerate(zip((eager, plain, ours), opts)):
            micros = 2 if mode == "no_sync" else 1
            for m in range(micros):
                x, y = _batch(name, rank, step, m)
                if m < micros - 1:
                    with model.no_sync():
                        loss_fn(name, model(x), y).backward()
                    continue
                loss = loss_fn(name, model(x), y)
                before = [p.detach().clone() for p in model.parameters()] if k == 2 else None
                loss.backward()
                if before is not None:
                    moved_in_backward.append(
                        sum(int(not torch.equal(a, p)) for a, p in zip(before, model.parameters()))
                    )
            if k < 2 or mode == "calls_step":
                after_backward = [p.detach().clone() for p in model.parameters()]
                opt.step()
                if k == 2:  # the attached optimizer's step() did nothing
                    assert all(torch.equal(a, p) for a, p in zip(after_backward, model.parameters()))
            opt.zero_grad()
            row.append(float(loss.detach()))
        for s in scheds:
            s.step()
        losses.append(row)
    params = [[p.detach().clone() for p in m.parameters()] for m in (eager, plain, ours)]
    flat = torch.cat([p.reshape(-1) for p in params[2]])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {
        "losses": losses,
        "params": params,
        "ranks_equal": all(torch.equal(g, gathered[0]) for g in gathered),
        "moved_in_backward": moved_in_backward,
        "nparams": len(params[2]),
        "buckets": ours.last_step.buckets,
        "lr": opts[2].param_groups[0]["lr"],
    }


class _MySGD(torch.optim.SGD):
    pass


def refusals(rank: int, world: int) -> dict:
    """What attach_optimizer refuses, with the message a user sees."""
    out: dict[str, str] = {}
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"](), bucket_cap_mb=0.01), backend="aot_eager")

    def error(fn: object) -> str:
        try:
            fn()  # type: ignore[operator]
        except distcompile.ConfigError as e:
            return str(e)
        return "no error"

    out["lbfgs"] = error(lambda: model.attach_optimizer(torch.optim.LBFGS(model.parameters())))
    out["subclass"] = error(lambda: model.attach_optimizer(_MySGD(model.parameters(), lr=0.1)))
    out["not_optimizer"] = error(lambda: model.attach_optimizer([1, 2]))
    stranger = torch.nn.Parameter(torch.zeros(3))
    out["stranger"] = error(
        lambda: model.attach_optimizer(torch.optim.SGD([*model.parameters(), stranger], lr=0.1))
    )
    vouched = _MySGD(model.parameters(), lr=0.1)
    out["vouched"] = error(lambda: model.attach_optimizer(vouched, per_parameter=True))
    x, y = batch("mlp_seq", rank, 0)
    loss_fn("mlp_seq", model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    out["clipped"] = error(vouched.step)
    out["closure"] = error(lambda: vouched.step(lambda: 0.0))
    model.attach_optimizer(None)
    out["detached_is_plain"] = str(type(vouched).step is vouched.step.__func__)
    return out
