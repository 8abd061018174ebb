"""The benchmark's variants: how each one builds its model and takes a training step."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile import _torch_compat as compat
from distcompile.models import GPT

from .workload import Workload

__all__ = ["VARIANTS", "Variant", "build"]

#: Variant name -> short description, in the order they run within a round.
VARIANTS = {
    "ddp": "eager DDP",
    "ddp_fp16": "eager DDP + fp16 compression hook",
    "compile_ddpopt": "torch.compile(DDP), DDPOptimizer",
    "compile_noopt": "torch.compile(DDP), optimize_ddp=False",
    "compiled_autograd": "torch.compile + compiled autograd, python reducer",
    "dc_aot_eager": "distcompile, aot_eager",
    "dc_inductor": "distcompile, inductor",
    "dc_inductor_bf16": "distcompile, inductor, bf16 compression",
    "dc_auto": "distcompile, inductor, bucket_cap_mb='auto'",
    "dc_auto_bf16_tail": "distcompile, inductor, 'auto' buckets, bf16 on the tail bucket only",
    "dc_auto_bf16": "distcompile, inductor, 'auto' buckets, bf16 compression",
}


@dataclass
class Variant:
    """One built variant: its model and optimizer, and how it steps.

    Attributes:
        mode: Its ``torch._dynamo.config.optimize_ddp`` setting, in force until ``warm``.
        ctx: Entered around forward and backward (compiled autograd for that variant).
        warm: Set once its compiles are done; later steps switch no global setting.
        times: Seconds of each timed step.
    """

    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    mode: object
    ctx: Callable = contextlib.nullcontext
    warm: bool = False
    times: list[float] = field(default_factory=list)

    def step(self, w: Workload) -> float:
        """One training step on the workload's next batch; returns its seconds.

        Example:
            >>> # seconds = variant.step(workload)
        """
        # optimize_ddp is entered outside the timed region, and only while compiling.
        with contextlib.nullcontext() if self.warm else compat.set_optimize_ddp(self.mode):
            x, y = w.next_batch()
            t0 = time.perf_counter()
            with self.ctx():
                loss = GPT.loss(self.model(x), y)
                loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            return time.perf_counter() - t0


def build(w: Workload, name: str) -> Variant:
    """Build variant ``name``; its first step compiles (under the variant's ``optimize_ddp``).

    Example:
        >>> # v = build(workload, "dc_inductor"); first_step_s = v.step(workload)
    """
    # optimize_ddp is read when DDP is built ("python_reducer" makes DDP all-reduce from
    # Python hooks) and when TorchDynamo compiles; nothing reads it in a compiled step, so
    # each variant's setting holds for its building and warm-up steps only (the timed
    # rounds run with recompiles forbidden: see timing.run_rounds).
    # Every variant gets the same DDP bucketing: DDP's defaults (25 MiB, 1 MiB first bucket)
    # unless --bucket-cap-mb is given, which (as in DDP) also sets the first bucket's size.
    mode = {"compile_ddpopt": True, "compile_noopt": False, "compiled_autograd": "python_reducer"}.get(
        name, True
    )
    with compat.set_optimize_ddp(mode):
        cap = {"bucket_cap_mb": w.args.bucket_cap_mb} if w.args.bucket_cap_mb else {}
        ddp = DDP(w.fresh(name), **cap)
    ctx = contextlib.nullcontext
    if name in ("ddp", "ddp_fp16"):
        model = ddp
        if name == "ddp_fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name in ("compile_ddpopt", "compile_noopt", "compiled_autograd"):
        model = torch.compile(ddp, backend=_distinct_inductor())
        ctx = compat.compiled_autograd if name == "compiled_autograd" else ctx
    else:
        model = distcompile.wrap(
            ddp,
            backend="aot_eager" if name == "dc_aot_eager" else "inductor",
            bucket_cap_mb="auto" if name.startswith("dc_auto") else None,
            compression="bf16" if "bf16" in name else None,
            compression_scope="tail" if name.endswith("tail") else "all",
            logdir=tempfile.mkdtemp(prefix=f"dc_{name}_"),
            trace_every=0,
            figure_every=0,
        )
    return Variant(name, model, torch.optim.AdamW(model.parameters(), lr=1e-4), mode, ctx)


def _distinct_inductor() -> Callable:
    # A backend object per variant: TorchDynamo caches compiled code per backend, so
    # variants compiled from the same DDP.forward never reuse each other's graphs.
    compile_fx = compat.inductor_compiler(mode=None, dynamic=None, cudagraphs=False)
    return lambda gm, ex: compile_fx(gm, ex)
