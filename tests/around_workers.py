"""Rank functions of the tests of what scripts do around the model (tests/runtime/test_model_changes.py):
a head replaced, layers unfrozen, ``load_state_dict(assign=True)``, a meta model materialized,
copies and pickles, each against eager DDP built for the model as it is after the change."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import logging
import os
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel

import distcompile
from tests.models import batch, loss_fn, mlp_seq, step_each

NAME = "mlp_seq"


def _train(models: tuple, opts: list, rank: int, steps: range) -> list[list[float]]:
    return [
        step_each(models, opts, lambda m, x=x, y=y: loss_fn(NAME, m(x), y))
        for x, y in (batch(NAME, rank, s) for s in steps)
    ]


def _sgd(*models: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in distcompile.unwrap(model).parameters()]


def _new_head(rank: int) -> nn.Linear:
    torch.manual_seed(100 + rank)  # each rank draws another head: rank 0's must win, as in DDP's constructor
    return nn.Linear(64, 8)


def _change(case: str, rank: int, net: nn.Sequential, path: str) -> None:
    """The change a script makes after some steps (the same on every rank, values aside)."""
    if case == "head":
        net[-1] = _new_head(rank)
    elif case == "unfreeze":
        for p in net.parameters():
            p.requires_grad_(True)
    elif case == "assign":
        net.load_state_dict(torch.load(path), assign=True)


def changed_after_wrap(rank: int, world: int, case: str, path: str) -> dict:
    """Two steps, ``case``'s change, three more, on distcompile and on eager DDP; eager DDP's
    reference is rebuilt after the change (DDP's constructor broadcasts the first rank's values)."""
    torch.manual_seed(0)
    base = mlp_seq()
    if case == "unfreeze":
        for p in base[0].parameters():
            p.requires_grad_(False)
    if case == "assign" and rank == 0:
        torch.manual_seed(7)
        torch.save({k: v + 0.01 * torch.randn_like(v) for k, v in base.state_dict().items()}, path)
    dist.barrier()
    ref_net, our_net = copy.deepcopy(base), copy.deepcopy(base)
    ref, ours = DDP(ref_net), distcompile.wrap(DDP(our_net), backend="aot_eager")
    losses = _train((ref, ours), _sgd(ref, ours), rank, range(2))
    _change(case, rank, ref_net, path)
    _change(case, rank, our_net, path)
    ref = DDP(ref_net)
    losses += _train((ref, ours), _sgd(ref, ours), rank, range(2, 5))
    return {
        "losses": losses,
        "params": _params(ours),
        "ref_params": _params(ref),
        "graphs": len(ours.graphs),
    }


def meta_materialized(rank: int, world: int) -> dict:
    """torchtitan's order: wrap the model on the meta device, then ``to_empty`` and each rank's
    own initialization; rank 0's values must be taken, as a DDP built after would."""
    with torch.device("meta"):
        net = mlp_seq()
    ours = distcompile.wrap(net, backend="aot_eager")
    x, y = batch(NAME, rank, 0)
    try:
        ours(x)
        early = ""
    except distcompile.UnsupportedModelError as exc:
        early = str(exc)
    ours.module.to_empty(device="cpu")
    torch.manual_seed(rank)
    for m in ours.module.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    ref_net = copy.deepcopy(ours.module)
    ref = DDP(ref_net)  # broadcasts rank 0's values
    losses = _train((ref, ours), _sgd(ref, ours), rank, range(3))
    return {"early": early, "losses": losses, "params": _params(ours), "ref_params": _params(ref)}


def changes_differ(rank: int, world: int) -> str:
    """The ranks replace the head with different shapes: each must raise, naming the difference."""
    torch.manual_seed(0)
    net = mlp_seq()
    ours = distcompile.wrap(DDP(net), backend="aot_eager", desync_timeout_s=30)
    _train((ours,), _sgd(ours), rank, range(1))
    net[-1] = nn.Linear(64, 8 + rank)
    try:
        ours(batch(NAME, rank, 1)[0])
    except distcompile.DesyncError as exc:
        return str(exc)
    return ""


class _OutsideParam(nn.Module):
    def __init__(self, scale: nn.Parameter) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 8)
        self._scale = [scale]  # a trainable parameter the module does not register

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self._scale[0]


def outside_parameter(rank: int, world: int) -> str:
    """A trainable parameter from outside the wrapped model reaches the graph: refused."""
    torch.manual_seed(0)
    ours = distcompile.wrap(DDP(_OutsideParam(nn.Parameter(torch.ones(8)))), backend="aot_eager")
    try:
        ours(batch(NAME, rank, 0)[0]).sum().backward()
    except distcompile.UnsupportedModelError as exc:
        return str(exc)
    return ""


def _pickled(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


_COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {"deepcopy": copy.deepcopy, "torch_save": _pickled}


def copies(rank: int, world: int, how: str) -> dict:
    """A copy of a wrapped model (``how``) trains in sync as a copy of the DDP model does; an EMA
    of the model (``AveragedModel``, and timm's ModelEmaV3 pattern) updates and evaluates, the
    latter on rank 0 alone (no collective in an evaluation)."""
    torch.manual_seed(0)
    base = mlp_seq()
    ref, ours = DDP(copy.deepcopy(base)), distcompile.wrap(DDP(copy.deepcopy(base)), backend="aot_eager")
    swa_ref, swa_ours = AveragedModel(ref), AveragedModel(ours)
    ema_ref, ema_ours = copy.deepcopy(ref), copy.deepcopy(ours)
    opts = _sgd(ref, ours)
    losses = []
    for step in range(3):
        losses += _train((ref, ours), opts, rank, range(step, step + 1))
        for swa, model in ((swa_ref, ref), (swa_ours, ours)):
            swa.update_parameters(model)
        with torch.no_grad():
            for ema, model in ((ema_ref, ref), (ema_ours, ours)):
                for e, m in zip(ema.parameters(), model.parameters()):
                    e.lerp_(m, 0.25)
    x = batch(NAME, rank, 9)[0]
    evals = {}
    if rank == 0:
        with torch.no_grad():
            evals = {"swa": (swa_ref(x), swa_ours(x)), "ema": (ema_ref(x), ema_ours(x))}
    dist.barrier()
    # The copies train on their own, in sync, as the DDP copies do.
    ref_copy, our_copy = _COPIES[how](ref), _COPIES[how](ours)
    copy_losses = _train((ref_copy, our_copy), _sgd(ref_copy, our_copy), rank, range(3, 6))
    return {
        "type": type(our_copy).__name__,
        "losses": losses + copy_losses,
        "evals": evals,
        "params": _params(our_copy),
        "ref_params": _params(ref_copy),
        "original_params": _params(ours),
    }


def _rss_mb() -> float:
    """This process's resident memory, after glibc gave freed memory back (it keeps freed
    arenas otherwise, which reads as growth that is not held by anything)."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc:
        ctypes.CDLL(libc).malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _wrap_train_close() -> weakref.ref:
    net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])  # 16.8 MB of parameters
    model = distcompile.wrap(DDP(net), backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
    model.close()
    return weakref.ref(model)


def wrap_close_cycles(rank: int, world: int, cycles: int) -> dict:
    """Wrap, train 2 steps, close and drop the model, ``cycles`` times in one process (no
    ``torch._dynamo.reset()``)."""
    from distcompile.runtime.module import DistCompiledModule
    from distcompile.runtime.reducer import BucketReducer

    refs, rss = [], []
    for _ in range(cycles):
        refs.append(_wrap_train_close())
        # Two passes: the first frees the model, whose death runs TorchDynamo's finalizers for
        # the guards on it; what those held goes in the second.
        gc.collect()
        gc.collect()
        rss.append(_rss_mb())
    return {
        "rss": rss,
        "alive": sum(r() is not None for r in refs),
        "modules": sum(isinstance(o, DistCompiledModule) for o in gc.get_objects()),
        "reducers": sum(isinstance(o, BucketReducer) for o in gc.get_objects()),
    }


def dcp_round_trip(rank: int, world: int, ckpt_dir: str) -> dict:
    """Six Adam steps of eager DDP, against the same six moved through DCP checkpoints:
    eager DDP (2) -> distcompile (2) -> torch.compile(DDP) (2), model and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    base = mlp_seq()
    legs: list[Callable[[nn.Module], nn.Module]] = [
        lambda net: DDP(net),
        lambda net: distcompile.wrap(DDP(net), backend="aot_eager"),
        lambda net: torch.compile(DDP(net), backend="aot_eager"),
    ]
    keys, moved = [], []
    for leg, make in enumerate(legs):
        model = make(copy.deepcopy(base))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if leg:  # resume from the last leg's checkpoint
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=f"{ckpt_dir}/leg{leg - 1}")
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        moved += _train((model,), [opt], rank, range(2 * leg, 2 * leg + 2))
        msd, osd = get_state_dict(model, opt)
        keys.append((sorted(msd), sorted(osd["state"])))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt_dir}/leg{leg}")
    ref = DDP(copy.deepcopy(base))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    losses = [r + m for r, m in zip(_train((ref,), [ref_opt], rank, range(6)), moved)]
    return {"keys": keys, "losses": losses, "params": _params(model), "ref_params": _params(ref)}


def hooks_after_steps(rank: int, world: int, backend: str) -> dict:
    """A forward-pre hook and a full backward hook on a submodule, and a gradient hook on a
    parameter, added after two steps, on distcompile and on eager DDP alike."""
    torch.manual_seed(0)
    base = mlp_seq()
    ref, ours = DDP(copy.deepcopy(base)), distcompile.wrap(DDP(copy.deepcopy(base)), backend=backend)
    opts = _sgd(ref, ours)
    losses = _train((ref, ours), opts, rank, range(2))
    for model in (ref, ours):
        net = distcompile.unwrap(model)
        net[2].register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
        net[4].register_full_backward_hook(
            lambda m, gin, gout: tuple(g * 3 if g is not None else g for g in gin)
        )
        net[-1].weight.register_hook(lambda g: g * 2)
    losses += _train((ref, ours), opts, rank, range(2, 5))
    return {"losses": losses, "params": _params(ours), "ref_params": _params(ref), "graphs": len(ours.graphs)}


def _messages() -> list[str]:
    """What distcompile logs in this rank from now on, message by message."""
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("distcompile").addHandler(handler)
    return said


def _second_backward(how: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    if how == "retain":  # a second loss backpropagated through the graph the first kept
        out = model(x)
        loss_fn(NAME, out, y).backward(retain_graph=True)
        (0.1 * out.square().mean()).backward()
    elif how == "two_forwards":  # both forwards first, then both backwards
        first, second = loss_fn(NAME, model(x[:2]), y[:2]), loss_fn(NAME, model(x[2:]), y[2:])
        first.backward()
        second.backward()
    else:  # no_sync accumulation: the gradient of the first half is local on purpose
        with model.no_sync():
            loss_fn(NAME, model(x[:2]), y[:2]).backward()
        loss_fn(NAME, model(x[2:]), y[2:]).backward()


def backward_after_step(rank: int, world: int, how: str, verify: bool | str = "forward") -> dict:
    """A backward after the step's gradients were averaged (``how``) trains as eager DDP does,
    gradients left local, and distcompile says so once; ``no_sync`` accumulation says nothing.
    ``verify=True`` does not compare the late gradients with averaged ones (it raised)."""
    said = _messages()
    torch.manual_seed(0)
    base = mlp_seq()
    ref = DDP(copy.deepcopy(base))
    ours = distcompile.wrap(DDP(copy.deepcopy(base)), backend="aot_eager", verify=verify)
    opts = _sgd(ref, ours)
    for step in range(3):
        x, y = batch(NAME, rank, step)
        for model, opt in zip((ref, ours), opts):
            _second_backward(how, model, x, y)
            opt.step()
            opt.zero_grad()
    ours.close()
    return {
        "ref": [p.numpy() for p in _params(ref)],
        "ours": [p.numpy() for p in _params(ours)],
        "said": [m for m in said if "arrived after this step's gradients were averaged" in m],
    }


class _Rebinding(nn.Module):
    """Keeps a running mean by rebinding its buffer in forward, every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp_seq()
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.training:
            self.running = 0.9 * self.running + 0.1 * out.detach().mean(0)
        return out - self.running


def rebound_buffer(rank: int, world: int, broadcast: bool, verify: bool | str = "forward") -> dict:
    """A buffer the forward rebinds every step, over more steps than TorchDynamo's recompile
    limit, and an evaluation after each step: trains and evaluates as eager DDP
    (``broadcast_buffers`` either way), and nothing is adopted; ``verify=True`` compares the
    buffer the eager forward rebound (it compared the copy the forward left behind)."""
    said = _messages()
    torch.manual_seed(0)
    base = _Rebinding()
    kwargs = {} if broadcast else {"broadcast_buffers": False}
    ref, ours = DDP(copy.deepcopy(base), **kwargs), DDP(copy.deepcopy(base), **kwargs)
    ours = distcompile.wrap(ours, backend="aot_eager", verify=verify)
    opts, losses, evals = _sgd(ref, ours), [], []
    for step in range(10):
        losses += _train((ref, ours), opts, rank, range(step, step + 1))
        with torch.no_grad():  # an evaluation broadcasts the buffers the model holds now, as DDP's
            evals.append([m.eval()(batch(NAME, rank, step)[0]) for m in (ref, ours)])
        ref.train(), ours.train()
    out = {
        "losses": losses,
        "evals": evals,
        "params": _params(ours),
        "ref_params": _params(ref),
        # Each rank's last forward moved its own running mean, broadcast or not (as under DDP).
        "running": (ours.module.running.clone(), ref.module.running.clone()),
        "steps": ours._reducer.steps,
        "adopted": [m for m in said if "changed since wrap" in m],
    }
    ours.close()
    return out


def toggled_discriminator(rank: int, world: int) -> dict:
    """A GAN loop that freezes its discriminator for the generator's step and unfreezes it after
    (StyleGAN2's ``requires_grad(D, False)``), over more steps than TorchDynamo's recompile
    limit: trains as eager DDP, and the discriminator is never rebuilt."""
    said = _messages()
    torch.manual_seed(0)
    g0, d0 = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)), nn.Sequential(nn.Linear(16, 1))
    pairs = []
    for ours in (False, True):
        g, d = DDP(copy.deepcopy(g0)), DDP(copy.deepcopy(d0))
        pairs.append(
            (distcompile.wrap(g, backend="aot_eager"), distcompile.wrap(d, backend="aot_eager"))
            if ours
            else (g, d)
        )
    opts = [
        (torch.optim.SGD(g.parameters(), lr=0.05), torch.optim.SGD(d.parameters(), lr=0.05)) for g, d in pairs
    ]
    for step in range(10):
        gen = torch.Generator().manual_seed(10 * step + rank)
        z, real = torch.randn(4, 8, generator=gen), torch.randn(4, 16, generator=gen)
        for (g, d), (og, od) in zip(pairs, opts):
            (d(g(z).detach()) - d(real)).mean().backward()
            od.step(), od.zero_grad()
            d.module.requires_grad_(False)
            (-d(g(z))).mean().backward()
            og.step(), og.zero_grad()
            d.module.requires_grad_(True)
    (g, d), (ref_g, ref_d) = pairs[1], pairs[0]
    out = {
        "losses": [],
        "params": _params(g) + _params(d),
        "ref_params": _params(ref_g) + _params(ref_d),
        "steps": d._reducer.steps,
        "adopted": [m for m in said if "changed since wrap" in m],
    }
    g.close(), d.close()
    return out


@contextlib.contextmanager
def _warnings_said() -> Iterator[list[str]]:
    """The warnings distcompile logs meanwhile, as ``LEVEL: message`` lines."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(f"{record.levelname}: {record.getMessage()}")

    handler = Keep(level=logging.WARNING)
    logging.getLogger("distcompile").addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger("distcompile").removeHandler(handler)


def wrapped_again(rank: int, world: int) -> dict:
    """Wrap a DDP model, train 2 steps, wrap the same DDP model again (a notebook cell run twice)
    and train 2 more; eager DDP beside it. What the first wrapper does then, and what was said."""
    with _warnings_said() as said:
        torch.manual_seed(0)
        base = mlp_seq()
        ref, ddp = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
        first = distcompile.wrap(ddp, backend="aot_eager")
        opts = _sgd(ref, ddp)  # one optimizer over the parameters both wrappers share
        losses = _train((ref, first), opts, rank, range(2))
        second = distcompile.wrap(ddp, backend="aot_eager")
        losses += _train((ref, second), opts, rank, range(2, 4))
        x, y = batch(NAME, rank, 5)
        try:
            loss_fn(NAME, first(x), y)
            first_trains = "trained"
        except distcompile.UnsupportedModelError as exc:
            first_trains = str(exc)
        hooks = len(next(ddp.module.parameters())._post_accumulate_grad_hooks or {})
        second.close()
    return {
        "losses": losses,
        "params": _params(second),
        "ref_params": _params(ref),
        "first_closed": first.closed,
        "first_trains": first_trains,
        "hooks": hooks,
        "said": said,
    }


def cast_after_wrap(rank: int, world: int) -> dict:
    """Wrap, step once, cast the model to float64 (``.double()``: each parameter keeps its object,
    its data is swapped), step again. Each rank's gradients against the average of every rank's
    own gradients, taken in float64 beside it."""
    torch.manual_seed(0)
    base = mlp_seq()
    ours = distcompile.wrap(DDP(copy.deepcopy(base)), backend="aot_eager")
    local = copy.deepcopy(base)  # the same weights, no synchronization: the gradients to average
    worst = []
    for step in range(2):
        if step == 1:
            ours.module.double()
            local.double()
        x, y = batch(NAME, rank, step)
        x, y = x.to(next(local.parameters()).dtype), y.to(next(local.parameters()).dtype)
        for model in (ours, local):
            loss_fn(NAME, model(x), y).backward()
        diffs = []
        for mine, theirs in zip(ours.module.parameters(), local.parameters()):
            mean = theirs.grad.clone()
            dist.all_reduce(mean)
            mean /= world
            diffs.append(float((mine.grad - mean).abs().max() / mean.abs().max()))
        worst.append(max(diffs))
        for model in (ours.module, local):
            model.zero_grad()
    ours.close()
    return {"worst": worst, "dtype": str(next(ours.module.parameters()).dtype)}


def shared_submodule_wrapped(rank: int, world: int) -> dict:
    """Two models that share one submodule, each wrapped: both stay open, and the second wrap
    says which parameters both synchronize."""
    with _warnings_said() as said:
        torch.manual_seed(0)
        shared = nn.Linear(64, 64)
        one = distcompile.wrap(DDP(nn.Sequential(shared, nn.ReLU(), nn.Linear(64, 8))), backend="aot_eager")
        two = distcompile.wrap(DDP(nn.Sequential(shared, nn.Tanh(), nn.Linear(64, 8))), backend="aot_eager")
        closed = (one.closed, two.closed)
        one.close()
        two.close()
    return {"closed": closed, "said": said}


def functional_calls(rank: int, world: int, backend: str) -> dict:
    """Steps that call the model through ``torch.func.functional_call`` with stand-ins computed
    from its parameters (a perturbed copy, as sharpness-aware and meta-learning loops do),
    between plain steps: trains as eager DDP, and nothing is adopted."""
    said = _messages()
    torch.manual_seed(0)
    base = mlp_seq()
    models = (DDP(copy.deepcopy(base)), distcompile.wrap(DDP(copy.deepcopy(base)), backend=backend))
    opts = _sgd(*models)

    def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        if step % 2 == 0:
            return loss_fn(NAME, model(x), y)
        stand_ins = {n: p * 1.01 + 1e-3 for n, p in model.named_parameters()}  # "module.0.weight", ...
        return loss_fn(NAME, torch.func.functional_call(model, stand_ins, (x,)), y)

    losses = [
        step_each(models, opts, lambda m, x=x, y=y, s=s: loss_of(m, x, y, s))
        for s, (x, y) in ((s, batch(NAME, rank, s)) for s in range(5))
    ]
    ref, ours = models
    out = {
        "losses": losses,
        "params": _params(ours),
        "ref_params": _params(ref),
        "adopted": [m for m in said if "changed since wrap" in m],
        "steps": ours._reducer.steps,
    }
    ours.close()
    return out
