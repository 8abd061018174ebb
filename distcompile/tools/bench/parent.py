"""The overlap benchmark: distcompile against eager DDP and torch.compile's own DDP paths.

One invocation runs every variant on the same model, data and link, in alternating
blocks of steps so machine drift cancels, and reports step time against a physical floor
computed from measured compute and link speed:

    floor = t_fwd + max(t_bwd + t_tail, t_head + t_comm) + t_opt

``t_fwd``, ``t_bwd``, ``t_opt``: every rank computing at once without communication;
``t_head``: backward time until the first gradient is final; ``t_comm``: all-reducing
every gradient byte on the link, measured alone; ``t_tail``: the same for the gradients
that are final only when backward ends (the first forward operation's parameters: here
the embeddings), which no schedule can hide.

Links: ``loopback``, or a real shaped link (``1gbit``, ``200mbit``): two network
namespaces joined by a veth pair, both ends limited with ``tc ... tbf``, one rank in each.
Everything created is removed on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...runtime.measure import time_allreduce
from .netns import can_make_namespaces, veth_pair

__all__ = ["main", "VARIANTS"]

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
_RATES = {"1gbit": 1e9, "200mbit": 200e6}


# ----------------------------------------------------------------------------- parent side
@contextlib.contextmanager
def _shaped_link(link: str) -> Iterator[tuple[list[str], list[str], list[str]] | None]:
    """Two namespaces joined by a tbf-shaped veth pair; yields (namespaces, devices, addresses)."""
    reason = can_make_namespaces() if link != "loopback" else None
    if link == "loopback" or reason:
        if reason:
            print(
                f"[bench] cannot shape a {link} link here ({reason}); running on loopback instead", flush=True
            )
        yield None
        return
    # SIGTERM would skip the cleanup; turn it into an exception that unwinds through it.
    old = signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with veth_pair("10.213.9", rate=link) as pair:
            print(
                f"[bench] shaped link: {link} between namespaces {pair.namespaces[0]} ({pair.addresses[0]}) "
                f"and {pair.namespaces[1]} ({pair.addresses[1]})",
                flush=True,
            )
            yield list(pair.namespaces), list(pair.devices), list(pair.addresses)
    finally:
        signal.signal(signal.SIGTERM, old)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace, extra: list[str], net: tuple | None, cache_dir: str, out: str) -> None:
    port = _free_port() if net is None else 29533
    master = "127.0.0.1" if net is None else net[2][0]
    procs = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
        env["GLOO_SOCKET_IFNAME"] = "lo" if net is None else net[1][rank]
        cmd = [
            sys.executable,
            "-m",
            "distcompile.tools.bench.worker",
            "--worker",
            "--rank",
            str(rank),
            "--master",
            master,
            "--port",
            str(port),
            "--out",
            out,
            *extra,
        ]
        if net is not None:
            cmd = ["ip", "netns", "exec", net[0][rank], *cmd]
        procs.append(subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise SystemExit(f"[bench] a rank failed (exit codes {codes}); see the output above")


def _first_steps(
    args: argparse.Namespace, name: str, common: list, net: object, cache: str, out: dict
) -> None:
    # Each variant alone in new processes, first with an empty compile cache of its own, then
    # with the cache that run filled: no variant pays or skips another's one-time costs
    # (imports, Inductor's compile workers and headers), and the peak RSS is the variant's.
    only = ["--variants", name, *common[2:], "--first-step-only"]
    runs = {}
    for phase in ("cold", "warm"):
        path = os.path.join(os.path.dirname(cache), f"{phase}-{name}.json")
        _launch(args, only, net, cache, path)
        with open(path) as f:
            runs[phase] = json.load(f)["variants"][name]
    r = out.get(name, {})
    if "error" in r or any("first_step_s" not in x for x in runs.values()):
        return
    r.update(
        cold_first_step_s=runs["cold"]["first_step_s"],
        warm_first_step_s=runs["warm"]["first_step_s"],
        peak_rss_mb=runs["warm"]["peak_rss_mb"],
        cold_peak_rss_mb=runs["cold"]["peak_rss_mb"],
    )
    if "plan" in r:
        r["plan"]["warm_cache_hits"] = runs["warm"]["plan"]["cache_hits"]


def _fmt(x: float | None, unit: str = "", nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def _peak(r: dict, ddp: dict) -> str:
    if "peak_rss_mb" not in r:
        return "-"
    ratio = f" ({r['peak_rss_mb'] / ddp['peak_rss_mb']:.2f}x)" if ddp.get("peak_rss_mb") else ""
    return f"{r['peak_rss_mb']:.0f}{ratio}"


def _table(res: dict) -> str:
    rows = [
        (
            "variant",
            "median ms",
            "min",
            "max",
            "vs DDP",
            "vs DDPOpt",
            "vs floor",
            "vs CPU floor",
            "exposed ms",
            "overlap %",
            "cold s",
            "warm s",
            "peak RSS MB",
        )
    ]
    v = res["variants"]
    base, ddpopt, floor = (
        v.get("ddp", {}).get("median_ms"),
        v.get("compile_ddpopt", {}).get("median_ms"),
        res["floor"]["floor_ms"],
    )
    for name, r in v.items():
        if "error" in r:
            rows.append((name, "failed: " + r["error"][:60], *[""] * 11))
            continue
        m = r["median_ms"]
        rows.append(
            (
                name,
                _fmt(m),
                _fmt(r["min_ms"]),
                _fmt(r["max_ms"]),
                _fmt(m / base if base else None, "x", 3),
                _fmt(m / ddpopt if ddpopt else None, "x", 3),
                _fmt(m / floor, "x", 3),
                _fmt(m / res["floor"]["cpu_floor_ms"] if "cpu_floor_ms" in res["floor"] else None, "x", 3),
                _fmt(r.get("exposed_ms")),
                _fmt(r.get("overlap_pct")),
                _fmt(r.get("cold_first_step_s"), "", 2),
                _fmt(r.get("warm_first_step_s"), "", 2),
                _peak(r, v.get("ddp", {})),
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    f = res["floor"]
    lines.append("")
    lines.append(
        f"floor {f['floor_ms']:.1f} ms = t_fwd {f['t_fwd_ms']:.1f} + max(t_bwd {f['t_bwd_ms']:.1f} + t_tail "
        f"{f['t_tail_ms']:.1f}, t_head {f['t_head_ms']:.1f} + t_comm {f['t_comm_ms']:.1f}) + t_opt {f['t_opt_ms']:.1f}"
    )
    if "cpu_floor_ms" in f:
        lines.append(
            f"CPU-aware floor {f['cpu_floor_ms']:.1f} ms = floor + CPU cost of communication under backward "
            f"{f['cpu_comm_ms']:.1f} + rank skew {f['skew_ms']:.1f}"
        )
    lines.append(
        f"gradients {f['grad_mb']:.1f} MB; link all-reduce alone: {f['t_comm_ms']:.1f} ms "
        f"({f['busbw_gbit']:.2f} Gbit/s bus bandwidth)"
    )
    return "\n".join(lines)


def _report(res: dict) -> str:
    m = res["meta"]
    return (
        "\n".join(
            [
                f"# Overlap benchmark, {m['link']} link, {m['date']}",
                "",
                f"- machine: {m['machine']}",
                f"- link: {m['link_detail']}",
                f"- versions: torch {m['torch']}, python {m['python']}, distcompile {m['distcompile']}",
                f"- model: {m['model']}; {m['world_size']} gloo ranks, 1 thread each",
                f"- steps: {m['rounds']} rounds x {m['block']} steps per variant, alternating; "
                f"warm-up {m['warmup']} steps each",
                f"- command: `{m['command']}`",
                "",
                "```",
                _table(res),
                "```",
                "",
                "exposed ms: time `backward()` waited for communication (distcompile's own figure); for the other "
                "variants, step time minus the compute-only step (an estimate). overlap %: share of all-reduce "
                "time that ran under computation (distcompile telemetry; not measurable for the others). cold s / "
                "warm s: the first step of the variant alone in a new pair of processes, with an empty compile cache of "
                "its own / with the cache that run filled. peak RSS MB: the larger rank's peak resident memory in the "
                "warm process, which built only this variant and ran its warm-up steps (ratio to eager DDP's).",
                "",
                "Plans of the distcompile variants (buckets in launch order, MB):",
                "",
                *[
                    f"- {n}: {r['plan']['buckets_mb']} ({'; '.join(sorted(set(r['plan']['planned_by'])))})"
                    for n, r in res["variants"].items()
                    if "plan" in r
                ],
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (parent) or one rank of it (``--worker``).

    Example:
        >>> # python benchmarks/overlap.py --link 1gbit      # or: distcompile bench --link 1gbit
    """
    p = argparse.ArgumentParser(
        prog="distcompile bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--link", choices=("loopback", *_RATES), default="loopback")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS)
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=5, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a tiny model (for tests)")
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP bucket_cap_mb for every variant (default: DDP's default)",
    )
    p.add_argument(
        "--no-first-steps",
        action="store_true",
        help="skip the cold and warm first steps and peak RSS (each variant alone, in new processes)",
    )
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if args.worker:
        _worker(args, names)
        # The results are on disk. Skip interpreter teardown: about one worker in three that
        # had just compiled with an empty cache aborted there ("terminate called without an
        # active exception", SIGABRT), after its work was done; not diagnosed further.
        sys.stdout.flush()
        os._exit(0)

    common = [
        "--variants",
        ",".join(names),
        "--rounds",
        str(args.rounds),
        "--block",
        str(args.block),
        "--warmup",
        str(args.warmup),
    ] + (["--small"] if args.small else [])
    with tempfile.TemporaryDirectory(prefix="dc_bench_") as tmp, _shaped_link(args.link) as net:
        cache = os.path.join(tmp, "inductor_cache")
        out = os.path.join(tmp, "result.json")
        print(
            f"[bench] {len(names)} variants on a {args.link if net else 'loopback'} link; cold compile cache "
            f"{cache}",
            flush=True,
        )
        _launch(args, common, net, cache, out)
        with open(out) as f:
            res = json.load(f)
        for k, name in enumerate([] if args.no_first_steps else names):
            print(
                f"[bench] first steps of {name} alone ({k + 1}/{len(names)}): empty compile cache, then the "
                "cache it filled",
                flush=True,
            )
            _first_steps(args, name, common, net, os.path.join(tmp, f"cache-{name}"), res["variants"])
    link = args.link if net else "loopback"
    res["meta"].update(
        link=link,
        link_detail=(
            f"veth pair between two network namespaces, both ends shaped with tc tbf rate {link}"
            if net
            else "loopback (127.0.0.1), unshaped"
        ),
        command=" ".join(["python benchmarks/overlap.py", *(argv if argv is not None else sys.argv[1:])]),
    )
    table = _table(res)
    print("\n" + table)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(
        args.out_dir, f"{res['meta']['date']}-overlap-{link}" + ("-small" if args.small else "")
    )
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(_report(res))
    print(f"\n[bench] wrote {stem}.json and {stem}.md")
    return 0


# ----------------------------------------------------------------------------- rank side
@dataclass
class _Variant:
    name: str
    model: object
    opt: object
    step: Callable[[], float]
    times: list


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(args: argparse.Namespace, names: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distcompile
    from distcompile import _torch_compat as compat
    from distcompile.capture.graph import own_forward_code
    from distcompile.models import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=2
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print("[bench]", *a, flush=True)) if rank == 0 else (lambda *a: None)
    if args.small:
        cfg, batch = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64), 4
    else:
        cfg, batch = GPTConfig(vocab_size=8192, block_size=128, n_layer=4, n_head=4, n_embd=256), 8
    data = [synthetic_batch(cfg, batch_size=batch, step=s, rank=rank) for s in range(8)]
    counter = [0]

    def next_batch() -> tuple:
        counter[0] += 1
        return data[counter[0] % len(data)]

    def fresh(tag: str = "plain") -> torch.nn.Module:
        # A private forward code object per variant: with a shared one every call evaluated
        # every variant's guards (measured: 4-5x slower steps on the small model).
        torch.manual_seed(0)
        return own_forward_code(GPT(cfg), tag)

    nparams = sum(p.numel() for p in GPT(cfg).parameters())

    def measure_floor() -> tuple[dict, float]:
        # ---- compute-only figures: every rank computes at once, no communication
        plain = fresh()
        popt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
        grad_bytes = nparams * 4
        first_ready: list[float] = []
        hooks = [
            p.register_post_accumulate_grad_hook(lambda _p: first_ready.append(time.perf_counter()))
            for p in plain.parameters()
        ]
        fwd, bwd, opt_t, head = [], [], [], []
        for i in range(args.warmup + 10):
            x, y = next_batch()
            t0 = time.perf_counter()
            loss = GPT.loss(plain(x), y)
            t1 = time.perf_counter()
            first_ready.clear()
            loss.backward()
            t2 = time.perf_counter()
            popt.step()
            popt.zero_grad()
            t3 = time.perf_counter()
            if i >= args.warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                opt_t.append(t3 - t2)
                head.append(min(first_ready) - t1)
        for h in hooks:
            h.remove()
        tail_bytes = sum(p.numel() * 4 for n, p in plain.named_parameters() if n.startswith(("wte", "wpe")))

        # ---- the link alone: all-reduce every gradient byte, and the tail bytes
        t_comm = time_allreduce(grad_bytes, pick=statistics.median) * 1e3
        t_tail = t_comm * tail_bytes / grad_bytes  # the link is linear in bytes at these sizes
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        floor = {
            "t_fwd_ms": med(fwd),
            "t_bwd_ms": med(bwd),
            "t_opt_ms": med(opt_t),
            "t_head_ms": med(head),
            "t_comm_ms": t_comm,
            "t_tail_ms": t_tail,
            "grad_mb": grad_bytes / 1e6,
            "busbw_gbit": 2 * (world - 1) / world * grad_bytes * 8 / (t_comm / 1e3) / 1e9,
        }
        floor["floor_ms"] = (
            floor["t_fwd_ms"]
            + max(floor["t_bwd_ms"] + t_tail, floor["t_head_ms"] + t_comm)
            + floor["t_opt_ms"]
        )
        # ---- the CPU-aware floor: on few cores, communication takes CPU from backward (kernel
        # network work, gloo's threads), and the slower rank gates every step.
        buf = torch.zeros(grad_bytes // 4)
        loaded = []
        for i in range(args.warmup + 6):
            x, y = next_batch()
            loss = GPT.loss(plain(x), y)
            dist.barrier()
            work = dist.all_reduce(buf, async_op=True)  # all gradient bytes, under backward
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            work.wait()
            popt.zero_grad()
            if i >= args.warmup:
                loaded.append(t2 - t1)
        per_step = torch.tensor([a + b + c for a, b, c in zip(fwd, bwd, opt_t)], dtype=torch.float64)
        slowest, total = per_step.clone(), per_step.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        floor["cpu_comm_ms"] = max(0.0, med(loaded) - floor["t_bwd_ms"])
        floor["skew_ms"] = statistics.median((slowest - total / world).tolist()) * 1e3
        floor["cpu_floor_ms"] = floor["floor_ms"] + floor["cpu_comm_ms"] + floor["skew_ms"]
        compute_step = floor["t_fwd_ms"] + floor["t_bwd_ms"] + floor["t_opt_ms"]
        say(
            f"compute-only step {compute_step:.1f} ms; all-reduce of {grad_bytes / 1e6:.1f} MB alone "
            f"{t_comm:.1f} ms; floor {floor['floor_ms']:.1f} ms"
        )
        return floor, compute_step

    # The warm-cache pass only times first steps and peak memory; it needs no floor.
    floor, compute_step = ({}, 0.0) if args.first_step_only else measure_floor()

    # ---- the variants
    def ddp_step(
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        ctx: Callable = contextlib.nullcontext,
        mode: object = None,
    ) -> Callable[[], float]:
        # PyTorch's DDPOptimizer switch is read while compiling (and by DDP when built):
        # each variant's steps run under its own setting, restored afterwards.
        ddp_mode = (lambda: compat.set_optimize_ddp(mode)) if mode is not None else contextlib.nullcontext

        def step() -> float:
            with ddp_mode():  # entered outside the timed region
                x, y = next_batch()
                t0 = time.perf_counter()
                with ctx():
                    loss = GPT.loss(model(x), y)
                    loss.backward()
                opt.step()
                opt.zero_grad()
                return time.perf_counter() - t0

        return step

    def distinct_inductor() -> Callable:
        # A backend object per variant: TorchDynamo caches compiled code per backend, so
        # variants compiled from the same DDP.forward never reuse each other's graphs.
        compile_fx = compat.inductor_compiler(mode=None, dynamic=None, cudagraphs=False)
        return lambda gm, ex: compile_fx(gm, ex)

    def build(name: str) -> _Variant:
        # Read when DDP is built: "python_reducer" makes DDP all-reduce from Python hooks.
        # Every variant gets the same DDP bucketing: DDP's defaults (25 MiB, 1 MiB first bucket)
        # unless --bucket-cap-mb is given, which (as in DDP) also sets the first bucket's size.
        with compat.set_optimize_ddp("python_reducer" if name == "compiled_autograd" else True):
            ddp = DDP(fresh(name), **({"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb else {}))
        mode, ctx = None, contextlib.nullcontext
        if name == "ddp":
            model = ddp
        elif name == "ddp_fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            model = ddp
        elif name in ("compile_ddpopt", "compile_noopt"):
            mode = name == "compile_ddpopt"
            model = torch.compile(ddp, backend=distinct_inductor())
        elif name == "compiled_autograd":
            mode = "python_reducer"
            model = torch.compile(ddp, backend=distinct_inductor())
            ctx = compat.compiled_autograd
        else:
            logdir = tempfile.mkdtemp(prefix=f"dc_{name}_")
            model = distcompile.wrap(
                ddp,
                backend="aot_eager" if name == "dc_aot_eager" else "inductor",
                bucket_cap_mb="auto" if name.startswith("dc_auto") else None,
                compression="bf16" if "bf16" in name else None,
                compression_scope="tail" if name.endswith("tail") else "all",
                logdir=logdir,
                trace_every=0,
                figure_every=0,
            )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return _Variant(name, model, opt, ddp_step(model, opt, ctx, mode), [])

    results: dict[str, dict] = {}
    variants: list[_Variant] = []
    # Built last: DDP with optimize_ddp="python_reducer" sets Inductor's global
    # _fuse_ddp_communication for the rest of the process, which changes the compile-cache
    # key of every later Inductor compile (measured: the distcompile variants built after it
    # missed the cache in their warm-start process).
    for name in sorted(names, key=lambda n: n == "compiled_autograd"):
        say(f"building and compiling {name} ({VARIANTS[name]}) ...")
        rss0 = _rss_mb()
        try:
            v = build(name)
            first = v.step()
            for _ in range(args.warmup):
                v.step()
        except Exception as exc:  # noqa: BLE001 - the report says which variant failed and why
            results[name] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
            say(f"{name} failed: {results[name]['error']}")
            continue
        results[name] = {"first_step_s": first, "rss_mb": _rss_mb() - rss0}
        if args.first_step_only:  # this process built only this variant: its peak is the variant's
            peak = torch.tensor([_rss_mb()], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            results[name]["peak_rss_mb"] = peak.item()
        if name.startswith("dc_"):
            results[name]["plan"] = {
                "planned_by": [g.planned_by for g in v.model.graphs],
                "buckets_mb": [round(b.nbytes / 1e6, 2) for g in v.model.graphs for b in g.plan.buckets],
                "segments": sum(len(g.plan.segments) for g in v.model.graphs),
                "cache_hits": sum(g.cache_hits for g in v.model.graphs),
            }
        say(f"{name}: first step {first:.2f} s")
        variants.append(v)
    if not args.first_step_only:
        for r in range(args.rounds):
            for v in variants:
                for _ in range(args.block):
                    v.times.append(v.step())
                    if v.name.startswith("dc_"):
                        s = v.model.last_step
                        results[v.name].setdefault("_exposed", []).append(s.exposed_comm_ms)
                        results[v.name].setdefault("_overlap", []).append(s.overlap_pct)
            say(f"round {r + 1}/{args.rounds} done")
        for v in variants:
            # The slower rank gates every step; take each step's max over ranks.
            t = torch.tensor(v.times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ms = [x * 1e3 for x in t.tolist()]
            r = results[v.name]
            r.update(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), steps=len(ms))
            if v.name.startswith("dc_"):
                r["exposed_ms"] = statistics.median(r.pop("_exposed"))
                r["overlap_pct"] = statistics.median(r.pop("_overlap"))
            else:
                r["exposed_ms"] = max(0.0, r["median_ms"] - compute_step)
    if rank == 0:
        import distcompile as dc

        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "distcompile": dc.__version__,
            "world_size": world,
            "rounds": args.rounds,
            "block": args.block,
            "warmup": args.warmup,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "model": f"GPT {nparams / 1e6:.2f}M parameters ({cfg}), batch {batch}; DDP bucket_cap_mb "
            + (f"{args.bucket_cap_mb:g}" if args.bucket_cap_mb else "default (25 MiB, first bucket 1 MiB)"),
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "floor": floor, "variants": {n: results[n] for n in names}}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
