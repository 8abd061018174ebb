"""``python benchmarks/run_chaos.py``: a seeded chaos run against an uninterrupted run of the same job.

Both jobs train the example GPT (``examples/train_gpt.py``, Inductor, checkpoints) on the
same simulated cluster: ``--nodes`` network namespaces on one switch, ``--ranks-per-node``
ranks each, a compile cache folder per node, torchrun with restarts. The chaos job gets
the faults of ``schedule.make_schedule`` one at a time (Note [Chaos run]); at its end its
final parameters must equal the uninterrupted job's bitwise, no process may be left, and
every fault must have been recovered from. The report goes to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from distcompile.tools.bench.netns import can_make_namespaces, star
from distcompile.tools.bench.report import write_results

from .faults import HANG_S, Injector, orphans, stop_everything
from .figures import figures, markdown
from .job import Job, digests
from .monitor import Monitor
from .schedule import make_schedule, steps_needed

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/run_chaos.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=20, help="faults to inject (at least one of each kind: 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes (network namespaces)")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--long-stall", type=float, default=30.0, help="seconds of the first stall (SIGSTOP)")
    p.add_argument("--tail", type=int, default=8, help="steps trained after the last fault's recovery")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--name", default=None, help="report name (default: DATE-chaos-NODESxRANKS)")
    return p


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    deadline = time.time() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]


def _job(args: argparse.Namespace, net: object, root: str, tag: str, steps: int, port: int) -> Job:
    return Job(
        tag=tag,
        root=root,
        namespaces=net.namespaces,  # type: ignore[attr-defined]
        devices=net.devices,  # type: ignore[attr-defined]
        addresses=net.addresses,  # type: ignore[attr-defined]
        ranks_per_node=args.ranks_per_node,
        steps=steps,
        ckpt_every=args.ckpt_every,
        max_restarts=1000,
        port=port,
    )


def _reference(job: Job) -> dict:
    """The uninterrupted job: its digests, launch to first step (cold caches), median step."""
    t0 = time.time()
    print(
        f"[chaos] the uninterrupted job: {job.nodes} nodes x {job.ranks_per_node} ranks, {job.steps} steps",
        flush=True,
    )
    try:
        codes = _wait_all(job.start(), HANG_S + 30 * job.steps)
    finally:
        stop_everything(job.tag, job)
    mon = Monitor([job.events(n) for n in range(job.nodes)])
    mon.poll()
    life = mon.current()
    if codes != [0] * job.nodes or life is None or not life.steps:
        raise SystemExit(
            f"[chaos] the uninterrupted job failed (exit codes {codes}):\n{job.outputs()[-6000:]}"
        )
    times = [t for t, _ in life.steps]
    return {
        "digests": digests(job.outputs()),
        "first_step_s": round(times[0] - t0, 2),
        "step_s": statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0,
        "wall_s": round(time.time() - t0, 1),
    }


def _chaos(job: Job, schedule: list, seed: int) -> tuple[dict, list[dict]]:
    t0 = time.time()
    print(f"[chaos] the chaos job: {len(schedule)} faults, {job.steps} steps", flush=True)
    procs = job.start()
    records: list[dict] = []
    try:
        inj = Injector(job, procs, seed=seed)
        if not inj.wait_steps(0, timeout_s=2 * HANG_S):
            raise SystemExit(f"[chaos] the chaos job never completed a step:\n{job.outputs()[-6000:]}")
        for fault in schedule:
            rec = inj.fire(fault)
            records.append(rec)
            if not str(rec.get("outcome", "")).startswith(("new life", "training went on")):
                break  # a hang or a failure: what follows would measure nothing
        codes = _wait_all(procs, HANG_S + 30 * job.steps)
        time.sleep(2.0)
        left = orphans(job.tag)
    finally:
        stop_everything(job.tag, job)
    return {
        "digests": digests(job.outputs()),
        "launcher_summary": job.summary(0),
        "exit_codes": codes,
        "orphans": left,
        "wall_s": round(time.time() - t0, 1),
    }, records


def main(argv: list[str] | None = None) -> int:
    """Run the chaos benchmark; 0 when every fault was survived and nothing was lost.

    Example:
        >>> # python benchmarks/run_chaos.py --faults 20 --seed 0        # 4 nodes x 2 ranks
    """
    args = _parser().parse_args(argv)
    reason = can_make_namespaces()
    if reason:
        print(f"[chaos] cannot simulate nodes here: {reason}", file=sys.stderr)
        return 2
    schedule = make_schedule(
        args.seed, args.faults, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
        ckpt_every=args.ckpt_every, long_stall_s=args.long_stall,
    )  # fmt: skip
    steps = steps_needed(schedule, tail=args.tail)
    tag = f"chaos-{uuid.uuid4().hex[:8]}"
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dc_chaos_") as root, star("10.213.14", args.nodes) as net:
        ref = _reference(_job(args, net, os.path.join(root, "reference"), f"{tag}-ref", steps, 29541))
        chaos, records = _chaos(
            _job(args, net, os.path.join(root, "chaos"), tag, steps, 29542), schedule, args.seed
        )
    fig = figures(records, reference=ref, chaos=chaos)
    import torch

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
        "versions": f"torch {torch.__version__}, Python {platform.python_version()}",
        "topology": f"{args.nodes} nodes (network namespaces on one switch, unshaped) x {args.ranks_per_node} ranks, gloo",
        "command": "python benchmarks/run_chaos.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seed": args.seed,
        "steps": steps,
        "wall_s": round(time.time() - t0, 1),
    }
    text = markdown(meta, records, fig, ref, chaos)
    print("\n" + text)
    name = args.name or f"{meta['date']}-chaos-{args.nodes}x{args.ranks_per_node}"
    data = {"meta": meta, "figures": fig, "faults": records, "reference": ref, "chaos": chaos}
    write_results(args.out_dir, name, data, text)
    ok = fig["survived"] == len(schedule) == fig["faults"] and fig["bitwise_equal"] and not fig["orphans"]
    return 0 if ok and chaos["exit_codes"] == [0] * args.nodes else 1


if __name__ == "__main__":
    sys.exit(main())
