"""Where a step's host time goes, on a GPU: per variant, the host's time per step against the
GPU's, the GPU's busy share, the CUDA runtime calls a step makes, and Python's profile.

    PYTHONPATH=. python benchmarks/gpu_host_profile.py --out-dir /tmp/prof        # a GPU
    PYTHONPATH=. python benchmarks/gpu_host_profile.py --device cpu --small        # a dry run

One process, a world of one (NCCL on a GPU, gloo on CPU), the benchmark GPT of
``distcompile bench --device cuda`` (bf16 autocast, fused AdamW). For each variant, after
its compiles: ``--steps`` steps with no synchronization between them, timed three ways:
the host's time to issue each step (``perf_counter`` around it; once the launch queue is
full this includes waiting for the GPU), the wall time of them all (one synchronize at the
end), and the GPU's time per step (events). Then a few steps under torch's profiler: kernel
time on the GPU over the steps' wall time (the GPU's busy share: far under 100% means the
host does not keep up) and the CUDA runtime calls per step (launches, event records,
synchronizations, copies). For the variants named by ``--python-profile``, ``cProfile``
of the same steps: the Python functions that take the host's time. Prints a table and the
profiles, and writes ``host-profile.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile.tools.bench.variants import VARIANTS, Variant, build
from distcompile.tools.bench.workload import Workload

#: Beside the benchmark's variants: distcompile with telemetry as ``logdir=`` alone gives it.
TELEMETRY_DEFAULTS = "dc_telemetry_defaults"
#: CUDA runtime calls counted per step (name fragments as the profiler reports them).
RUNTIME_CALLS = ("LaunchKernel", "EventRecord", "Synchronize", "Memcpy", "Memset", "StreamWaitEvent")


def _variant(w: Workload, name: str) -> Variant:
    if name != TELEMETRY_DEFAULTS:
        return build(w, name)
    ddp = DDP(w.fresh(name), device_ids=[w.device.index] if w.cuda else None)
    model = distcompile.wrap(ddp, logdir=tempfile.mkdtemp(prefix="dc_prof_"))
    return Variant(name, model, w.optimizer(model.parameters()), True)


def _timed(w: Workload, v: Variant, steps: int) -> dict:
    w.sync()
    t0 = time.perf_counter()
    host = [v.step(w) for _ in range(steps)]
    w.sync()
    wall = (time.perf_counter() - t0) / steps
    v.read_events()
    gpu = v.times[-steps:] if w.cuda else host
    return {
        "host_ms": 1e3 * statistics.median(host),
        "wall_ms": 1e3 * wall,
        "gpu_ms": 1e3 * statistics.median(gpu),
    }


def _torch_profile(w: Workload, v: Variant, steps: int) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if w.cuda else [])
    w.sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            v.step(w)
        w.sync()
    wall_us = 1e6 * (time.perf_counter() - t0)
    events = prof.key_averages()
    kernel_us = sum(
        e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    calls = {c: sum(e.count for e in events if c in e.key) / steps for c in RUNTIME_CALLS}
    table = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    return {"gpu_busy": kernel_us / wall_us if w.cuda else None, "calls_per_step": calls, "table": table}


def _python_profile(w: Workload, v: Variant, steps: int) -> str:
    w.sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        v.step(w)
    w.sync()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="a tiny model (a dry run)")
    p.add_argument(
        "--variants",
        default=f"ddp,compile_ddpopt,regional,dc_inductor_quiet,dc_inductor,{TELEMETRY_DEFAULTS}",
    )
    p.add_argument("--python-profile", default=f"compile_ddpopt,dc_inductor_quiet,{TELEMETRY_DEFAULTS}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS) - {TELEMETRY_DEFAULTS})
    if unknown:
        p.error(f"unknown variant(s) {unknown}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    w = Workload.for_rank(argparse.Namespace(device=args.device, small=args.small, bucket_cap_mb=None))
    rows: dict[str, dict] = {}
    profiles: dict[str, str] = {}
    for name in names:
        w.say(f"{name}: building, compiling, warming up")
        v = _variant(w, name)
        for _ in range(3):
            v.step(w)
        v.warm = True
        _timed(w, v, args.steps)  # the allocator's and the caches' first steady steps
        row = _timed(w, v, args.steps)
        prof = _torch_profile(w, v, 3)
        profiles[name + " (torch.profiler, by self CPU time)"] = prof.pop("table")
        row |= prof
        if name in args.python_profile.split(","):
            profiles[name + " (cProfile)"] = _python_profile(w, v, args.steps)
        rows[name] = row
        if isinstance(v.model, distcompile.DistCompiledModule):
            row["pieces"] = sum(len(g.plan.pieces) for g in v.model.graphs)
            v.model.close()
        del v
        if w.cuda:
            torch.cuda.empty_cache()
    for title, text in profiles.items():
        print(f"\n===== {title}\n{text}")
    print(
        f"\n{'variant':<24} {'host ms':>8} {'wall ms':>8} {'GPU ms':>8} {'GPU busy':>8} {'pieces':>6}  calls/step"
    )
    for name, r in rows.items():
        busy = f"{100 * r['gpu_busy']:.0f}%" if r["gpu_busy"] is not None else "-"
        calls = ", ".join(f"{k} {c:.0f}" for k, c in r["calls_per_step"].items() if c)
        print(
            f"{name:<24} {r['host_ms']:>8.2f} {r['wall_ms']:>8.2f} {r['gpu_ms']:>8.2f} {busy:>8} "
            f"{r.get('pieces', '-'):>6}  {calls}"
        )
    print(
        "host ms: median time to issue a step; wall ms: steps' wall time / steps; GPU ms: median event time of a "
        "step; GPU busy: kernel time over wall time in 3 profiled steps"
    )
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if w.cuda else "cpu"}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "host-profile.json"), "w") as f:
        json.dump({"meta": meta, "variants": rows}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
