"""The benchmark's variants: how each one builds its model and takes a training step."""

from __future__ import annotations

import atexit
import contextlib
import functools
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

__all__ = ["CPU_DEFAULT", "CUDA_DEFAULT", "CUDA_ONLY", "SHARED_GPU_DEFAULT", "VARIANTS", "Variant", "build"]

#: Variant name -> short description, in the order they run within a round.
VARIANTS = {
    "compile_noddp": "torch.compile(model), no DDP: no gradient sync (the compute floor)",
    "ddp": "eager DDP",
    "ddp_fp16": "eager DDP + fp16 compression hook",
    "compile_ddpopt": "torch.compile(DDP), DDPOptimizer",
    "compile_ddpopt_cg": "torch.compile(DDP, mode='reduce-overhead'): DDPOptimizer, CUDA graphs",
    "compile_noopt": "torch.compile(DDP), optimize_ddp=False",
    "regional": "each block torch.compile'd, eager DDP around it (regional compilation)",
    "compiled_autograd": "torch.compile + compiled autograd, python reducer",
    "fsdp_replicate": "fully_shard on a (world, 1) replicate mesh, each block compiled",
    "dc_aot_eager": "distcompile, aot_eager",
    "dc_inductor": "distcompile, inductor",
    "dc_inductor_quiet": "distcompile, inductor, telemetry off (what wrap() does by default)",
    "dc_inductor_noshare": "distcompile, inductor, share_compiles=False (every rank compiles every piece)",
    "dc_inductor_nosplit": "distcompile, inductor, split_shared=False (one reduction per parameter)",
    "dc_cudagraphs": "distcompile, inductor, cudagraphs=True",
    "dc_inductor_bf16": "distcompile, inductor, bf16 compression",
    "dc_auto": "distcompile, inductor, bucket_cap_mb='auto'",
    "dc_auto_bf16_tail": "distcompile, inductor, 'auto' buckets, bf16 on the tail bucket only",
    "dc_auto_bf16": "distcompile, inductor, 'auto' buckets, bf16 compression",
    "dc_auto_nosplit": "distcompile, inductor, 'auto' buckets, split_shared=False (one reduction per parameter)",
    "dc_auto_optim": "distcompile, inductor, 'auto' buckets, optimizer attached (stepped under communication)",
}
#: Variants that need CUDA (CUDA graphs).
CUDA_ONLY = ("compile_ddpopt_cg", "dc_cudagraphs")
#: What runs without --variants: on CPU ranks (gloo, shaped links) and on GPUs (NCCL).
CPU_DEFAULT = tuple(
    n
    for n in VARIANTS
    if n not in CUDA_ONLY
    and n
    not in (
        "compile_noddp",
        "fsdp_replicate",
        "dc_auto_nosplit",
        "dc_inductor_noshare",
        "dc_inductor_nosplit",
        "dc_inductor_quiet",
    )
)
CUDA_DEFAULT = (
    "compile_noddp",
    "ddp",
    "compile_ddpopt",
    "compile_ddpopt_cg",
    "regional",
    "compiled_autograd",
    "fsdp_replicate",
    "dc_inductor",
    "dc_inductor_quiet",
    "dc_cudagraphs",
    "dc_auto",
)
#: With several gloo ranks sharing each GPU (--ranks-per-gpu): what a user would run instead
#: on such a slow link, beside the compute floor.
SHARED_GPU_DEFAULT = ("compile_noddp", "ddp", "compile_ddpopt", "regional", "dc_inductor", "dc_auto")


@dataclass
class Variant:
    """One built variant: its model and optimizer, and how it steps.

    Attributes:
        mode: Its ``torch._dynamo.config.optimize_ddp`` setting, in force until ``warm``.
        ctx: Entered around forward and backward (compiled autograd for that variant).
        warm: Set once its compiles are done; later steps switch no global setting.
        times: Seconds of each timed step (on CUDA: GPU time between events around it).
        cpu: CPU seconds this process (all its threads, gloo's included) spent in each timed
            step (CPU only).
        events: CUDA events around the steps not read yet (CUDA only).
    """

    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    mode: object
    ctx: Callable = contextlib.nullcontext
    warm: bool = False
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def step(self, w: Workload) -> float:
        """One training step on the workload's next batch; returns its seconds.

        Example:
            >>> # seconds = variant.step(workload)
        """
        # optimize_ddp is entered outside the timed region, and only while compiling.
        with contextlib.nullcontext() if self.warm else compat.set_optimize_ddp(self.mode):
            x, y = w.next_batch()
            t0 = time.perf_counter()
            if w.cuda:  # GPU time from events, read after the block (no sync per step)
                self.events.append(
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                )
                self.events[-1][0].record()
            with self.ctx():
                with w.autocast():
                    loss = GPT.loss(self.model(x), y)
                loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            if w.cuda:
                self.events[-1][1].record()
            return time.perf_counter() - t0

    def read_events(self) -> None:
        """Move the GPU times of finished steps into ``times`` (call after a synchronize)."""
        self.times.extend(a.elapsed_time(b) / 1e3 for a, b in self.events)
        self.events.clear()


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
        model = _model(w, name)
    ctx = compat.compiled_autograd if name == "compiled_autograd" else contextlib.nullcontext
    opt = w.optimizer(model.parameters())
    if name.endswith("_optim"):
        model.attach_optimizer(opt)  # the step's opt.step() then does nothing
    return Variant(name, model, opt, mode, ctx)


def _model(w: Workload, name: str) -> torch.nn.Module:
    if name == "compile_noddp":
        return torch.compile(w.fresh(name), backend=_distinct_inductor())
    if name == "fsdp_replicate":
        return _fsdp_replicate(w, name)
    cap = {"bucket_cap_mb": w.args.bucket_cap_mb} if w.args.bucket_cap_mb else {}
    model = w.fresh(name)
    if name == "regional":  # one backend object: every block after the first reuses its code
        backend = _distinct_inductor()
        for block in model.blocks:
            block.compile(backend=backend)
    ddp = DDP(model, device_ids=[w.device.index] if w.cuda else None, **cap)
    if name in ("ddp", "ddp_fp16", "regional"):
        if name == "ddp_fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp
    if name.startswith("compile_") or name == "compiled_autograd":
        return torch.compile(ddp, backend=_distinct_inductor(cudagraphs=name.endswith("_cg")))
    return distcompile.wrap(
        ddp,
        backend="aot_eager" if name == "dc_aot_eager" else "inductor",
        bucket_cap_mb="auto" if name.startswith("dc_auto") else None,
        compression="bf16" if "bf16" in name else None,
        compression_scope="tail" if name.endswith("tail") else "all",
        cudagraphs=name == "dc_cudagraphs",
        split_shared=not name.endswith("_nosplit"),
        share_compiles=not name.endswith("_noshare"),
        # Telemetry gives the report its overlap figures; the quiet variant is the default path.
        logdir=None if name.endswith("_quiet") else tempfile.mkdtemp(prefix=f"dc_{name}_", dir=_logs_root()),
        trace_every=0,
        figure_every=0,
    )


@functools.cache
def _logs_root() -> str:
    """A folder for this process's telemetry (read in the process), removed when it exits."""
    root = tempfile.TemporaryDirectory(prefix="dc_bench_")
    atexit.register(root.cleanup)
    return root.name


def _fsdp_replicate(w: Workload, name: str) -> torch.nn.Module:
    # Data parallelism as torchtitan does it now: FSDP2 on a 2-D mesh whose shard dimension
    # has size 1 (parameters replicated, gradients all-reduced), each block compiled alone.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(w.device.type, (w.world, 1), mesh_dim_names=("replicate", "shard"))
    model = w.fresh(name)
    backend = _distinct_inductor()  # one object for all blocks, or each block recompiles
    for block in model.blocks:
        block.compile(backend=backend)
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _distinct_inductor(*, cudagraphs: bool = False) -> Callable:
    # A backend object per variant: TorchDynamo caches compiled code per backend, so
    # variants compiled from the same DDP.forward never reuse each other's graphs.
    # CUDA graphs: what torch.compile(mode="reduce-overhead") switches on.
    mode = "reduce-overhead" if cudagraphs else None
    compile_fx = compat.inductor_compiler(mode=mode, dynamic=None, cudagraphs=cudagraphs)
    return lambda gm, ex: compile_fx(gm, ex)
