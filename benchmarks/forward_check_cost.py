"""First-step cost of the default forward check (verify="forward") against none, in one run.

Run:
    torchrun --standalone --nproc-per-node 2 benchmarks/forward_check_cost.py \
        --out benchmarks/results/2026-11-26-forward-check-cost.json

The benchmark GPT of ``distcompile bench`` on CPU (4 layers, d=256, vocabulary 8192,
batch 8 x 128), Inductor. Each round captures and compiles a fresh copy twice, once with
``verify=False`` and once with the default check, in alternating order, after
``torch._dynamo.reset()``; round 0 pays the cold compile cache (its first variant),
the later rounds load every piece from the warm cache, which is the first step a user
sees on every restart. Reports each variant's first step (forward, backward, optimizer
step: what the check adds to) as the median of the warm rounds, the ratio, and the
second step, where the check does nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile.models import GPT, GPTConfig, synthetic_batch

VARIANTS = {"off": False, "forward check": "forward"}


def _first_steps(cfg: GPTConfig, verify: object, rank: int) -> tuple[float, float]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = distcompile.wrap(DDP(GPT(cfg)), backend="inductor", verify=verify)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(2):
        x, y = synthetic_batch(cfg, batch_size=8, step=step, rank=rank)
        dist.barrier()
        t0 = time.perf_counter()
        GPT.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    model.close()
    return times[0], times[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=8192, block_size=128, n_layer=4, n_head=4, n_embd=256)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            first, second = _first_steps(cfg, VARIANTS[name], rank)
            runs[name].append((first, second))
            if rank == 0:
                print(f"[forward-check] round {r}: {name}: first step {first:.2f} s, second {second * 1e3:.0f} ms", flush=True)
    warm = {n: [f for f, _ in v[1:]] for n, v in runs.items()}
    med = {n: statistics.median(v) for n, v in warm.items()}
    second = {n: statistics.median([s for _, s in v]) for n, v in runs.items()}
    ratio = med["forward check"] / med["off"]
    if rank == 0:
        print(f"\n{'variant':<14} {'first step, warm (median)':>26} {'second step':>12}")
        for n in VARIANTS:
            print(f"{n:<14} {med[n]:>24.3f} s {second[n] * 1e3:>9.0f} ms")
        print(f"\nforward check / off, warm first step: {ratio:.3f}x (goal: under 1.05x)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s) a rank, 2 gloo ranks",
                        "torch": torch.__version__,
                        "model": str(cfg),
                        "rounds": args.rounds,
                        "first_and_second_s": runs,
                        "warm_first_median_s": med,
                        "second_median_s": second,
                        "ratio": ratio,
                    },
                    f,
                    indent=2,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
