"""``distcompile demo``: train the example GPT with distcompile and with what a user would use instead.

The parent process launches the ranks with torchrun (``torch.distributed.run``), on
loopback or, with ``--link``, in two network namespaces joined by a shaped link (one
torchrun "node" per namespace); each rank runs :func:`worker`; rank 0 writes a JSON file
the parent turns into a table: compile and step time of each variant, distcompile's
all-reduce time, exposed communication and overlap from its own telemetry, and one line
on what this machine can gain.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from ..telemetry.timeline import describe_figures, fmt, mean_figures

__all__ = ["COMPARE", "run_demo", "worker"]

#: What runs by default, and what ``--compare`` adds (what users are told to try first).
DEFAULT = ("eager DDP", "distcompile")
COMPARE = ("torch.compile, DDPOptimizer", "regional compile")
LOSS_RTOL = 1e-3  # inductor reorders float reductions; AdamW over a short run stays well inside this
#: Below this share of the step, communication is too small for overlap to matter.
LITTLE_COMM = 0.15


def _device_and_backend() -> tuple[str, str]:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}", "nccl"
    return "cpu", "gloo"


def _tag(name: str) -> str:
    """A variant's short name: its TensorBoard run and its private forward code's tag."""
    return "distcompile" if name == "distcompile" else name.split()[0].replace(",", "").replace(".", "_")


def _build(name: str, cfg: object, device: str, backend: str, logdir: str) -> object:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distcompile
    from distcompile import _torch_compat as compat
    from distcompile.capture.graph import own_forward_code
    from distcompile.models import GPT

    torch.manual_seed(0)
    # Each variant its own forward code object: TorchDynamo's caches stay apart.
    model = own_forward_code(GPT(cfg).to(device), _tag(name))
    if name == "regional compile":  # one backend object, so every block reuses the first's code
        compiler = compat.lookup_backend(backend)
        for block in model.blocks:
            block.compile(backend=compiler)
    ddp = DDP(model, device_ids=[torch.device(device).index] if device != "cpu" else None)
    if name == "torch.compile, DDPOptimizer":
        return torch.compile(ddp, backend=backend)
    if name == "distcompile":
        # A showcase: a timeline picture every 10 steps rather than every 200.
        engine = os.path.join(logdir, "distcompile", "engine")
        return distcompile.wrap(ddp, backend=backend, logdir=engine, figure_every=10)
    return ddp


def _train(name: str, model: object, cfg: object, steps: int, device: str, writer: object) -> dict:
    import torch
    import torch.distributed as dist

    from distcompile.models import GPT, synthetic_batch

    rank = dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, times, comm = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = synthetic_batch(cfg, batch_size=8, step=step, rank=rank, device=device)
        loss = GPT.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if name == "distcompile" and step > 0:
            comm.append(model.last_step.figures())
        if writer is not None:
            writer.add_scalar("train/loss", losses[-1], step)
            writer.add_scalar("train/step_ms", times[-1] * 1e3, step)
        if rank == 0 and (step == 0 or (step + 1) % 5 == 0):
            print(
                f"[{name}] step {step + 1}/{steps} loss {losses[-1]:.4f} ({times[-1] * 1e3:.0f} ms)",
                flush=True,
            )
    out = {"first_step_s": times[0], "median_ms": statistics.median(times[1:]) * 1e3, "losses": losses}
    if name == "distcompile":
        model.close()
        out.update(
            graphs=len(model.graphs),
            segments=sum(len(g.plan.segments) for g in model.graphs),
            buckets=model.last_step.buckets,
            **mean_figures(comm),
        )
    return out


def worker(argv: list[str]) -> None:
    """One rank of the demo (run under torchrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--logdir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", required=True)
    p.add_argument("--link", default="loopback")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.utils.tensorboard import SummaryWriter

    from distcompile.models import GPTConfig

    device, pg_backend = _device_and_backend()
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(pg_backend)
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
    results = {}
    for name in args.variants.split(";"):
        writer = SummaryWriter(os.path.join(args.logdir, _tag(name))) if rank == 0 else None
        model = _build(name, cfg, device, args.backend, args.logdir)
        results[name] = _train(name, model, cfg, args.steps, device, writer)
        if writer is not None:
            writer.close()
    if rank == 0:
        results["meta"] = {
            "world_size": dist.get_world_size(),
            "device": device,
            "torch": torch.__version__,
            "backend": args.backend,
            "steps": args.steps,
            "link": args.link,
            "cpu_cores": os.cpu_count(),
        }
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _rows(res: dict, names: list[str]) -> list[str]:
    eager = res["eager DDP"]
    rows = [("variant", "first step (compile)", "median step", "vs eager DDP", "loss first -> last")]
    for name in names:
        r = res[name]
        rows.append(
            (
                name,
                f"{r['first_step_s']:.2f} s",
                f"{r['median_ms']:.1f} ms",
                f"{r['median_ms'] / eager['median_ms']:.2f}x",
                f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _verdict(res: dict) -> str:
    ours, m = res["distcompile"], res["meta"]
    step = res["eager DDP"]["median_ms"]
    share = (ours["comm_ms"] or 0.0) / max(step, 1e-9)
    if m["device"] == "cpu" and m["link"] == "loopback" and m["world_size"] >= (m["cpu_cores"] or 1):
        why = (
            f"its {m['world_size']} ranks share {m['cpu_cores']} CPU cores and talk over loopback, where an "
            "all-reduce is a memory copy competing with backward for the same cores"
        )
    elif share < LITTLE_COMM:
        why = "communication is a small share of the step"
    else:
        return (
            f"distcompile overlapped {fmt(ours['overlap_pct'], '.0f', '%')} of its {fmt(ours['comm_ms'])} ms of "
            f"all-reduce per step with computation; {fmt(ours['exposed_ms'])} ms stayed exposed."
        )
    return (
        f"Little to gain on this machine: {why} (all-reduce {fmt(ours['comm_ms'])} ms of a {step:.1f} ms step). "
        "distcompile pays where communication is a large share of the step and runs beside compute: a slow "
        "link (`distcompile demo --link 1gbit`, as root), GPUs, bigger models (`distcompile bench`)."
    )


def _table(res: dict) -> tuple[str, bool]:
    names = [n for n in (*DEFAULT[:1], *COMPARE, DEFAULT[1]) if n in res]
    eager, ours, m = res["eager DDP"], res["distcompile"], res["meta"]
    lines = _rows(res, names)
    lines += [
        "",
        f"distcompile: {ours['graphs']} graph(s), {ours['segments']} segment(s), {ours['buckets']} bucket(s); "
        f"per step (mean of steps 1+): {describe_figures(ours)}",
        _verdict(res),
    ]
    ok = True
    for name in names[1:]:
        diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager["losses"], res[name]["losses"])]
        good = max(diffs) <= LOSS_RTOL
        ok = ok and (good or name != "distcompile")
        lines.append(
            f"losses of {name} vs eager DDP: max relative difference {max(diffs):.2e} "
            f"(tolerance {LOSS_RTOL:g}) -> {'OK' if good else 'MISMATCH'}"
        )
    lines.append(
        f"{m['world_size']} ranks on {m['device']} ({m['link']}), torch {m['torch']}, backend {m['backend']}, "
        f"{m['steps']} steps each"
    )
    return "\n".join(lines), ok


@contextlib.contextmanager
def _launchers(nproc: int, link: str, worker_args: list[str]) -> Iterator[list[list[str]]]:
    """The torchrun command(s) for the ranks: one on loopback, one per namespace on a shaped link."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    worker = ["-m", "distcompile.tools.demo", *worker_args, "--link", link]
    if link == "loopback":
        yield [[*run, "--standalone", f"--nproc-per-node={nproc}", *worker]]
        return
    from .bench.netns import veth_pair

    with veth_pair("10.213.11", rate=link) as pair:
        yield [
            [
                "ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", *run,
                "--nnodes=2", f"--node-rank={i}", "--nproc-per-node=1",
                f"--master-addr={pair.addresses[0]}", "--master-port=29547", *worker,
            ]
            for i, (ns, dev) in enumerate(zip(pair.namespaces, pair.devices))
        ]  # fmt: skip


def run_demo(
    *, nproc: int | None, steps: int, backend: str, logdir: str, compare: bool = False, link: str = "loopback"
) -> int:
    """Launch the ranks, print the comparison; return an exit code.

    ``nproc=None``: one rank per GPU (NCCL; one GPU is a world of one), else 2 CPU ranks
    (gloo). ``compare`` adds ``torch.compile`` with DDPOptimizer and regional compilation;
    ``link`` (``"1gbit"``, ``"200mbit"``; root only) runs 2 CPU ranks over a shaped link.

    Example:
        >>> # run_demo(nproc=2, steps=20, backend="inductor", logdir="runs/demo", compare=True)
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc is None:
        nproc = gpus or 2
    if link != "loopback":
        from .bench.netns import can_make_namespaces

        reason = can_make_namespaces()
        if reason or nproc != 2 or gpus:
            why = reason or "a shaped link joins exactly 2 CPU ranks (use --nproc 2, no GPUs)"
            print(f"distcompile demo: --link {link} is not possible here: {why}.", file=sys.stderr)
            return 2
    where = f"{nproc} GPU(s), NCCL" if 0 < nproc <= gpus else f"CPU, gloo ({gpus} GPU(s) found), {link}"
    names = [DEFAULT[0], *(COMPARE if compare else ()), DEFAULT[1]]
    print(
        f"distcompile demo: {nproc} ranks on {where}; {steps} steps of each of: {', '.join(names)}; "
        f"backend {backend}; TensorBoard logs in {logdir}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "demo.json")
        args = ["--steps", str(steps), "--backend", backend, "--logdir", logdir, "--out", out]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        with _launchers(nproc, link, [*args, "--variants", ";".join(names)]) as cmds:
            procs = [subprocess.Popen(cmd, env=env) for cmd in cmds]
            rc = max(p.wait() for p in procs)
        if rc != 0 or not os.path.exists(out):
            print(
                f"distcompile demo: the ranks failed (exit code {rc}); see their output above.",
                file=sys.stderr,
            )
            return rc or 1
        with open(out) as f:
            res = json.load(f)
    table, ok = _table(res)
    print()
    print(table)
    print(f"\nView: tensorboard --logdir {logdir}")
    return 0 if ok else 3


if __name__ == "__main__":
    worker(sys.argv[1:])
