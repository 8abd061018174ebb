"""Step-time cost of distcompile's telemetry (logdir=...) against none, in one run.

Run:
    torchrun --standalone --nproc-per-node 2 benchmarks/telemetry_overhead.py --out benchmarks/results/telemetry.json

Two wrapped copies of the same GPT train side by side, one with telemetry (scalars every
step, a trace file and a picture every ``--trace-every`` steps) and one without, in
alternating blocks of steps so drift of the machine cancels. Reports median
forward+backward+optimizer step time of each (median, and mean, which includes the
steps that write a trace and a picture) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile.models import GPT, GPTConfig, synthetic_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=5, help="steps per variant per round")
    p.add_argument("--trace-every", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
    logdir = tempfile.mkdtemp(prefix="dc_tele_")
    variants = {}
    for name, kw in (("off", {}), ("on", {"logdir": logdir, "trace_every": args.trace_every})):
        torch.manual_seed(0)
        model = distcompile.wrap(DDP(GPT(cfg)), backend=args.backend, **kw)
        variants[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), [])
    step = 0
    for r in range(-1, args.rounds):  # round -1 compiles and warms up, not measured
        for model, opt, times in variants.values():
            for _ in range(args.block):
                t0 = time.perf_counter()
                x, y = synthetic_batch(cfg, batch_size=8, step=step, rank=rank)
                GPT.loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if r >= 0:
                    times.append((time.perf_counter() - t0) * 1e3)
                step += 1
        if rank == 0 and r >= 0:
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    med = {n: statistics.median(v[2]) for n, v in variants.items()}
    mean = {n: statistics.fmean(v[2]) for n, v in variants.items()}
    result = {
        "median_ms": med,
        "mean_ms": mean,
        "ratio_on_over_off": med["on"] / med["off"],
        "mean_ratio_on_over_off": mean["on"] / mean["off"],
        "steps_per_variant": len(variants["on"][2]),
        "backend": args.backend,
        "world_size": dist.get_world_size(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads/rank, {platform.platform()}",
        "link": "loopback (gloo)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if rank == 0:
        print(
            f"\ntelemetry off: median {med['off']:.2f} ms, mean {mean['off']:.2f} ms\n"
            f"telemetry on:  median {med['on']:.2f} ms, mean {mean['on']:.2f} ms\n"
            f"ratio on/off: median {result['ratio_on_over_off']:.3f}, mean {result['mean_ratio_on_over_off']:.3f} "
            f"({result['steps_per_variant']} steps each, "
            f"{args.backend}, {result['world_size']} ranks, {result['link']}, torch {result['torch']})"
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    for model, _, _ in variants.values():
        model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
