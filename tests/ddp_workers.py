"""Rank functions of the DDP-parity tests (tests/runtime/test_ddp_parity.py): each DDP feature
used the same way on eager DDP and on distcompile.wrap(DDP), compared step by step."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, post_localSGD_hook, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from tests.models import BUILDERS, batch, loss_fn, step_each


def average_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses string annotations on a hook
    """A user's own hook that checks the GradBucket contract as it goes, then averages."""
    grads, params, buf = bucket.gradients(), bucket.parameters(), bucket.buffer()
    assert len(grads) == len(params) and sum(g.numel() for g in grads) == buf.numel()
    assert all(g.shape == p.shape for g, p in zip(grads, params))
    assert grads[0].data_ptr() == buf.data_ptr(), "gradients() are views of buffer()"
    state.append((bucket.index(), bucket.is_last(), len(params)))
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def summing_hook(state, bucket):  # noqa: ANN001, ANN201 - as average_hook
    """Sums instead of averaging: a hook that is ignored leaves the average, visibly different."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _hook(case: str) -> tuple[object, Callable] | None:
    if case in ("average", "average_after_wrap", "average_on_ddp", "join_hook"):
        return [], average_hook
    if case == "summing":
        return None, summing_hook
    if case == "powersgd":
        return powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=1, start_powerSGD_iter=2
        ), powerSGD_hook.powerSGD_hook
    if case == "batched_powersgd":
        return powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=1, start_powerSGD_iter=2
        ), powerSGD_hook.batched_powerSGD_hook
    if case == "noop":
        return None, debugging_hooks.noop_hook
    return None


def hook_parity(rank: int, world: int, case: str, steps: int = 5, caps: tuple = (0.02, 0.02)) -> dict:
    """Train eager DDP and distcompile with the same communication hook; losses and parameters.

    ``case``: the hook, and where it is registered on distcompile: before wrap (on the DDP
    model), ``*_after_wrap`` on the returned module, ``*_on_ddp`` on the DDP object after wrap.
    ``caps``: the bucket caps (MiB) of eager DDP and of distcompile (0.02: 3 buckets, 25: 1).
    """
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    ref, ours_ddp = (DDP(copy.deepcopy(base), bucket_cap_mb=cap) for cap in caps)
    state_ref, hook = _hook(case)
    state_ours = copy.deepcopy(state_ref)
    ref.register_comm_hook(state_ref, hook)
    if not case.endswith(("_after_wrap", "_on_ddp")):
        ours_ddp.register_comm_hook(state_ours, hook)
    ours = distcompile.wrap(ours_ddp, backend="aot_eager")
    if case.endswith("_after_wrap"):
        ours.register_comm_hook(state_ours, hook)
    elif case.endswith("_on_ddp"):
        ours_ddp.register_comm_hook(state_ours, hook)
    return _train(rank, ref, ours, steps) | {
        "calls": (state_ref, state_ours) if isinstance(state_ref, list) else None
    }


def _train(rank: int, ref: nn.Module, ours: nn.Module, steps: int, *, name: str = "mlp_seq") -> dict:
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    losses = []
    for step in range(steps):
        x, y = batch(name, rank, step)
        losses.append(step_each((ref, ours), opts, lambda model, x=x, y=y: loss_fn(name, model(x), y)))
    return {
        "losses": losses,
        "ref_params": [p.detach().clone() for p in ref.module.parameters()],
        "params": [p.detach().clone() for p in ours.module.parameters()],
    }


def post_local_sgd(rank: int, world: int, steps: int = 6) -> dict:
    """post_localSGD_hook + PeriodicModelAverager on an explicit subgroup, both sides."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    subgroup = dist.new_group([0, 1])
    models, averagers = [], []
    for wrap in (False, True):
        ddp = DDP(copy.deepcopy(base), bucket_cap_mb=0.02)
        state = post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=subgroup, start_localSGD_iter=2
        )
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        models.append(distcompile.wrap(ddp, backend="aot_eager") if wrap else ddp)
        averagers.append(PeriodicModelAverager(period=2, warmup_steps=2))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    losses = []
    for step in range(steps):
        pair = []
        for model, opt, avg in zip(models, opts, averagers):
            x, y = batch("mlp_seq", rank, step)
            loss = loss_fn("mlp_seq", model(x), y)
            loss.backward()
            opt.step()
            avg.average_parameters(model.module.parameters())  # the parameters that have gradients
            opt.zero_grad()
            pair.append(float(loss.detach()))
        losses.append(pair)
    ref, ours = models
    return {
        "losses": losses,
        "ref_params": [p.detach().clone() for p in ref.module.parameters()],
        "params": [p.detach().clone() for p in ours.module.parameters()],
    }


def join_parity(rank: int, world: int, case: str) -> dict:
    """Uneven inputs (rank r trains 3 + 2r batches) under Join, eager DDP then distcompile.

    ``case``: ``"model"`` (``Join([model])``), ``"ddp"`` (``Join([ddp])`` on the adopted DDP
    object), ``"method"`` (``model.join(divide_by_initial_world_size=False)``), ``"hook"`` (with
    a user's averaging hook registered on both).
    """
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    ref, ours_ddp = (DDP(copy.deepcopy(base), bucket_cap_mb=0.02) for _ in range(2))
    if case == "hook":
        ref.register_comm_hook([], average_hook)
        ours_ddp.register_comm_hook([], average_hook)
    ours = distcompile.wrap(ours_ddp, backend="aot_eager")
    contexts = {
        "model": lambda: (Join([ref]), Join([ours])),
        "hook": lambda: (Join([ref]), Join([ours])),
        "ddp": lambda: (Join([ref]), Join([ours_ddp])),
        "method": lambda: (
            ref.join(divide_by_initial_world_size=False),
            ours.join(divide_by_initial_world_size=False),
        ),
    }[case]()
    out: dict = {"losses": []}
    for model, ctx in zip((ref, ours), contexts):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        with ctx:
            for step in range(3 + 2 * rank):
                x, y = batch("mlp_seq", rank, step)
                loss = loss_fn("mlp_seq", model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
        out["losses"].append(losses)
    out["ref_params"] = [p.detach().clone() for p in ref.module.parameters()]
    out["params"] = [p.detach().clone() for p in ours.module.parameters()]
    return out


class _SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, sparse=True)
        self.head = nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def sparse_parity(rank: int, world: int, optimizer: str) -> dict:
    """nn.Embedding(sparse=True): SGD, or SparseAdam on the embedding and Adam on the rest."""
    torch.manual_seed(0)
    base = _SparseNet()
    ref, ours_ddp = (DDP(copy.deepcopy(base)) for _ in range(2))
    ours = distcompile.wrap(ours_ddp, backend="aot_eager")

    def opts(m: nn.Module) -> list[torch.optim.Optimizer]:
        if optimizer == "sgd":
            return [torch.optim.SGD(m.parameters(), lr=0.1)]
        inner = m.module
        return [
            torch.optim.SparseAdam([inner.emb.weight], lr=0.01),
            torch.optim.Adam(inner.head.parameters(), lr=0.01),
        ]

    pairs = [(m, opts(m)) for m in (ref, ours)]
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids, y = torch.randint(0, 50, (4, 6), generator=g), torch.randn(4, 8, generator=g)
        pair = []
        for model, model_opts in pairs:
            loss = nn.functional.mse_loss(model(ids), y)
            loss.backward()
            assert model.module.emb.weight.grad.is_sparse
            for opt in model_opts:
                opt.step()
                opt.zero_grad()
            pair.append(float(loss.detach()))
        losses.append(pair)
    return {
        "losses": losses,
        "ref_params": [p.detach().clone() for p in ref.module.parameters()],
        "params": [p.detach().clone() for p in ours.module.parameters()],
    }


def optimizer_in_backward(rank: int, world: int, when: str = "before") -> dict:
    """``_apply_optimizer_in_backward(SGD)`` against eager DDP with the same SGD after backward (the
    same arithmetic: eager DDP's own optimizer-in-backward path needs an accelerator).

    ``when``: applied before ``DDP(...)`` (as DDP supports), after ``wrap``, or after the first
    step (both sides skip the optimizer at step 0 then).
    """
    from torch.distributed.optim import _apply_optimizer_in_backward

    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.02)
    net = copy.deepcopy(base)

    def apply() -> None:
        _apply_optimizer_in_backward(torch.optim.SGD, net.parameters(), {"lr": 0.05})

    if when == "before":
        apply()
    ours = distcompile.wrap(DDP(net, bucket_cap_mb=0.02), backend="aot_eager")
    if when == "after_wrap":
        apply()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    grads_after, losses = [], []
    for step in range(4):
        x, y = batch("mlp_seq", rank, step)
        loss_ref = loss_fn("mlp_seq", ref(x), y)
        loss_ref.backward()
        if step > 0 or when != "after_first_step":
            opt.step()
        opt.zero_grad()
        loss = loss_fn("mlp_seq", ours(x), y)
        loss.backward()  # the parameters step here
        grads_after.append(all(p.grad is None for p in ours.module.parameters()))
        if step == 0 and when == "after_first_step":
            ours.zero_grad()
            apply()
        losses.append([float(loss_ref.detach()), float(loss.detach())])
    return {
        "losses": losses,
        "grads_none": grads_after[1:],
        "ref_params": [p.detach().clone() for p in ref.module.parameters()],
        "params": [p.detach().clone() for p in ours.module.parameters()],
    }


def delayed_params(rank: int, world: int) -> dict:
    """``DDP(delay_all_reduce_named_params=..., param_to_hook_all_reduce=...)``: still averaged, as
    the other parameters are (before, distcompile took them for ignored: never reduced)."""
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()

    def build() -> DDP:
        net = copy.deepcopy(base)
        named = dict(net.named_parameters())
        # DDP all-reduces the delayed ones when the hooked parameter's gradient is ready: the
        # head's are ready first in backward, the first layer's last.
        delayed = [(n, named[n]) for n in ("6.weight", "6.bias")]
        return DDP(net, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=named["0.0.weight"])

    # The reference is plain eager DDP: every parameter averaged. Eager DDP's own delayed path
    # issues the delayed all-reduce from a gradient hook, in an order that varied with load in
    # our runs (its step-2 loss moved by 5e-4 once in a full suite run).
    ref = DDP(copy.deepcopy(base))
    return _train(rank, ref, distcompile.wrap(build(), backend="aot_eager"), 4)


def ddp_surface(rank: int, world: int) -> dict:
    """What a DDP user touches on the returned module, and on the DDP object after wrap."""
    ddp = DDP(BUILDERS["mlp_seq"](), bucket_cap_mb=0.02)
    model = distcompile.wrap(ddp, backend="eager")
    out: dict = {
        "process_group": model.process_group is dist.group.WORLD,
        "device_ids": model.device_ids,
        "bucket_bytes_cap": model.bucket_bytes_cap,
        "join_device": str(model.join_device),
        "hasattr_logging": hasattr(model, "_get_ddp_logging_data"),
        "state_dict_keys": sorted(model.state_dict())[:2],
        "named": [n for n, _ in model.named_parameters()][:2],
    }
    model._set_static_graph()
    try:
        model._get_ddp_logging_data()
    except distcompile.UnsupportedModelError as exc:
        out["ddp_only"] = str(exc)
    try:
        _ = model.not_a_thing
    except AttributeError as exc:
        out["plain"] = (type(exc).__name__, str(exc))
    model.eval()
    out["eval"] = (model.training, model.module.training)
    model.train()
    model.close()
    out["restored"] = "register_comm_hook" not in vars(ddp)
    return out


def subgroup_and_ignored(rank: int, world: int) -> dict | None:
    """A DDP on ``new_group([0, 1])`` in a world of 3 (rank 2 trains nothing), with a parameter
    DDP was told to ignore (``_set_params_and_buffers_to_ignore_for_model``): it stays local."""
    sub = dist.new_group([0, 1])
    if rank == 2:
        return None
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    DDP._set_params_and_buffers_to_ignore_for_model(base, ["6.bias"])
    ref, ours_ddp = (DDP(copy.deepcopy(base), process_group=sub, bucket_cap_mb=0.02) for _ in range(2))
    return _train(rank, ref, distcompile.wrap(ours_ddp, backend="aot_eager"), 3)


def mixed_precision(rank: int, world: int) -> str:
    from torch.nn.parallel.distributed import _MixedPrecision

    try:
        ddp = DDP(BUILDERS["mlp_seq"](), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    except RuntimeError as exc:  # torch 2.15's DDP makes a CUDA stream for it: no such DDP here
        return f"DDP itself cannot: {exc}"
    try:
        distcompile.wrap(ddp)
    except distcompile.UnsupportedModelError as exc:
        return str(exc)
    return "no error"


def moe_parity(rank: int, world: int, model_name: str, backend: str, dynamic: bool | None) -> dict:
    """A routed mixture of experts, per-rank batch sizes (16 + 3 * rank tokens) and routing,
    ``find_unused_parameters=True`` on both sides."""
    torch.manual_seed(0)
    base = BUILDERS[model_name]()
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = distcompile.wrap(
        DDP(copy.deepcopy(base), find_unused_parameters=True),
        backend=backend,
        dynamic=dynamic,
        desync_timeout_s=30,
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    losses, experts_used = [], []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16 + 3 * rank, 32, generator=g), torch.randn(16 + 3 * rank, 8, generator=g)
        with torch.no_grad():  # the experts this rank routes tokens to, this step
            inner = ours.module
            experts_used.append(sorted(set(inner.router(torch.relu(inner.inp(x))).argmax(-1).tolist())))
        losses.append(
            step_each((ref, ours), opts, lambda model, x=x, y=y: nn.functional.mse_loss(model(x), y))
        )
    return {
        "losses": losses,
        "experts_used": experts_used,
        "ref_params": [p.detach().clone() for p in ref.module.parameters()],
        "params": [p.detach().clone() for p in ours.module.parameters()],
    }


def backward_twice(rank: int, world: int) -> dict:
    """``loss.backward(retain_graph=True); loss.backward()``: eager DDP synchronizes the first
    only and the second accumulates locally; distcompile must give the same gradients."""
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False  # torch's rule for retain_graph=True under compile
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    ref, ours = DDP(copy.deepcopy(base)), distcompile.wrap(DDP(copy.deepcopy(base)), backend="aot_eager")
    grads = {}
    for name, model in (("ref", ref), ("ours", ours)):
        x, y = batch("mlp_seq", rank, 0)
        loss = loss_fn("mlp_seq", model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        grads[name] = [p.grad.clone() for p in model.module.parameters()]
    return {"params": grads["ours"], "ref_params": grads["ref"], "losses": []}


def gradient_penalty(rank: int, world: int, backend: str) -> dict:
    """A loss with a gradient penalty on the input (``autograd.grad(..., create_graph=True)``)."""
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    ref, ours = DDP(copy.deepcopy(base)), distcompile.wrap(DDP(copy.deepcopy(base)), backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    losses = []
    try:
        for step in range(3):
            x, y = batch("mlp_seq", rank, step)
            pair = []
            for model, opt in zip((ref, ours), opts):
                x = x.detach().requires_grad_()
                loss = loss_fn("mlp_seq", model(x), y)
                (dx,) = torch.autograd.grad(loss, x, create_graph=True)
                total = loss + 0.1 * dx.pow(2).sum()
                total.backward()
                opt.step()
                opt.zero_grad()
                pair.append(float(total.detach()))
            losses.append(pair)
    except distcompile.UnsupportedModelError as exc:
        return {"error": str(exc)}
    return {
        "error": None,
        "losses": losses,
        "ref_params": [p.detach().clone() for p in ref.module.parameters()],
        "params": [p.detach().clone() for p in ours.module.parameters()],
    }
