"""``distcompile demo``: train the example GPT with eager DDP and with distcompile, compare.

The parent process launches the ranks with torchrun (``torch.distributed.run``); each
rank runs :func:`worker`; rank 0 writes a JSON file the parent turns into a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["run_demo", "worker"]

VARIANTS = ("eager DDP", "distcompile")
LOSS_RTOL = 1e-3  # inductor reorders float reductions; AdamW over a short run stays well inside this


def _device_and_backend() -> tuple[str, str]:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}", "nccl"
    return "cpu", "gloo"


def worker(argv: list[str]) -> None:
    """One rank of the demo (run under torchrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--logdir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.tensorboard import SummaryWriter

    import distcompile
    from distcompile.models import GPT, GPTConfig, synthetic_batch

    device, pg_backend = _device_and_backend()
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(pg_backend)
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
    results = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        ddp = DDP(GPT(cfg).to(device), device_ids=[torch.device(device).index] if device != "cpu" else None)
        tag = "distcompile" if variant == "distcompile" else "eager_ddp"
        if variant == "distcompile":
            # A showcase: a timeline picture every 10 steps rather than every 200.
            engine_dir = os.path.join(args.logdir, tag, "engine")
            model = distcompile.wrap(ddp, backend=args.backend, logdir=engine_dir, figure_every=10)
        else:
            model = ddp
        writer = SummaryWriter(os.path.join(args.logdir, tag)) if rank == 0 else None
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses, times = [], []
        for step in range(args.steps):
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
            if writer is not None:
                writer.add_scalar("train/loss", losses[-1], step)
                writer.add_scalar("train/step_ms", times[-1] * 1e3, step)
            if rank == 0 and (step == 0 or (step + 1) % 5 == 0):
                print(
                    f"[{variant}] step {step + 1}/{args.steps} loss {losses[-1]:.4f} "
                    f"({times[-1] * 1e3:.0f} ms)",
                    flush=True,
                )
        if writer is not None:
            writer.close()
        if variant == "distcompile":
            model.close()
        results[variant] = {
            "first_step_s": times[0],
            "median_ms": statistics.median(times[1:]) * 1e3 if len(times) > 1 else times[0] * 1e3,
            "losses": losses,
            "graphs": len(model.graphs) if variant == "distcompile" else None,
            "segments": sum(len(g.plan.segments) for g in model.graphs) if variant == "distcompile" else None,
            "buckets": model.last_step.buckets if variant == "distcompile" else None,
        }
    if rank == 0:
        results["meta"] = {
            "world_size": dist.get_world_size(),
            "device": device,
            "torch": torch.__version__,
            "backend": args.backend,
            "steps": args.steps,
        }
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _table(res: dict) -> tuple[str, bool]:
    eager, ours = res["eager DDP"], res["distcompile"]
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager["losses"], ours["losses"])]
    ok = max(diffs) <= LOSS_RTOL
    rows = [("variant", "first step (compile)", "median step", "loss first -> last")]
    for name in VARIANTS:
        r = res[name]
        rows.append(
            (
                name,
                f"{r['first_step_s']:.2f} s",
                f"{r['median_ms']:.1f} ms",
                f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    m = res["meta"]
    speed = eager["median_ms"] / ours["median_ms"]
    lines += [
        "",
        f"distcompile: {ours['graphs']} graph(s), {ours['segments']} segment(s), {ours['buckets']} bucket(s); "
        f"step time ratio eager/distcompile = {speed:.2f}x",
        f"losses agree: max relative difference {max(diffs):.2e} (tolerance {LOSS_RTOL:g}) -> "
        + ("OK" if ok else "MISMATCH"),
        f"{m['world_size']} ranks on {m['device']}, torch {m['torch']}, backend {m['backend']}, {m['steps']} steps each",
    ]
    return "\n".join(lines), ok


def run_demo(*, nproc: int | None, steps: int, backend: str, logdir: str) -> int:
    """Launch ``nproc`` local ranks with torchrun, print the comparison; return an exit code.

    ``nproc=None``: one rank per GPU (NCCL; one GPU is a world of one), else 2 CPU ranks (gloo).

    Example:
        >>> # run_demo(nproc=2, steps=20, backend="inductor", logdir="runs/demo")
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc is None:
        nproc = gpus or 2
    where = f"{nproc} GPU(s), NCCL" if 0 < nproc <= gpus else f"CPU, gloo ({gpus} GPU(s) found)"
    print(f"distcompile demo: running on {where}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "demo.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "distcompile.tools.demo",
            "--steps",
            str(steps),
            "--backend",
            backend,
            "--logdir",
            logdir,
            "--out",
            out,
        ]
        print(
            f"distcompile demo: {nproc} ranks, {steps} steps per variant, backend {backend}; "
            f"TensorBoard logs in {logdir}",
            flush=True,
        )
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        rc = subprocess.run(cmd, env=env).returncode
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
