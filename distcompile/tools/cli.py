"""The ``distcompile`` command line."""

from __future__ import annotations

import argparse
import os
import sys

from .._config import BACKENDS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distcompile", description="Compiled data-parallel training with overlapped all-reduce."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the example GPT with eager DDP and distcompile on local ranks")
    demo.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to launch (default: one per GPU, NCCL; 2 CPU ranks on gloo without a GPU)",
    )
    demo.add_argument("--steps", type=int, default=20, help="training steps per variant (default 20)")
    demo.add_argument(
        "--backend", choices=BACKENDS, default="inductor", help="segment compiler (default inductor)"
    )
    demo.add_argument("--logdir", default="runs/demo", help="TensorBoard directory (default runs/demo)")
    demo.add_argument(
        "--compare",
        action="store_true",
        help="also train with torch.compile(DDP) (DDPOptimizer) and regional compilation (each block compiled)",
    )
    demo.add_argument(
        "--link",
        choices=("loopback", "1gbit", "200mbit"),
        default="loopback",
        help="run 2 CPU ranks over a shaped link in network namespaces (root only; default loopback)",
    )
    exp = sub.add_parser("explain", help="show graphs, graph breaks, segments and buckets of the example GPT")
    exp.add_argument("--n-layer", type=int, default=4)
    exp.add_argument("--n-embd", type=int, default=128)
    exp.add_argument("--bucket-cap-mb", type=_mib, default=None, help="bucket cap (default: DDP's 25 MiB)")
    exp.add_argument("--first-bucket-cap-mb", type=_mib, default=None)
    report = sub.add_parser("report", help="summarize the telemetry a run wrote under LOGDIR")
    report.add_argument("logdir", help="the logdir given to distcompile.wrap (or distcompile demo)")
    events = sub.add_parser(
        "events", help="what happened to a job: its lives, restarts, resumes and first errors"
    )
    events.add_argument(
        "files", nargs="+", help="event logs the job wrote (DISTCOMPILE_EVENTS; the launchers' files)"
    )
    sub.add_parser(
        "bench",
        help="the overlap benchmark (all arguments go to it; see distcompile bench -h)",
        add_help=False,
    )
    return parser


def _mib(text: str) -> float:
    """A positive number of MiB, for argparse."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of MiB")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``distcompile`` console script.

    Example:
        >>> # $ distcompile demo            # 2 local ranks, eager DDP vs distcompile
    """
    parser = _parser()
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        from .bench.parent import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "explain":
        import torch

        from ..diagnostics.explain import explain
        from ..models import GPT, GPTConfig

        cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd)
        idx = torch.zeros(2, cfg.block_size, dtype=torch.long)
        print(f"example GPT: {cfg}")
        print(
            explain(
                GPT(cfg), idx, bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=args.first_bucket_cap_mb
            )
        )
        return 0
    if args.command == "report":
        from ..telemetry.report import find_runs, summarize

        runs = find_runs(args.logdir)
        if not runs:
            print(
                f"distcompile report: no distcompile telemetry under {args.logdir!r}. Pass the "
                "logdir given to distcompile.wrap(..., logdir=...).",
                file=sys.stderr,
            )
            return 1
        print("\n\n".join(summarize(r) for r in runs))
        return 0
    if args.command == "events":
        from .._events import summary

        missing = [f for f in args.files if not os.path.isfile(f)]
        for f in missing:
            print(f"distcompile events: no such file: {f!r}", file=sys.stderr)
        if len(missing) == len(args.files):
            return 1
        print(summary(args.files))
        return 0
    if args.command == "demo":
        if (args.nproc is not None and args.nproc < 1) or args.steps < 2:
            parser.error("--nproc must be >= 1 and --steps >= 2")
        from .demo import run_demo

        return run_demo(
            nproc=args.nproc,
            steps=args.steps,
            backend=args.backend,
            logdir=args.logdir,
            compare=args.compare,
            link=args.link,
        )
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
