"""Rank functions of the self-check and doctor tests (module level, so that spawn can import them)."""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from tests.models import BUILDERS, GradWrongWhenCompiled, batch, loss_fn
from tests.workers import _seq_len


def _halve(param: torch.Tensor) -> None:
    param.data.mul_(0.5)  # what the checkpoint-under-regions bug did: backward wrote a weight


def _loss(
    model: torch.nn.Module, model_name: str, x: torch.Tensor, y: torch.Tensor, inject: str
) -> torch.Tensor:
    """The step's loss; ``inject``: ``"penalty"`` (an L2 penalty on every weight, written in
    the loop), ``"two_forwards"`` (a second forward, on the batch reversed), ``"temperature"``
    (the output divided by a parameter the forward never reads): uses outside the checked
    forward that add to ``.grad`` too (Note [Gradients by their source])."""
    out = model(x)
    loss = loss_fn(model_name, out / model.module.temp if inject == "temperature" else out, y)
    if inject == "penalty":
        loss = loss + 1e-2 * sum(p.square().sum() for p in model.parameters())
    if inject == "two_forwards":
        loss = loss + loss_fn(model_name, model(x.flip(0)), y.flip(0))
    return loss


def verify_run(
    rank: int, world: int, model_name: str, backend: str, inject: str = "", steps: int = 3
) -> dict:
    """Train ``steps`` steps with verify=True; return what was checked or the error's text.

    ``inject``: ``"param"`` (a hook overwrites a parameter during backward, on rank 1 only),
    ``"user_hook"`` (a gradient hook on a parameter, different per rank), ``"optim_in_backward"``,
    ``"powersgd"`` (a communication hook compressing from the first step),
    ``"grad"`` (the compiled backward scales gradients), ``"lengths"`` (sequence lengths
    16, 9, 12: two recompiles), ``"no_sync"`` (each step accumulates two micro-batches),
    ``"penalty"``, ``"two_forwards"`` and ``"temperature"`` (``_loss``).
    """
    torch.manual_seed(0)
    net = GradWrongWhenCompiled() if inject == "grad" else BUILDERS[model_name]()
    if inject == "temperature":
        net.temp = torch.nn.Parameter(torch.tensor(1.5))
    if inject == "optim_in_backward":  # its parameters change in backward by design
        from torch.distributed.optim import _apply_optimizer_in_backward

        _apply_optimizer_in_backward(torch.optim.SGD, net.parameters(), {"lr": 0.05})
    ddp = DDP(net)
    if inject == "powersgd":  # the hook's approximation is not eager DDP's average, by design
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        ddp.register_comm_hook(
            psgd.PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False),
            psgd.powerSGD_hook,
        )
    model = distcompile.wrap(ddp, backend=backend, verify=True, dynamic=False)
    if inject == "param" and rank == 1:
        dict(model.module.named_parameters())["0.0.weight"].register_post_accumulate_grad_hook(_halve)
    if inject == "user_hook":  # legal: eager DDP reduces the hooked gradient, and so must the check
        dict(model.module.named_parameters())["0.0.weight"].register_hook(lambda g: g * (rank + 1))
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
                    _loss(model, model_name, x, y, inject).backward()
            opt.step()
            opt.zero_grad()
    except distcompile.VerificationError as exc:
        return {"error": str(exc), "step": step, "checked": model._check.checked}
    return {"error": None, "checked": model._check.checked, "graphs": len(model.graphs)}


def _regions_inlined_at_top_only(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """What inlining did before Note [Regions under checkpoint]: region calls inside a
    checkpoint body were left for AOTAutograd, where torch 2.13 mishandles them."""
    from distcompile.capture import regions

    regions._inline_here(gm, {}, {})
    return gm


def doctor_run(rank: int, world: int, model_name: str, stages: tuple, fault: str = "") -> dict:
    """distcompile.doctor on ``model_name``; ``fault="regions_under_checkpoint"`` brings back the
    torch bug distcompile works around, as a bug nobody has seen yet would look."""
    if fault == "regions_under_checkpoint":
        import distcompile.compile.backend as backend

        backend.inline_regions = _regions_inlined_at_top_only
    torch.manual_seed(0)
    model = DDP(BUILDERS[model_name]())
    x, y = batch(model_name, rank, 0)
    report = distcompile.doctor(
        model, x, loss_fn=lambda out: loss_fn(model_name, out, y), stages=stages, timeout_s=60
    )
    return {
        "text": str(report),
        "first_bad": report.first_bad_stage,
        "agree": report.ranks_agree,
        "status": {s: [r.status for r in rs] for s, rs in report.results.items()},
        "summaries": {s: [r.summary for r in rs] for s, rs in report.results.items()},
    }


def backward_compile_fails(rank: int, world: int) -> str:
    """Inductor fails on every backward graph: the error reaches backward() as distcompile's own."""
    import torch._inductor.compile_fx as compile_fx

    torch._inductor.config.force_disable_caches = True  # nothing loaded: each backward is compiled lazily
    real = compile_fx.compile_fx_inner

    def failing(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: object) -> object:
        if kwargs.get("is_backward"):
            raise AssertionError("an internal check failed")  # as a torch bug would
        return real(gm, example_inputs, **kwargs)

    compile_fx.compile_fx_inner = failing
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="inductor")
    x, y = batch("mlp_seq", rank, 0)
    loss = loss_fn("mlp_seq", model(x), y)  # the forward compiles fine
    try:
        loss.backward()
    except distcompile.CompileError as exc:
        return str(exc)
    return "no error"


def forward_check_run(
    rank: int, world: int, model_name: str, backend: str, inject: str = "", steps: int = 3
) -> dict:
    """Train ``steps`` steps under ``wrap``'s defaults (the first-step forward check); return
    how many steps were checked or the error's text. ``inject``: ``"misreuse"`` (every
    repeated block counts as alike, so blocks that differ share one region trace),
    ``"lengths"`` (sequence lengths 16, 9, 12: two recompiles), ``"penalty"`` and
    ``"two_forwards"`` (``_loss``)."""
    if inject == "misreuse":
        import distcompile.capture.regions as regions

        regions.likeness_key = lambda block: ()  # this rank's process only
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(BUILDERS[model_name]()), backend=backend, dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(steps):
            x, y = batch(model_name, rank, step)
            if inject == "lengths":
                x, y = _seq_len(x, y, (16, 9, 12)[step % 3], mark=False)
            _loss(model, model_name, x, y, inject).backward()
            opt.step()
            opt.zero_grad()
    except distcompile.VerificationError as exc:
        return {"error": str(exc), "step": step, "checked": model._check.checked}
    return {"error": None, "checked": model._check.checked, "graphs": len(model.graphs)}


def saved_hooks_run(rank: int, world: int, verify: object, pack: str) -> dict:
    """One step of a three-piece MLP (Inductor) under saved-tensors hooks that give back what
    they got (``pack="clone"``) or an int64 for a saved bool mask (``"times_one"``): the
    error's text, or the parameters after the step next to eager DDP's."""
    packs = {"clone": torch.clone, "times_one": lambda t: t * 1}
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )
    ref, ours = DDP(base, bucket_cap_mb=0.01), DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    model = distcompile.wrap(ours, backend="inductor", verify=verify)
    x, y = batch("mlp_seq", rank, 0)
    try:
        for m in (ref, model):
            with torch.autograd.graph.saved_tensors_hooks(packs[pack], lambda t: t):
                loss = loss_fn("mlp_seq", m(x), y)
            loss.backward()
    except distcompile.VerificationError as exc:
        return {"error": str(exc), "pieces": [len(g.plan.pieces) for g in model.graphs]}
    finally:
        model.close()
    return {"error": None, "grads": [(p.grad, q.grad) for p, q in zip(ref.parameters(), ours.parameters())]}


def meta_learning_run(rank: int, world: int, verify: object) -> dict:
    """MAML's step (backend ``eager``, as distcompile's error for ``create_graph=True`` advises):
    an inner loss's gradients taken with ``create_graph=True``, the outer loss on the updated
    weights, its backward through the inner one. Eager DDP's parameters next to distcompile's,
    or the error's text."""
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    ref, ours = DDP(base), DDP(copy.deepcopy(base))
    model = distcompile.wrap(ours, backend="eager", verify=verify)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, model)]
    try:
        for step in range(3):
            x, y = batch("mlp_seq", rank, step)
            for m, opt in zip((ref, model), opts):
                inner = m.module if m is ref else model.module
                params = dict(inner.named_parameters())
                grads = torch.autograd.grad(
                    loss_fn("mlp_seq", m(x), y), list(params.values()), create_graph=True
                )
                fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
                loss_fn(
                    "mlp_seq", torch.func.functional_call(inner, fast, (x.flip(0),)), y.flip(0)
                ).backward()
                opt.step()
                opt.zero_grad()
    except distcompile.VerificationError as exc:
        return {"error": str(exc)}
    finally:
        model.close()
    return {
        "error": None,
        "params": [(p.detach(), q.detach()) for p, q in zip(ref.parameters(), ours.parameters())],
    }
