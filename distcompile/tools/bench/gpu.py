"""What the benchmark measures only on GPUs: host synchronizations per step, and the GPU's versions."""

from __future__ import annotations

import subprocess

import torch
from torch.profiler import ProfilerActivity, profile

from .variants import Variant
from .workload import Workload

__all__ = ["SYNC_CALLS", "count_host_syncs", "gpu_meta"]

#: CUDA runtime calls that make the host wait for the GPU.
SYNC_CALLS = frozenset(
    {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D"}
)


def count_host_syncs(w: Workload, variants: list[Variant], results: dict[str, dict], steps: int = 3) -> None:
    """Record ``host_syncs_per_step`` of each variant: synchronizing CUDA calls in warm steps.

    Counted from the CUDA runtime calls the profiler sees (not only the ones
    ``torch.cuda.set_sync_debug_mode`` knows), over ``steps`` steps after the timed rounds.

    Example:
        >>> # count_host_syncs(workload, variants, results)  # results["ddp"]["host_syncs_per_step"]
    """
    with torch.compiler.set_stance("fail_on_recompile"):
        for v in variants:
            w.sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    v.step(w)
            w.sync()
            v.events.clear()
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
