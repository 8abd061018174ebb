"""One rank of the benchmark: build every variant, time them in alternating rounds, write JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time

import torch
import torch.distributed as dist

import distcompile

from ...fleet.sharing import SOURCES
from ...telemetry.timeline import mean_figures
from .floor import measure_floor
from .gpu import gpu_meta, profile_steps
from .variants import VARIANTS, Variant, build
from .workload import Workload

__all__ = ["run_worker"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_worker(args: argparse.Namespace, names: list[str]) -> None:
    """Everything one rank does; rank 0 writes the results to ``args.out``.

    Example:
        >>> # run_worker(args, ["ddp", "dc_inductor"])   # in each of the two rank processes
    """
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(args.rank // args.ranks_per_gpu)  # NCCL: one rank per GPU; gloo: several
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda and args.ranks_per_gpu == 1 else "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=args.world,
    )
    w = Workload.for_rank(args)
    # The warm-cache pass only times first steps and peak memory; it needs no floor. On
    # GPUs the floor is a variant: the compiled model without DDP.
    floor, compute_step = ({}, 0.0) if args.first_step_only or cuda else measure_floor(w)
    results: dict[str, dict] = {}
    variants = _build_all(w, names, results)
    if not args.first_step_only:
        _run_rounds(w, variants, results)
        if cuda or args.trace_dir:
            profile_steps(w, variants, results, trace_dir=args.trace_dir)
        _summarize(w, variants, results, compute_step)
    if w.rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {"meta": _meta(w), "floor": floor, "variants": {n: results[n] for n in names}}, f, indent=2
            )
    dist.destroy_process_group()


def _first_step(w: Workload, v: Variant) -> float:
    t0 = time.perf_counter()
    v.step(w)
    w.sync()
    return time.perf_counter() - t0


def _build_all(w: Workload, names: list[str], results: dict[str, dict]) -> list[Variant]:
    variants = []
    # compiled_autograd last: DDP built with optimize_ddp="python_reducer" sets Inductor's
    # global _fuse_ddp_communication for the rest of the process, which changes the
    # compile-cache key of every later Inductor compile (measured: the distcompile variants
    # built after it missed the cache in their warm-start process).
    for name in sorted(names, key=lambda n: n == "compiled_autograd"):
        w.say(f"building and compiling {name} ({VARIANTS[name]}) ...")
        rss0 = _rss_mb()
        if w.cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            v = build(w, name)
            first = _first_step(w, v)
            for _ in range(w.args.warmup):
                v.step(w)
            w.sync()
            v.events.clear()
        except Exception as exc:  # noqa: BLE001 - the report says which variant failed and why
            results[name] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
            w.say(f"{name} failed: {results[name]['error']}")
            continue
        v.warm = True
        results[name] = {"first_step_s": first, "rss_mb": _rss_mb() - rss0}
        if w.args.recompile:  # the compile-scaling mode: a shape change, then one step (recompiles)
            w.shorter()
            results[name]["recompile_s"] = _first_step(w, v)
        if w.args.first_step_only:  # this process built only this variant: its peak is the variant's
            gpu_mb = torch.cuda.max_memory_allocated() / 2**20 if w.cuda else 0.0
            peak = torch.tensor([_rss_mb(), gpu_mb], dtype=torch.float64, device=w.device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            results[name]["peak_rss_mb"] = peak[0].item()
            if w.cuda:
                results[name]["peak_gpu_mb"] = peak[1].item()
        if name.startswith("dc_"):
            graphs = v.model.graphs
            results[name]["plan"] = {
                "planned_by": [g.planned_by for g in graphs],
                "buckets_mb": [round(b.nbytes / 1e6, 2) for g in graphs for b in g.plan.buckets],
                "segments": sum(len(g.plan.segments) for g in graphs),
                "pieces": sum(len(g.plan.pieces) for g in graphs),
                "pieces_reused": sum(g.pieces_reused for g in graphs),
                "cache_hits": sum(g.cache_hits for g in graphs),
                "sources": {k: sum(g.piece_sources.get(k, 0) for g in graphs) for k in SOURCES},
                "predicted_ms": sum((g.plan.predicted_s or 0.0) for g in graphs) * 1e3,
            }
        w.say(f"{name}: first step {first:.2f} s")
        variants.append(v)
    return variants


def _run_rounds(w: Workload, variants: list[Variant], results: dict[str, dict]) -> None:
    # Every variant compiled during warm-up: a compile now would be timed (and would read
    # whatever optimize_ddp is in force), so TorchDynamo refuses to recompile.
    with torch.compiler.set_stance("fail_on_recompile"):
        for r in range(w.args.rounds):
            for v in variants:
                t0 = time.perf_counter()
                for _ in range(w.args.block):
                    cpu0 = time.process_time()
                    seconds = v.step(w)
                    if not w.cuda:
                        v.times.append(seconds)
                        v.cpu.append(time.process_time() - cpu0)
                    if v.name.startswith("dc_"):
                        results[v.name].setdefault("_figures", []).append(v.model.last_step.figures())
                if w.cuda:  # one wait per block: the host runs ahead within it, as in training
                    w.sync()
                    v.read_events()
                    results[v.name].setdefault("_wall", []).append((time.perf_counter() - t0) / w.args.block)
            w.say(f"round {r + 1}/{w.args.rounds} done")


def _summarize(w: Workload, variants: list[Variant], results: dict[str, dict], compute_step: float) -> None:
    for v in variants:
        # The slower rank gates every step; take each step's max over ranks.
        t = torch.tensor(v.times, dtype=torch.float64, device=w.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = [x * 1e3 for x in t.tolist()]
        r = results[v.name]
        r.update(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), steps=len(ms))
        if v.cpu:
            r.update(_cpu_figures(w, v.cpu, t.tolist()))
        if "_wall" in r:
            wall = torch.tensor(r.pop("_wall"), dtype=torch.float64, device=w.device)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            r["wall_ms"] = statistics.median(wall.tolist()) * 1e3
    # On GPUs the compute-only step is the compiled model without DDP, when it ran.
    compute_step = compute_step or results.get("compile_noddp", {}).get("median_ms", 0.0)
    for v in variants:
        r = results[v.name]
        if v.name.startswith("dc_"):
            r.update(mean_figures(r.pop("_figures")))  # this rank's (rank 0 writes the report)
            r["tail_mb"] = v.model.last_step.tail_bytes / 1e6
        if compute_step:
            r["over_compute_ms"] = r["median_ms"] - compute_step


def _cpu_figures(w: Workload, cpu: list[float], steps: list[float]) -> dict:
    """The CPU the job spends a step, and how busy that keeps this machine's cores.

    ``cpu_ms``: each step's CPU time summed over the ranks (every thread of each rank's
    process, gloo's included), over the ranks: the median. ``busy_pct``: that sum over the
    step's wall time times the cores this process may run on, median over steps. Near 100%
    the step is set by the CPU work the ranks share the cores with, not by waiting: overlap
    can hide communication's wait but not the CPU time the all-reduces themselves take
    (every rank of the benchmark runs on this one machine).
    """
    job = torch.tensor(cpu, dtype=torch.float64, device=w.device)
    dist.all_reduce(job)
    cores = len(os.sched_getaffinity(0))
    busy = [c / (cores * s) for c, s in zip(job.tolist(), steps) if s > 0]
    return {
        "cpu_ms": statistics.median(job.tolist()) / w.world * 1e3,
        "busy_pct": 100 * statistics.median(busy),
    }


def _meta(w: Workload) -> dict:
    a = w.args
    return {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "distcompile": distcompile.__version__,
        "world_size": w.world,
        "ranks_per_gpu": a.ranks_per_gpu if w.cuda else 0,
        "rounds": a.rounds,
        "block": a.block,
        "warmup": a.warmup,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "device": w.device.type,
        **(gpu_meta() if w.cuda else {}),
        "model": f"GPT {w.nparams / 1e6:.2f}M parameters ({w.cfg}), batch {w.batch}; DDP bucket_cap_mb "
        + (f"{a.bucket_cap_mb:g}" if a.bucket_cap_mb else "default (25 MiB, first bucket 1 MiB)"),
    }
