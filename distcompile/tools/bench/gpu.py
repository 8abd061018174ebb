"""Warm steps under the profiler (host synchronizations on GPUs, traces), and the GPU's versions."""

from __future__ import annotations

import os
import subprocess

import torch
from torch.profiler import ProfilerActivity, profile

from .variants import Variant
from .workload import Workload

__all__ = ["SYNC_CALLS", "gpu_meta", "profile_steps"]

#: CUDA runtime calls that make the host wait for the GPU.
SYNC_CALLS = frozenset(
    {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D"}
)


def profile_steps(
    w: Workload, variants: list[Variant], results: dict[str, dict], *, trace_dir: str = "", steps: int = 3
) -> None:
    """Profile ``steps`` warm steps of each variant after the timed rounds.

    On GPUs it records ``host_syncs_per_step``: synchronizing CUDA runtime calls the
    profiler sees (not only the ones ``torch.cuda.set_sync_debug_mode`` knows). With
    ``trace_dir``, rank 0 also writes each variant's trace there as
    ``trace-<variant>.json.gz`` (open it in Perfetto or chrome://tracing).

    Example:
        >>> # profile_steps(workload, variants, results, trace_dir="traces")  # results["ddp"]["host_syncs_per_step"]
    """
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if w.cuda else [])]
    with torch.compiler.set_stance("fail_on_recompile"):
        for v in variants:
            w.sync()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    v.step(w)
            w.sync()  # outside: the profiler would count this wait as the variant's
            v.events.clear()
            if trace_dir and w.rank == 0:
                os.makedirs(trace_dir, exist_ok=True)
                prof.export_chrome_trace(os.path.join(trace_dir, f"trace-{v.name}.json.gz"))
            if w.cuda:
                calls = sum(1 for e in prof.events() if e.name in SYNC_CALLS)
                results[v.name]["host_syncs_per_step"] = calls / steps
                w.say(f"{v.name}: {calls / steps:g} host synchronizations per step")


def gpu_meta() -> dict:
    """The GPU, driver, CUDA, NCCL and Triton versions, for the report.

    Example:
        >>> # gpu_meta()["gpu"]  -> "NVIDIA H100 80GB HBM3, 79 GiB"
    """
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.split("\n")[0]
            .strip()
        )
    except (OSError, subprocess.SubprocessError):
        driver = ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {
        "gpu": f"{props.name}, {props.total_memory / 2**30:.0f} GiB",
        "gpus": torch.cuda.device_count(),
        "driver": driver or "unknown (nvidia-smi not found)",
        "cuda": torch.version.cuda,
        "nccl": ".".join(str(x) for x in torch.cuda.nccl.version()),
        "triton": triton_version,
    }
