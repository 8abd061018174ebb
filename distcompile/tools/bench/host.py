"""``distcompile bench --host-overhead``: what each variant costs the host per step, on a CPU proxy.

On a GPU a training step is a stream of kernel launches: if the host cannot issue them
faster than the GPU runs them, the step is bound by the host, and host work per piece,
per bucket and per parameter decides its time. That host work can be measured without a
GPU: a model of the GPU benchmark's layout at a width of 8 does next to no arithmetic, so
its step time on a CPU *is* its host work. The proxy keeps GPT-2 small's layout (12
pre-LN blocks, each just over the bucket cap as GPT-2 small's 27.04 MiB blocks are over
DDP's 25 MiB, a tied embedding large enough to be reduced by rows) and runs in one
process on a gloo world of one (no peer: the all-reduces return at once). The variants
are built in the same process and stepped in turn, round after round, so load on the
machine falls on all of them alike; each reports the median step time over the rounds,
the same under ``no_sync()`` (the difference is what gradient synchronization costs the
host: the reducer, and gloo's call per bucket), and, from more steps each, the Python
calls (``sys.setprofile``, the median of three steps), the operations torch's profiler records (aten operators
and compiled graphs' calls; the kernels inside a compiled C++ or Triton graph are not
separate events on CPU), the calls of those compiled C++ kernels (counted with the Python
calls), the time a step spends inside the code Inductor generated and outside it (the
host's own work, where the variants differ), and for distcompile its pieces and buckets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile import _torch_compat as compat
from distcompile.models import GPT, GPTConfig, synthetic_batch

__all__ = ["PROXY", "run_host_overhead"]

#: GPT-2 small's layout at a width of 8; the vocabulary makes the tied table 256 KiB (reduced by rows).
PROXY = GPTConfig(vocab_size=8192, block_size=16, n_layer=12, n_head=2, n_embd=8)
#: GPT-2 small's block (27.04 MiB) over DDP's cap (25 MiB).
_OVER_CAP = 27.04 / 25
BATCH = 2

#: Variant name -> description, in the order they step in a round.
HOST_VARIANTS = {
    "ddp": "eager DDP",
    "ddpopt": "torch.compile(DDP), DDPOptimizer",
    "regional": "each block torch.compile'd, eager DDP around it",
    "distcompile": "distcompile.wrap(DDP), inductor, telemetry off",
    "distcompile_telemetry": "distcompile.wrap(DDP), inductor, logdir= (telemetry on, its defaults)",
}
#: Variants stepped only when named in ``--variants``: what one option of ours costs or saves.
HOST_OPT_IN = {
    "distcompile_unsplit": "distcompile.wrap(DDP, split_shared=False): the tied table reduced whole, at the end",
}
_DESCRIPTIONS = {**HOST_VARIANTS, **HOST_OPT_IN}
#: distcompile variants -> their ``wrap`` options (``logdir`` is added where telemetry is on).
_WRAP_OPTIONS = {"distcompile_unsplit": {"split_shared": False}}


def _block_bytes(cfg: GPTConfig) -> int:
    block = GPT(cfg).blocks[0]
    return sum(p.numel() * p.element_size() for p in block.parameters())


def _build(name: str, cfg: GPTConfig, cap_mb: float, logdir: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg)
    if name == "regional":
        backend = compat.inductor_compiler(mode=None, dynamic=None, cudagraphs=False)
        for block in model.blocks:
            block.compile(backend=backend)
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    if name in ("ddp", "regional"):
        return ddp
    if name == "ddpopt":
        return torch.compile(ddp, backend=compat.inductor_compiler(mode=None, dynamic=None, cudagraphs=False))
    telemetry = {"logdir": logdir} if name.endswith("telemetry") else {}  # as users get it: traces, pictures
    return distcompile.wrap(ddp, backend="inductor", **telemetry, **_WRAP_OPTIONS.get(name, {}))


def _step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple,
    first_bucket: int = 0,
    *,
    sync: bool = True,
) -> float:
    x, y = batch
    t0 = time.perf_counter()
    with contextlib.ExitStack() as scope:
        if first_bucket:  # DDPOptimizer plans at its first call: caps of kilobytes
            scope.enter_context(compat.ddp_optimizer_first_bucket(first_bucket))
        if not sync:  # the same step with no gradient synchronization: what the reducer costs
            scope.enter_context(model.no_sync())
        loss = GPT.loss(model(x), y)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _calls(fn: Callable[[], object]) -> tuple[int, int]:
    """Python calls made while ``fn`` runs, and calls of the C++ kernels Inductor compiled (on
    CPU a compiled graph's fused kernels are functions of libraries in Inductor's cache, which
    the profiler does not see)."""
    calls = kernels = 0
    cache = compat.inductor_cache_dir()

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls, kernels
        if event == "call":
            calls += 1
        elif event == "c_call" and str(getattr(getattr(arg, "__self__", None), "__file__", "")).startswith(
            cache
        ):
            kernels += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, kernels


def _in_graphs(step: Callable[[tuple], float], batches: list[tuple]) -> dict:
    """Per step (the median over ``batches``): ms inside the graphs Inductor compiled (their
    generated code: kernels, ``mm``, buffers) and ms outside them (everything else the host
    does: eager operations, the autograd engine, AOTAutograd's and DDP's or distcompile's runtime)."""
    inside, outside = [], []
    with compat.inductor_graph_seconds() as spent:
        for batch in batches:
            spent[0] = 0.0
            total = step(batch)
            inside.append(spent[0])
            outside.append(total - spent[0])
    return {
        "in_graphs_ms": 1e3 * statistics.median(inside),
        "outside_graphs_ms": 1e3 * statistics.median(outside),
    }


def _profiled_ops(fn: Callable[[], object]) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages())


def run_host_overhead(*, rounds: int, block: int, warmup: int, variants: list[str]) -> dict:
    """Step each variant ``warmup`` times, then ``rounds`` rounds of ``block`` steps each in
    turn; return the figures (one process, a gloo world of one, set up here if needed).

    Example:
        >>> # figures = run_host_overhead(rounds=20, block=5, warmup=3, variants=list(HOST_VARIANTS))
    """
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    cfg = PROXY
    cap_mb = _block_bytes(cfg) / _OVER_CAP / 2**20
    batches = [synthetic_batch(cfg, batch_size=BATCH, step=s, rank=0) for s in range(8)]
    logdir = tempfile.mkdtemp(prefix="dc_host_")
    models = {n: _build(n, cfg, cap_mb, os.path.join(logdir, n)) for n in variants}
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
    print(f"[host] {len(variants)} variant(s): warming up (compiles)", flush=True)
    first = int(cap_mb * 2**20)
    for n in variants:
        for s in range(warmup):
            for sync in (True, False):
                _step(models[n], opts[n], batches[s % len(batches)], first_bucket=first, sync=sync)
    times: dict[str, list[float]] = {n: [] for n in variants}
    unsynced: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(rounds):
        for n in variants if r % 2 == 0 else list(reversed(variants)):
            b = [batches[(r + s) % len(batches)] for s in range(block)]
            times[n] += [_step(models[n], opts[n], x) for x in b]
            unsynced[n] += [_step(models[n], opts[n], x, sync=False) for x in b]
        if (r + 1) % max(1, rounds // 4) == 0:
            print(f"[host] round {r + 1}/{rounds}", flush=True)
    figures: dict[str, dict] = {}
    base = times.get("ddpopt")
    for n in variants:
        model, opt, batch = models[n], opts[n], batches[0]
        one = lambda model=model, opt=opt, batch=batch: _step(model, opt, batch)  # noqa: E731
        counted = [_calls(one) for _ in range(3)]
        split = _in_graphs(lambda x, model=model, opt=opt: _step(model, opt, x), batches * 3)
        row = {
            "description": _DESCRIPTIONS[n],
            "median_ms": 1e3 * statistics.median(times[n]),
            "no_sync_median_ms": 1e3 * statistics.median(unsynced[n]),
            "min_ms": 1e3 * min(times[n]),
            **(_paired(times[n], base) if base else {}),
            # The median of three steps: one step may draw telemetry's picture (matplotlib).
            "python_calls": int(statistics.median(c for c, _ in counted)),
            "compiled_kernels": int(statistics.median(k for _, k in counted)),
            "profiled_ops": _profiled_ops(one),
            **split,
        }
        if isinstance(model, distcompile.DistCompiledModule):
            row["pieces"] = sum(len(g.plan.pieces) for g in model.graphs)
            row["buckets"] = model.last_step.buckets
        figures[n] = row
    for m in models.values():
        if isinstance(m, distcompile.DistCompiledModule):
            m.close()
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s), one thread, a gloo world of one",
        "torch": torch.__version__,
        "model": f"{cfg} (block {_block_bytes(cfg)} B, bucket cap {cap_mb * 2**20:.0f} B), batch {BATCH}",
        "rounds": rounds,
        "steps_per_round": block,
        "variants": figures,
    }


def _paired(steps: list[float], base: list[float]) -> dict:
    """Each step over DDPOptimizer's step of the same round and batch: the median and quartiles
    of those ratios. Steady against the machine's speed, which moved by up to 40% within an
    hour here (2026-11-29): a ratio of medians taken over the whole run mixes fast and slow
    minutes.

    Example:
        >>> _paired([2.0, 4.0, 6.0], [1.0, 2.0, 4.0])
        {'paired_ratio': 2.0, 'paired_q1': 1.75, 'paired_q3': 2.0}
    """
    ratios = sorted(a / b for a, b in zip(steps, base))
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"paired_ratio": statistics.median(ratios), "paired_q1": q1, "paired_q3": q3}


def print_table(result: dict) -> None:
    """The figures as a table a person reads (``-``: not measured for that variant)."""
    rows = result["variants"]
    base = rows.get("ddpopt", {}).get("median_ms")
    print(
        f"\n{'variant':<22} {'median ms':>9} {'vs DDPOpt':>9} {'paired':>6} {'no_sync ms':>10} {'sync ms':>7} {'pieces':>6} "
        f"{'buckets':>7} {'Py calls':>9} {'ops':>6} {'kernels':>7} {'in graphs':>9} {'outside':>7}"
    )
    for n, r in rows.items():
        ratio = f"{r['median_ms'] / base:.2f}x" if base else "-"
        paired = f"{r['paired_ratio']:.3f}" if "paired_ratio" in r else "-"
        print(
            f"{n:<22} {r['median_ms']:>9.2f} {ratio:>9} {paired:>6} {r['no_sync_median_ms']:>10.2f} "
            f"{r['median_ms'] - r['no_sync_median_ms']:>7.2f} {r.get('pieces', '-'):>6} {r.get('buckets', '-'):>7} "
            f"{r['python_calls']:>9} {r['profiled_ops']:>6} {r.get('compiled_kernels', '-'):>7} "
            f"{r['in_graphs_ms']:>9.2f} {r['outside_graphs_ms']:>7.2f}"
        )
    print(
        "sync ms: the median step less the median step under no_sync() (what synchronizing gradients costs the host)"
    )
    print(
        "ops: events torch's profiler records; kernels: calls of the C++ kernels Inductor compiled (not in ops)"
    )
    print(
        "in graphs / outside: ms a step inside the code Inductor generated and outside it (the host's own work:"
        " eager ops, the autograd engine, AOTAutograd's, DDP's or distcompile's runtime), from other steps"
    )
    if base:
        print("paired: the median of each step over DDPOptimizer's step with the same round and batch")
    print(f"\n{result['model']}; {result['machine']}; torch {result['torch']}")


def main(argv: list[str] | None = None) -> int:
    """``distcompile bench --host-overhead``: run, print the table, write the JSON."""
    p = argparse.ArgumentParser(prog="distcompile bench --host-overhead", description=__doc__)
    p.add_argument("--host-overhead", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=5, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--variants",
        default=",".join(HOST_VARIANTS),
        help=f"comma-separated; the default runs {', '.join(HOST_VARIANTS)}; also: {', '.join(HOST_OPT_IN)}",
    )
    p.add_argument("--out-dir", default="benchmarks/results")
    args, _ = p.parse_known_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(_DESCRIPTIONS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(_DESCRIPTIONS)}")
    result = run_host_overhead(rounds=args.rounds, block=args.block, warmup=args.warmup, variants=names)
    print_table(result)
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, f"{time.strftime('%Y-%m-%d')}-host-overhead.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return 0
