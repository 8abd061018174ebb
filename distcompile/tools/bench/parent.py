"""The overlap benchmark, parent side: launch the two ranks, the first-step runs, the report.

One invocation runs every variant on the same model, data and link, in alternating
blocks of steps so machine drift cancels, and reports step time against a physical floor
computed from measured compute and link speed (``floor.py`` defines the terms):

    floor = t_fwd + max(t_bwd + t_tail, t_head + t_comm) + t_opt

Links: ``loopback``, or a real shaped link (``1gbit``, ``200mbit``): two network
namespaces joined by a veth pair, both ends limited with ``tc ... tbf``, one rank in each;
with ``--nodes`` above 2, that many namespaces on a switch whose ports are shaped so, and
``--ranks-per-node`` ranks in each (their traffic inside a node is unshaped, as on a real
node). Everything created is removed on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from .netns import can_make_namespaces, star, veth_pair
from .report import report_markdown, table, write_results
from .scaling import SCALING_DEFAULT, run_scaling
from .sharing import run_sharing
from .variants import CPU_DEFAULT, CUDA_DEFAULT, CUDA_ONLY, SHARED_GPU_DEFAULT, VARIANTS

__all__ = ["main"]

_RATES = {"1gbit": 1e9, "200mbit": 200e6}


# ----------------------------------------------------------------------------- parent side
def _check_device(p: argparse.ArgumentParser, args: argparse.Namespace, names: list[str]) -> None:
    """Set ``args.world`` (GPUs present on cuda, else nodes x ranks per node); refuse what the
    device cannot run."""
    if args.device == "cpu":
        if args.nodes < 1 or args.ranks_per_node < 1 or args.nodes * args.ranks_per_node < 2:
            p.error(f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node}: give at least 2 ranks")
        args.world = args.nodes * args.ranks_per_node
        cuda_only = [n for n in names if n in CUDA_ONLY]
        if cuda_only:
            p.error(f"variant(s) {cuda_only} need CUDA graphs, hence a GPU; add --device cuda or drop them")
        if args.ranks_per_gpu != 1:
            p.error("--ranks-per-gpu places ranks on GPUs; add --device cuda, or drop it for two CPU ranks")
        return
    import torch  # the parent imports torch only to count GPUs

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus:
        p.error(
            f"--device cuda: no CUDA GPU found (torch {torch.__version__}, torch.cuda.is_available() is "
            "False). Run without --device for CPU ranks on gloo, or on a machine with GPUs and a CUDA build of torch."
        )
    if args.link != "loopback":
        p.error(
            f"--link {args.link} shapes the link between two CPU ranks (gloo); with --device cuda the "
            "ranks use NCCL between this machine's GPUs. Drop --link or --device cuda."
        )
    if args.ranks_per_gpu < 1:
        p.error(f"--ranks-per-gpu {args.ranks_per_gpu}: give 1 (NCCL, one rank per GPU) or more (gloo)")
    args.world = gpus * args.ranks_per_gpu


@contextlib.contextmanager
def _shaped_link(link: str, nodes: int = 2) -> Iterator[tuple[list[str], list[str], list[str]] | None]:
    """``nodes`` namespaces on tbf-shaped links (a veth pair for 2, a switch for more); yields
    (namespaces, devices, addresses), one entry per node."""
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
        with veth_pair("10.213.9", rate=link) if nodes == 2 else star("10.213.12", nodes, rate=link) as net:
            where = ", ".join(f"{ns} ({addr})" for ns, addr in zip(net.namespaces, net.addresses))
            print(f"[bench] shaped link: {link} between namespaces {where}", flush=True)
            yield list(net.namespaces), list(net.devices), list(net.addresses)
    finally:
        signal.signal(signal.SIGTERM, old)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    args: argparse.Namespace, extra: list[str], net: tuple | None, cache_dir: str | list[str], out: str
) -> None:
    port = _free_port() if net is None else 29533
    master = "127.0.0.1" if net is None else net[2][0]
    procs = []
    for rank in range(args.world):
        cache = cache_dir if isinstance(cache_dir, str) else cache_dir[rank]  # a folder per rank: a node each
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
        node = rank // args.ranks_per_node if args.device == "cpu" else 0
        env["GLOO_SOCKET_IFNAME"] = "lo" if net is None else net[1][node]
        cmd = [
            sys.executable,
            "-m",
            "distcompile.tools.bench",
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
            cmd = ["ip", "netns", "exec", net[0][node], *cmd]
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


def _link(args: argparse.Namespace, net: object) -> tuple[str, str]:
    """The link's name (in the result's file name) and what it is, for the report."""
    if args.device == "cuda" and args.ranks_per_gpu > 1:
        return (
            f"cuda-{args.ranks_per_gpu}-per-gpu",
            f"gloo between {args.world} ranks, {args.ranks_per_gpu} on each GPU: all-reduces through host memory",
        )
    if args.device == "cuda":
        return "cuda", f"NCCL between {args.world} GPU(s) of this machine"
    if net and (len(net[0]) > 2 or args.ranks_per_node > 1):
        return (
            f"{args.link}-{len(net[0])}x{args.ranks_per_node}",
            f"{len(net[0])} network namespaces ('nodes') of {args.ranks_per_node} rank(s), "
            + ("joined by a veth pair" if len(net[0]) == 2 else "on one switch (a bridge)")
            + f", each node's port shaped both ways with tc tbf rate {args.link}; unshaped inside a node",
        )
    if net:
        return (
            args.link,
            f"veth pair between two network namespaces, both ends shaped with tc tbf rate {args.link}",
        )
    return "loopback", "loopback (127.0.0.1), unshaped"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distcompile bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--link", choices=("loopback", *_RATES), default="loopback")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks (--nodes x --ranks-per-node, on --link); cuda: one NCCL rank per GPU present",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=2,
        help="cpu: 'nodes' (network namespaces on --link; processes on loopback) of --ranks-per-node ranks",
    )
    p.add_argument("--ranks-per-node", type=int, default=1, help="cpu: ranks in each node (default 1)")
    p.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        help="cuda: ranks sharing each GPU; above 1 they use gloo, whose all-reduces go through host "
        "memory (a slow link next to a fast GPU: overlap with real GPU compute, on one GPU)",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of: "
        + ", ".join(VARIANTS)
        + f". Default on cpu: {','.join(CPU_DEFAULT)}; "
        f"on cuda: {','.join(CUDA_DEFAULT)}; with --ranks-per-gpu above 1: {','.join(SHARED_GPU_DEFAULT)}",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=5, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a tiny model (for tests)")
    p.add_argument(
        "--workload",
        choices=("gpt", "tied"),
        default="gpt",
        help="cpu: gpt, a 4-layer GPT, 1024 tokens a step per rank (its tied embedding 40%% of the "
        "parameters); tied, GPT-2 small's proportions (6 layers, embedding 31%% of the parameters) "
        "with 256 tokens a step, so communication weighs as it does next to a GPU",
    )
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
    p.add_argument(
        "--first-steps-of", default=None, help="measure first steps of these variants only (comma list)"
    )
    _add_modes(p)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument(
        "--trace-dir",
        default="",
        help="also write a profiler trace of 3 warm steps of each variant (rank 0) here, as "
        "trace-<variant>.json.gz, for Perfetto",
    )
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the GPT's layer count (default: the workload's; --compile-scaling takes --depths)",
    )
    p.add_argument("--recompile", action="store_true", help=argparse.SUPPRESS)
    return p


def _add_modes(p: argparse.ArgumentParser) -> None:
    """The modes that measure something other than step times."""
    p.add_argument(
        "--compile-scaling",
        action="store_true",
        help="instead of step times: cold and warm first step, and a recompile after a sequence-length "
        "change, against depth (--depths), each variant alone with its own empty compile cache",
    )
    p.add_argument("--depths", default="2,8,16,32", help="layer counts of the compile-scaling mode")
    p.add_argument(
        "--compile-sharing",
        action="store_true",
        help="instead of step times: the job's first step with one cache folder per rank (compiles "
        "shared between the folders, or not) against one shared folder, cold, and at a restart with one "
        "folder emptied against both warm",
    )
    p.add_argument("--host-overhead", action="store_true", help="instead: host time per step (its own -h)")


def _variant_names(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    if args.variants is None:
        default = (
            SCALING_DEFAULT
            if args.compile_scaling
            else SHARED_GPU_DEFAULT
            if args.device == "cuda" and args.ranks_per_gpu > 1
            else CUDA_DEFAULT
            if args.device == "cuda"
            else CPU_DEFAULT
        )
        args.variants = ",".join(default)
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    return names


def _refuse_moved(p: argparse.ArgumentParser, given: list[str]) -> None:
    """Harnesses of the checkout, not of the installed package: say where each went."""
    moved = {"--chaos": "benchmarks/run_chaos.py", "--control-plane": "benchmarks/control_plane.py"}
    for flag, script in moved.items():
        if flag in given:
            p.error(f"{flag} is not part of the installed package: from a checkout, run python {script}")


def _refuse_moved(p: argparse.ArgumentParser, given: list[str]) -> None:
    """Harnesses of the checkout, not of the installed package: say where each went."""
    moved = {"--chaos": "benchmarks/run_chaos.py", "--control-plane": "benchmarks/control_plane.py"}
    for flag, script in moved.items():
        if flag in given:
            p.error(f"{flag} is not in the installed package: from a checkout, run python {script}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (parent) or one rank of it (``--worker``).

    Example:
        >>> # python benchmarks/overlap.py --link 1gbit      # or: distcompile bench --link 1gbit
    """
    given = sys.argv[1:] if argv is None else argv
    if "--host-overhead" in given:
        from .host import main as host_main  # its own options

        return host_main(argv)
    p = _parser()
    _refuse_moved(p, given)
    args = p.parse_args(argv)
    names = _variant_names(p, args)
    if not args.worker:
        _check_device(p, args, names)
    if args.worker:
        from .worker import run_worker  # imports torch: only in the rank processes

        run_worker(args, names)
        return 0

    if args.compile_scaling:
        return run_scaling(args, names, _launch, argv if argv is not None else sys.argv[1:])
    if args.compile_sharing:
        with _shaped_link(args.link, args.nodes) as net:
            return run_sharing(
                args, _launch, net, _link(args, net), argv if argv is not None else sys.argv[1:]
            )
    common = (
        [
            "--variants",
            ",".join(names),
            "--device",
            args.device,
            "--world",
            str(args.world),
            "--ranks-per-gpu",
            str(args.ranks_per_gpu),
            "--rounds",
            str(args.rounds),
            "--block",
            str(args.block),
            "--warmup",
            str(args.warmup),
            "--workload",
            args.workload,
        ]
        + (["--small"] if args.small else [])
        + (["--layers", str(args.layers)] if args.layers else [])
    )
    if args.trace_dir:
        common += ["--trace-dir", os.path.abspath(args.trace_dir)]
    with tempfile.TemporaryDirectory(prefix="dc_bench_") as tmp, _shaped_link(args.link, args.nodes) as net:
        cache = os.path.join(tmp, "inductor_cache")
        out = os.path.join(tmp, "result.json")
        link, detail = _link(args, net)
        print(f"[bench] {len(names)} variants, {detail}; cold compile cache {cache}", flush=True)
        _launch(args, common, net, cache, out)
        with open(out) as f:
            res = json.load(f)
        alone = (
            names
            if args.first_steps_of is None
            else [n for n in names if n in args.first_steps_of.split(",")]
        )
        for k, name in enumerate([] if args.no_first_steps else alone):
            print(
                f"[bench] first steps of {name} alone ({k + 1}/{len(alone)}): empty compile cache, then the "
                "cache it filled",
                flush=True,
            )
            _first_steps(args, name, common, net, os.path.join(tmp, f"cache-{name}"), res["variants"])
    res["meta"].update(
        link=link,
        link_detail=detail,
        command=" ".join(["python benchmarks/overlap.py", *(argv if argv is not None else sys.argv[1:])]),
    )
    text = table(res)
    print("\n" + text)
    name = f"{res['meta']['date']}-overlap-{link}" + ("-small" if args.small else "")
    name += "" if args.workload == "gpt" else f"-{args.workload}"
    write_results(args.out_dir, name, res, report_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
