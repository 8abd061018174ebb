"""Functions run on every rank by the distributed tests (module level so spawn can import them)."""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from tests.harness import distcompile_messages
from tests.models import BUILDERS, RaisesOnce, batch, loss_fn, step_each


def _bf16_reference_hook(state, bucket):  # noqa: ANN001 - DDP inspects a real annotation; leave none
    # DDP's own bf16 hook refuses to register without NCCL; this is the same
    # arithmetic as distcompile's (average in fp32, cast, all-reduce, cast back).
    buf = bucket.buffer()
    wire = buf.div(dist.get_world_size()).to(torch.bfloat16)
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def back(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


def parity(rank: int, world: int, model_name: str, backend: str, case: str = "plain", steps: int = 4) -> dict:
    """Train eager DDP and distcompile side by side; return per-step losses and final params."""
    torch.manual_seed(0)
    base = BUILDERS[model_name]()
    ddp_kwargs: dict = {"bucket_cap_mb": 0.05}
    if model_name in ("unused", "mask_moe", "mask_moe_unchecked", "mask_moe_unrolled"):
        ddp_kwargs["find_unused_parameters"] = True
    if case == "grad_as_view":
        ddp_kwargs["gradient_as_bucket_view"] = True
    if model_name == "cond_branch":  # eager DDP's torch.cond compiles under DDPOptimizer, which
        ddp_kwargs["bucket_cap_mb"] = 25  # refuses caps under its 1 MiB first bucket (torch 2.13)
    if case == "static_graph":
        ddp_kwargs["static_graph"] = True
    copies = [copy.deepcopy(base), copy.deepcopy(base)]
    for model in copies:  # what a copy loses (tensor hooks), each copy sets up again
        getattr(model, "after_copy", lambda: None)()
    ref = DDP(copies[0], **ddp_kwargs)
    ours_ddp = DDP(copies[1], **ddp_kwargs)
    wrap_kwargs: dict = {"backend": backend}
    if case == "bf16":
        ref.register_comm_hook(None, _bf16_reference_hook)
        wrap_kwargs["compression"] = "bf16"
    if case == "auto":
        wrap_kwargs["bucket_cap_mb"] = "auto"
    if case == "verify":
        wrap_kwargs["verify"] = True
    if case in _DYNAMIC:
        wrap_kwargs["dynamic"] = _DYNAMIC[case]
    if case == "dynamic_shapes":  # dynamic=True on the model's own inputs, no length schedule
        wrap_kwargs["dynamic"] = True
    if case == "numpy_stream":  # NumPy's draws run eagerly, at graph breaks, as in eager DDP
        torch._dynamo.config.use_numpy_random_stream = True
    if case == "capture_dynamic":  # a user's TorchDynamo settings: nonzero and .item() in graphs
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        torch._dynamo.config.capture_scalar_outputs = True
    if case == "recompile_limit":  # this rank's process only: the third version is never compiled
        torch._dynamo.config.recompile_limit = 2
    if case == "retain_graph":  # a cold compile cache: see test_retain_graph_under_inductor
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="distcompile-retain-")
        wrap_kwargs["share_compiles"] = False  # separate folders would share through the store
    if case == "fp16_hook":
        ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
        ours_ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ours = distcompile.wrap(ours_ddp, **wrap_kwargs)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    micro = 3 if case == "no_sync" else 1
    losses: list[tuple[float, float]] = []
    for step in range(steps):
        for model, opt, slot in ((ref, opt_ref, 0), (ours, opt_ours, 1)):
            total = 0.0
            for m in range(micro):
                x, y = batch(model_name, rank, step * micro + m)
                if case in _DYNAMIC:  # sequence lengths 16, 9, 12, 16, ...
                    x, y = _seq_len(x, y, (16, 9, 12)[step % 3], mark=case == "mark_dynamic")
                ctx = model.no_sync() if m < micro - 1 else _null()
                amp = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else _null()
                xin = x.clone() if model_name == "inplace_input" else x  # each model's own, changed once
                np.random.seed(1000 * step + rank)  # each model the same NumPy draws (numpy_mask)
                kwargs = {}
                if model_name == "generator_input":  # each model the same noise
                    kwargs["generator"] = torch.Generator().manual_seed(1000 * step + rank)
                with ctx, amp:
                    loss = loss_fn(model_name, model(xin, **kwargs), y)
                    loss.backward(retain_graph=case.startswith("retain_graph"))
                total += loss.item()
            if slot == 0:
                losses.append((total, float("nan")))
            else:
                losses[-1] = (losses[-1][0], total)
            opt.step()
            opt.zero_grad(set_to_none=(case != "grad_as_view"))
    result = {
        "losses": losses,
        "ref_params": [p.detach().clone() for p in ref.module.parameters()],
        "params": [p.detach().clone() for p in ours.module.parameters()],
        "ref_buffers": _state_tensors(ref.module),
        "buffers": _state_tensors(ours.module),
        "graphs": len(ours.graphs),
        "regions_kept": ours._unmark is not None,  # blocks still marked (no capture fell back)
        "segments": [len(g.plan.segments) for g in ours.graphs],
        "pieces": [len(g.plan.pieces) for g in ours.graphs],
        "pieces_reused": [g.pieces_reused for g in ours.graphs],
        "fingerprints": [g.plan.fingerprint() for g in ours.graphs],
        "planned_by": [g.planned_by for g in ours.graphs],
        "last_step_buckets": ours.last_step.buckets,
        "ddp_reducer_buckets_used": ref.module is not ours.module,
    }
    if model_name == "convbn":  # eval forward under no_grad: no collective, BN running stats used
        ref.eval()
        ours.eval()
        x, _ = batch(model_name, rank, 99)
        with torch.no_grad():
            result["eval"] = (ref(x), ours(x))
    ours.close()  # gives the blocks back their own classes
    result["classes_restored"] = [type(m) for m in ours.module.modules()] == [type(m) for m in base.modules()]
    return result


def _state_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers, then tensors kept as plain attributes (a count updated in place)."""
    plain = [
        v
        for m in module.modules()
        for k, v in vars(m).items()
        if k[:1] != "_" and isinstance(v, torch.Tensor)
    ]
    return [b.clone() for b in [*module.buffers(), *plain]]


#: Parity cases of variable sequence length -> wrap's ``dynamic``.
_DYNAMIC = {"dynamic_true": True, "dynamic_false": False, "dynamic_auto": None, "mark_dynamic": None}


def _seq_len(x: torch.Tensor, y: torch.Tensor, n: int, *, mark: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = x[:, :n].contiguous(), y[:, :n].contiguous()
    if mark:
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(y, 1)
    return x, y


def _error_text(exc_type: type[BaseException], fn) -> str:  # noqa: ANN001
    """Run ``fn``; return the message of the expected ``exc_type`` it raises, or "no error"."""
    try:
        fn()
    except exc_type as e:
        return str(e)
    return "no error"


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _RankDependent(torch.nn.Module):
    """The same parameters on every rank, but rank 0's forward takes another branch."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.extra = extra
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.extra:
            h = torch.tanh(h)
        return self.b(h)


def desync_structure(rank: int, world: int) -> str:
    """A genuinely different graph per rank: every rank must get a DesyncError, not hang."""
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(_RankDependent(rank == 0)), backend="eager", desync_timeout_s=20)
    return _error_text(distcompile.DesyncError, lambda: model(torch.randn(4, 64)).sum().backward())


def batch_sizes_differ(rank: int, world: int) -> dict:
    """Each rank its own batch size (16 + 3 * rank) and sequence of them: trains as eager DDP."""
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    ref, ours = DDP(copy.deepcopy(base)), distcompile.wrap(DDP(copy.deepcopy(base)), backend="aot_eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        n = (16, 12, 16, 9)[step] + 3 * rank  # rank 1's batch size changes at other steps than rank 0's
        x, y = torch.randn(n, 64, generator=g), torch.randn(n, 8, generator=g)
        losses.append(step_each((ref, ours), opts, lambda model, x=x, y=y: loss_fn("mlp_seq", model(x), y)))
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in ours.module.parameters()],
        "ref_params": [p.detach().clone() for p in ref.module.parameters()],
        "graphs": len(ours.graphs),
    }


def desync_missing(rank: int, world: int) -> str:
    """Rank 1 never runs forward: rank 0 must give up within desync_timeout_s."""
    import time

    torch.manual_seed(0)
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="eager", desync_timeout_s=3)
    if rank == 1:
        return "skipped"
    t0 = time.monotonic()
    try:
        model(torch.randn(4, 64))
    except distcompile.DesyncError as e:
        return f"{time.monotonic() - t0:.1f}s {e}"
    return "no error"


def restart_counts_differ(rank: int, world: int) -> dict:
    """Two nodes after one node's worker failed: its agent counts a restart, the other's does
    not, so ``TORCHELASTIC_RESTART_COUNT`` differs between ranks. Their keys must not."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)
    torch.manual_seed(0)
    first = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="aot_eager", desync_timeout_s=20)
    second = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="aot_eager", desync_timeout_s=20)
    x, y = batch("mlp_seq", rank, 0)
    loss_fn("mlp_seq", first(x), y).backward()  # the first step's lockstep keys under the prefix
    prefixes = [None] * world
    dist.all_gather_object(prefixes, (first._store_prefix, second._store_prefix))
    return {"prefixes": prefixes, "grads": [p.grad.clone() for p in first.parameters()]}


def plain_module(rank: int, world: int) -> dict:
    """A plain module (no DDP) is broadcast from rank 0 and trains in sync."""
    torch.manual_seed(rank)  # different init on purpose: wrap must broadcast rank 0's
    model = distcompile.wrap(BUILDERS["mlp_seq"](), backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch("mlp_seq", rank, step)
        loss_fn("mlp_seq", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()]}


def collective_counts(rank: int, world: int) -> dict:
    """Count collectives with the process group's sequence number (every collective bumps it)."""
    pg = dist.group.WORLD
    seq = pg._get_sequence_number_for_group
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"](), bucket_cap_mb=0.01), backend="eager")
    before = seq()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 64))
    no_grad = seq() - before
    opened = model._reducer.step_open
    x, y = batch("mlp_seq", rank, 0)
    before = seq()
    loss_fn("mlp_seq", model(x), y).backward()
    step = seq() - before
    before = seq()
    with model.no_sync():
        loss_fn("mlp_seq", model(x), y).backward()
    return {
        "no_grad": no_grad,
        "opened_by_no_grad": opened,
        "train_step": step,
        "no_sync_step": seq() - before,
        "buckets": model.last_step.buckets,
    }


def _returns_a_tensor(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses string annotations
    return bucket.buffer()


def custom_hook(rank: int, world: int) -> dict:
    """A hook and compression= both, and a hook that breaks DDP's contract: clear errors."""
    ddp = DDP(BUILDERS["mlp_seq"]())
    ddp.register_comm_hook(None, _bf16_reference_hook)
    both = _error_text(distcompile.ConfigError, lambda: distcompile.wrap(ddp, compression="bf16"))
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="eager")
    model.register_comm_hook(None, _returns_a_tensor)
    broken = _error_text(
        distcompile.UnsupportedModelError, lambda: model(torch.randn(4, 64)).sum().backward()
    )
    return {"both": both, "broken": broken}


def telemetry_run(rank: int, world: int, logdir: str, all_ranks: bool) -> dict:
    """Train a few steps with telemetry on; return each step's stats."""
    torch.manual_seed(0)
    model = distcompile.wrap(
        DDP(BUILDERS["gpt"](), bucket_cap_mb=0.05),
        backend="aot_eager",
        logdir=logdir,
        trace_every=2,
        figure_every=2,
        telemetry_all_ranks=all_ranks,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = []
    for step in range(4):
        x, y = batch("gpt", rank, step)
        loss_fn("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        s = model.last_step
        stats.append(
            {"step": s.step, "fwd_bwd_ms": s.fwd_bwd_ms, "buckets": s.buckets, "timed_step": s.timed_step}
            | s.figures()
        )
    model.close()
    return {"stats": stats}


def compile_events(rank: int, world: int, logdir: str) -> dict:
    """A graph break, then a batch-size change: both must be reported with reasons."""
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(BUILDERS["graph_break"]()), backend="eager", logdir=logdir)
    for n in (4, 4, 6):
        model(torch.randn(n, 64)).sum().backward()
    model.close()
    return {
        "breaks": [g.graph_break for g in model.graphs if g.graph_break],
        "recompiles": [g.recompile_reason for g in model.graphs if g.recompile_reason],
    }


def recompile_forbidden(rank: int, world: int) -> str:
    """recompile='error': a batch-size change after warm-up raises on every rank."""
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="eager", recompile="error")
    model(torch.randn(4, 64)).sum().backward()
    model(torch.randn(4, 64)).sum().backward()
    return _error_text(distcompile.RecompileError, lambda: model(torch.randn(6, 64)).sum().backward())


def dynamic_no_recompile(rank: int, world: int) -> int:
    """With mark_dynamic before the first step, a batch-size change does not recompile."""
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="aot_eager", recompile="error")
    for n in (4, 6, 9):
        x = torch.randn(n, 64)
        torch._dynamo.mark_dynamic(x, 0)
        model(x).sum().backward()
    return len(model.graphs)


def fullgraph_break(rank: int, world: int) -> str:
    model = distcompile.wrap(DDP(BUILDERS["graph_break"]()), backend="eager", fullgraph=True)
    try:
        model(torch.randn(4, 64))
    except Exception as e:  # noqa: BLE001 - TorchDynamo's own error type is the point
        return f"{type(e).__name__}: {e}"
    return "no error"


def peer_failure(rank: int, world: int, how: str) -> str | None:
    """Rank 1 fails at step 2 (raises in forward, is SIGKILLed, or stalls past the group's
    timeout); rank 0 must get a clear error fast."""
    import os
    import signal
    import time
    from datetime import timedelta

    torch.manual_seed(0)
    # A stall: a group whose collectives give up after 3 s, and rank 1 sleeping for 8.
    group = dist.new_group(timeout=timedelta(seconds=3)) if how == "stall" else None
    model = distcompile.wrap(
        DDP(BUILDERS["mlp_seq"](), bucket_cap_mb=0.01, process_group=group), backend="eager"
    )
    for step in range(4):
        x = torch.randn(4, 64)
        if rank == 1 and step == 2:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "stall":
                time.sleep(8)
                return "stalled"
            x = torch.randn(4, 63)  # a bad batch: the first Linear raises in forward
        t0 = time.monotonic()
        try:
            model(x).sum().backward()
        except distcompile.CommunicationError as e:
            return f"{time.monotonic() - t0:.1f}s {e}"
        except Exception as e:  # noqa: BLE001 - rank 1's own, intended failure
            if rank == 1:
                return f"raised {type(e).__name__}"
            raise
    return "no error"


def params_differ(rank: int, world: int, imaginary: bool = False) -> str:
    """Rank 1 changes a weight after DDP was built (``imaginary``: only the imaginary part of a
    complex one)."""
    model = BUILDERS["mlp_seq"]()
    if imaginary:
        model[2][0].weight = torch.nn.Parameter(model[2][0].weight.detach().to(torch.complex64))
        model[2][0].forward = lambda x, m=model[2][0]: (x.to(torch.complex64) @ m.weight.T).real + m.bias
    ddp = DDP(model)
    if rank == 1:
        with torch.no_grad():  # e.g. a checkpoint loaded on one rank only
            ddp.module[2][0].weight.add_(1j if imaginary else 1.0)
    return _error_text(distcompile.DesyncError, lambda: distcompile.wrap(ddp, backend="eager"))


def nonfinite(rank: int, world: int) -> str:
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="eager", detect_nonfinite=True)
    model(torch.randn(4, 64)).sum().backward()
    x = torch.randn(4, 64)
    if rank == 0:
        x[0, 0] = float("inf")
    return _error_text(distcompile.NonFiniteGradientError, lambda: model(x).sum().backward())


def dead_group(rank: int, world: int) -> str:
    sub = dist.new_group([0, 1])
    ddp = DDP(BUILDERS["mlp_seq"](), process_group=sub)
    dist.destroy_process_group(sub)
    return _error_text(distcompile.UnsupportedModelError, lambda: distcompile.wrap(ddp))


def explain_mid_training(rank: int, world: int) -> dict:
    """Only rank 0 calls explain between steps: the wrapped model must not recompile."""
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(BUILDERS["gpt"]()), backend="eager", desync_timeout_s=20)
    x, y = batch("gpt", rank, 0)
    loss_fn("gpt", model(x), y).backward()
    if rank == 0:
        distcompile.explain(model.module, x)
    loss_fn("gpt", model(x), y).backward()
    return {"graphs": len(model.graphs)}


def tail_compression(rank: int, world: int) -> dict:
    """One step of fp32 eager DDP and of distcompile with bf16 on the tail only; gradients by name."""
    torch.manual_seed(0)
    base = BUILDERS["gpt"]()
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.05)
    ours = distcompile.wrap(
        DDP(copy.deepcopy(base), bucket_cap_mb=0.05),
        backend="aot_eager",
        compression="bf16",
        compression_scope="tail",
    )
    x, y = batch("gpt", rank, 0)
    for model in (ref, ours):
        loss_fn("gpt", model(x), y).backward()
    order, _ = next(iter(ours._reducer.layout.schedules.values()))
    return {
        "ref": {n: p.grad.clone() for n, p in ref.module.named_parameters()},
        "ours": {n: p.grad.clone() for n, p in ours.module.named_parameters()},
        "wire": {n: b.wire.dtype for b in order for n in b.names},
        "tail": [n for b in order if b.tail for n in b.names],
    }


def warm_restart(rank: int, world: int, model_name: str) -> dict:
    """Compile with Inductor, forget everything in memory, compile again: count cache use."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = BUILDERS[model_name]()
    seen = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        model = distcompile.wrap(DDP(copy.deepcopy(base), bucket_cap_mb=0.05), backend="inductor")
        x, y = batch(model_name, rank, 0)
        loss_fn(model_name, model(x), y).backward()
        seen.append(dict(counters["aot_autograd"]))
    compiled = sum(len(g.plan.pieces) - g.pieces_reused for g in model.graphs)
    return {"pieces": compiled, "first": seen[0], "second": seen[1]}


def doctor_keywords_dropout(rank: int, world: int) -> dict:
    """doctor(model, **batch) on a model with dropout: every stage must pass."""
    torch.manual_seed(0)
    model = DDP(BUILDERS["dropout_kwargs"]())
    gen = torch.Generator().manual_seed(rank)
    batch_ = {"input_ids": torch.randint(0, 50, (4, 8), generator=gen), "attention_mask": torch.ones(4, 8)}
    report = distcompile.doctor(model, **batch_, loss_fn=lambda out: out, timeout_s=120)
    return {"text": str(report), "first_bad": report.first_bad_stage, "notes": report.notes}


def recompile_reasons_after_eval(rank: int, world: int) -> dict:
    """Train at batch 8, an eval forward, then train at batch 4: every failed guard is kept."""
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="eager")
    model(torch.randn(8, 64)).sum().backward()
    with torch.no_grad():
        model(torch.randn(8, 64))
    model(torch.randn(4, 64)).sum().backward()
    model.close()
    return {"reasons": [list(g.recompile_reasons) for g in model.graphs]}


def two_models_one_class(rank: int, world: int) -> dict:
    """A second wrapped model of the same class compiles afresh: not a recompile, even under 'error'."""
    torch.manual_seed(0)
    first = distcompile.wrap(DDP(BUILDERS["mlp_seq"]()), backend="eager", recompile="error")
    for _ in range(2):
        first(torch.randn(4, 64)).sum().backward()
    second = distcompile.wrap(DDP(BUILDERS["mlp_seq"]().double()), backend="eager", recompile="error")
    for _ in range(2):
        second(torch.randn(4, 64, dtype=torch.float64)).sum().backward()
    first(torch.randn(4, 64)).sum().backward()  # the first model's cache still serves it
    return {
        "first": [list(g.recompile_reasons) for g in first.graphs],
        "second": [list(g.recompile_reasons) for g in second.graphs],
    }


def _progress_output(rank: int, train: Callable[[], None]) -> str:
    """What ``train()`` printed to stderr, with logging unconfigured (wrap's own progress lines)."""
    import contextlib
    import io
    import logging

    for h in list(logging.getLogger().handlers):
        logging.getLogger().removeHandler(h)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        import distcompile._log as dc_log

        # The handler writes to sys.stderr as it was when attached: attach inside the redirect.
        logging.getLogger("distcompile").handlers.clear()
        dc_log.enable_progress(rank=rank, first_rank=rank == 0)
        train()
    return err.getvalue()


def progress_lines(rank: int, world: int) -> str:
    """With logging unconfigured, wrap prints rank-prefixed progress on the first rank."""

    def train() -> None:
        model = distcompile.wrap(DDP(BUILDERS["mlp_seq"](), bucket_cap_mb=0.01), backend="eager")
        model(torch.randn(4, 64)).sum().backward()
        model(torch.randn(6, 64)).sum().backward()  # a recompile: a warning on rank 0 only
        with torch.no_grad():
            model(torch.randn(6, 64))  # an inference graph: no buckets, no backward to compile

    return _progress_output(rank, train)


def counter_recompiles(rank: int, world: int) -> dict:
    """Four steps of a model whose Python-int call counter fails a guard at every call."""
    model = distcompile.wrap(DDP(BUILDERS["step_counter"]()), backend="eager")

    def train() -> None:
        for _ in range(4):
            model(torch.randn(4, 64)).sum().backward()

    out = _progress_output(rank, train)
    return {"out": out, "reasons": [list(g.recompile_reasons) for g in model.graphs]}


def shared_compile(
    rank: int, world: int, cache_dir: str | list[str], model: str = "gpt", case: str = "retain_graph_shared"
) -> dict:
    """``parity`` of ``model`` under Inductor, both ranks on one empty compile cache (or each
    on ``cache_dir[rank]``), with retain_graph=True (or another ``case``).

    Returns the parity result plus this rank's AOTAutograd compiles and cache hits, and
    the compile log's lines.
    """

    cache_dir = cache_dir if isinstance(cache_dir, str) else cache_dir[rank]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    lines = distcompile_messages()
    # Shared compiles build each backward with its forward, for a plain backward; what
    # docs/debugging.md tells a user of retain_graph=True to set:
    torch._functorch.config.donated_buffer = False
    before = distcompile._torch_compat.aot_autograd_counts()
    loads = _count_check_loads()
    result = parity(rank, world, model, "inductor", case)
    result["check_loads"] = len(loads)
    after = distcompile._torch_compat.aot_autograd_counts()
    result["aot_hits"] = after[1] - before[1]
    result["aot_compiled"] = after[0] - before[0] - result["aot_hits"]
    # cache_peers' files are gone; what stays: the marker that this folder holds the pieces
    result["peers"] = len(
        [f for f in os.listdir(os.path.join(cache_dir, "distcompile-peers")) if not f.startswith("warm-")]
    )
    result["warm_markers"] = len(os.listdir(os.path.join(cache_dir, "distcompile-peers"))) - result["peers"]
    result["log"] = lines
    return result


def _count_check_loads() -> list[str]:
    """The libraries of Inductor's CPU checks loaded in a process of their own from now on
    (the real loads, counted: ``VecISA._probe_load``, 2.13 and later)."""
    from torch._inductor import cpu_vec_isa

    loaded: list[str] = []
    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if probe is not None:

        def counted(self: object, path: str) -> bool:
            loaded.append(path)
            return probe(self, path)

        cpu_vec_isa.VecISA._probe_load = counted  # type: ignore[method-assign]
    return loaded


def uncompiled_report(rank: int, world: int) -> dict:
    """After the first step: parameters trained by code no graph contains are reported once, by rank 0."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(f"distcompile.runtime.{name}") for name in ("reducer", "module")]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    out = {}
    for name in ("compiler_disable", "mlp_seq", "scripted_part"):
        torch.manual_seed(0)
        inner = BUILDERS[name]()
        getattr(inner, "after_copy", lambda: None)()
        model = distcompile.wrap(DDP(inner), backend="eager")
        for step in range(2):
            x, y = batch(name, rank, step)
            loss_fn(name, model(x), y).backward()
        out[name] = [(r.levelname, r.getMessage()) for r in records if "capturing" not in r.getMessage()]
        records.clear()
    for logger in loggers:
        logger.removeHandler(handler)
    return out


def raises_once(rank: int, world: int) -> dict:
    """The user's error at the first call reaches the user (no silent second try), then training goes on."""
    model = distcompile.wrap(DDP(RaisesOnce()), backend="eager")
    try:
        model(torch.randn(4, 64))
        first = "no error"
    except ValueError as exc:
        first = str(exc)
    model(torch.randn(4, 64)).sum().backward()
    return {"first": first, "calls": model.module.calls, "regions_kept": model._unmark is not None}


def retain_graph_after_warm_cache(rank: int, world: int, folder: str, donated: bool) -> dict:
    """A step that warms this rank's compile cache, then, in a fresh capture that loads every
    piece from it, a step with ``backward(retain_graph=True)`` and a second backward."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, str(rank))
    torch._functorch.config.donated_buffer = donated
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()
    x, y = batch("mlp_seq", rank, 0)
    options = {"backend": "inductor", "share_compiles": False}  # each rank its own cache hits
    warm = distcompile.wrap(DDP(copy.deepcopy(base), bucket_cap_mb=0.05), **options)
    loss_fn("mlp_seq", warm(x), y).backward()
    warm.close()
    torch._dynamo.reset()
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.05)
    ours = distcompile.wrap(DDP(copy.deepcopy(base), bucket_cap_mb=0.05), **options)
    out: dict = {"error": None}
    for model, key in ((ref, "ref"), (ours, "ours")):
        loss = loss_fn("mlp_seq", model(x), y)
        try:
            loss.backward(retain_graph=True)
            loss.backward()  # DDP synchronizes the first only; the second accumulates locally
        except distcompile.ConfigError as exc:
            out["error"] = str(exc)
            break
        out[key] = [p.grad.detach().clone() for p in model.parameters()]
    out["cache_hits"] = sum(g.cache_hits for g in ours.graphs)
    return out


def compute_rate_together_and_alone(rank: int, world: int) -> dict:
    """The rate ``bucket_cap_mb='auto'`` measures with every rank computing, then rank 0's alone."""
    from distcompile.runtime.measure import _time_matmul, measure_costs

    together = measure_costs(group=None, device=torch.device("cpu")).flops_per_s
    alone_group = dist.new_group([0])  # every rank takes part in creating it
    dist.barrier()
    alone = _time_matmul(torch.device("cpu"), alone_group) if rank == 0 else None
    dist.barrier()  # the others wait, blocked, while rank 0 measures
    return {"together": together, "alone": alone}


def tree_broadcasts(rank: int, world: int) -> dict:
    """The leaders' tree: a gloo group of ranks 0, 2 and 4 made by them alone (1 and 3 never
    call it), and a broadcast from each of them (Note [Compiles between folders by tree])."""
    from distcompile.fleet.tree import leaders_group, tree_broadcast

    leaders = [0, 2, 4]
    if rank not in leaders:
        return {}
    group = leaders_group(leaders, timeout_s=60)
    got, sent = {}, {}
    for root in leaders:
        data = bytes([root]) * (1000 + root) if rank == root else None
        got[root], sent[root] = tree_broadcast(data, root=root, ranks=leaders, group=group)
    empty, _ = tree_broadcast(b"" if rank == 2 else None, root=2, ranks=leaders, group=group)
    return {"got": got, "sent": sent, "empty": empty}


def tree_leader_lost(rank: int, world: int, cache_root: str) -> dict:
    """Two folders' leaders; rank 1 dies inside the tree (after its share was ready): rank 0
    compiles what it lacks, says why, and marks the tree broken for the rest of the job."""
    from torch import fx, nn

    from distcompile.compile.jobs import CompileJob
    from distcompile.fleet import tree
    from distcompile.fleet.sharing import CompileSharing

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, str(rank))  # removed by the test
    if rank == 1:
        tree.tree_broadcast = lambda *a, **k: os._exit(0)  # gone mid-transfer
    store = dist.distributed_c10d._get_default_store()
    sharing = CompileSharing(lambda: store, "tl", rank=rank, ranks=(0, 1), timeout_s=5)
    sharing.peers, sharing.folders = (rank,), {0: 0, 1: 1}  # as find_peers finds two folders
    big = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    jobs = [CompileJob(big, [], "big"), CompileJob(fx.symbolic_trace(nn.ReLU()), [], "small")]
    lines = distcompile_messages()
    out = sharing.compile_all(jobs, compile_one=lambda job: job.key, graph="g")
    return {"out": out, "log": lines, "broken": store.check(["tl/tree/broken"]), "route": sharing.route}


def adaptive_weight_warm(rank: int, world: int, folder: str) -> dict:
    """VQGAN's adaptive loss weight (two ``autograd.grad(..., retain_graph=True)`` on the last
    layer's weight, then ``(nll + w * g_loss).backward()``), two steps under the defaults with an
    empty compile cache, then two more in a new capture of the same model on that cache."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    torch.manual_seed(0)
    base = BUILDERS["mlp_seq"]()

    def step(model: torch.nn.Module, s: int) -> float:
        x, y = batch("mlp_seq", rank, s)
        out = model(x)
        nll, g_loss = loss_fn("mlp_seq", out, y), out.abs().mean()
        last = distcompile.unwrap(model)[-1].weight
        g1 = torch.autograd.grad(nll, last, retain_graph=True)[0]
        g2 = torch.autograd.grad(g_loss, last, retain_graph=True)[0]
        w = (g1.norm() / (g2.norm() + 1e-4)).detach()
        loss = nll + w * g_loss
        loss.backward()
        return float(loss)

    results: dict = {"losses": [], "cache_hits": []}
    ref, ours = DDP(copy.deepcopy(base)), copy.deepcopy(base)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    for life in ("cold", "warm"):
        torch._dynamo.reset()
        model = distcompile.wrap(DDP(ours), backend="inductor")
        for s in range(2):
            pair = []
            for m, opt in ((ref, opts[0]), (model, opts[1])):
                pair.append(step(m, s + (2 if life == "warm" else 0)))
                opt.step()
                opt.zero_grad()
            results["losses"].append(tuple(pair))
        results["cache_hits"].append(sum(g.cache_hits for g in model.graphs))
        model.close()
    results["params"] = [p.detach().clone() for p in ours.parameters()]
    results["ref_params"] = [p.detach().clone() for p in ref.module.parameters()]
    results["buffers"] = results["ref_buffers"] = []
    return results


#: Operations that make the host wait for a CUDA stream (their result is read on the host).
HOST_READS = (
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "aten::unique",
    "aten::_unique2",
    "aten::masked_select",
    # A Python number made a tensor: copied into a device tensor (`t[i] = 1.0` does this), a
    # copy from pageable host memory, which on CUDA waits for the stream.
    "aten::lift_fresh",
)


def host_reads(rank: int, world: int, backend: str) -> dict:
    """Warm steps of a tied GPT under the defaults, with small buckets (parts of the tied weight,
    the table reduced by rows), profiled: the operations that would stop a GPU's host."""
    from distcompile.models import GPT, GPTConfig

    torch.manual_seed(0)  # a 1 MiB tied table: reduced by rows (over ROWS_MIN_BYTES)
    net = GPT(GPTConfig(vocab_size=8192, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model = distcompile.wrap(DDP(net, bucket_cap_mb=0.05), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(s: int) -> None:
        x, y = batch("gpt", rank, s)
        loss_fn("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for s in range(3):
        step(s)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for s in range(3, 5):
            step(s)
    kinds = [type(b).__name__ for b in model._reducer.layout.schedules[(-1,)][0]]
    found = [e.name for e in prof.events() if e.name in HOST_READS]
    return {"found": found, "buckets": kinds, "ops": len(prof.events())}


def rows_outgrown(rank: int, world: int) -> str:
    """A larger batch after the first step: the row bucket's all-reduce was sized at the first."""
    from distcompile.models import GPT, GPTConfig

    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=8192, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model = distcompile.wrap(DDP(net, bucket_cap_mb=0.05), backend="aot_eager", dynamic=False)
    for rows in (4, 2, 8):  # smaller is fine; larger is refused
        x = torch.randint(0, 8192, (rows, 16))
        try:
            loss_fn("gpt", model(x), torch.roll(x, -1, dims=1)).backward()
        except distcompile.ConfigError as exc:
            return f"{rows}: {exc}"
        model.zero_grad(set_to_none=True)
    return "no error"


def telemetry_every_piece(rank: int, world: int, logdir: str) -> dict:
    """12 identical blocks under Inductor (cut into 11 identical pieces, compiled once, the same
    piece under 11 names; the last layer's tail joins the head's piece), with telemetry: what
    the trace of a warm step says about each piece."""
    from distcompile.models import GPT, GPTConfig

    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=12, n_head=2, n_embd=32))
    model = distcompile.wrap(DDP(net), backend="inductor", logdir=logdir, trace_every=1, figure_every=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        x, y = batch("gpt", rank, step)
        loss_fn("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = {
        "pieces": sum(len(g.plan.pieces) for g in model.graphs),
        "reused": sum(g.pieces_reused for g in model.graphs),
    }
    model.close()
    return out


def started_all_reduces(rank: int, world: int) -> list:
    """``compat.start_all_reduce`` on the default group and on a group of all ranks: real and
    complex tensors, summed as ``dist.all_reduce`` sums them."""
    from distcompile import _torch_compat as compat

    out = []
    for group in (None, dist.new_group(list(range(world)))):
        real = torch.arange(4, dtype=torch.float32) * (rank + 1)
        cplx = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
        for t in (real, cplx):
            compat.start_all_reduce(t, group).wait()
            out.append(t.tolist())
    return out
