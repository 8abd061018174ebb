"""distcompile at 2, 4, 8, 16 real ranks on one machine: parity, compiles per job, first-step CPU time.

Run (each size is one torchrun job; the script launches them):
    python benchmarks/scale_ranks.py --sizes 2,4,8,16 --out benchmarks/results/2026-11-26-scale-ranks

A tiny GPT (2 layers, d=32, vocabulary 128, 4 x 16 tokens a rank), gloo, Inductor, one
Inductor cache folder per "node" of 2 ranks (so 1, 2, 4 and 8 folders), empty at the start.
Each rank trains eager DDP and distcompile from the same start for 3 steps and reports: the
losses of both (parity), the CPU time its own process spent in distcompile's first step
(``time.process_time``: capture, planning, agreement, its share of the compiles, loading the
others'; on 2 cores the wall time grows with N by contention alone), the compiles it did,
and its control-plane counts (Note [The control plane]).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time


def _worker() -> None:
    root = os.environ["SCALE_CACHE_ROOT"]
    local = int(os.environ["LOCAL_RANK"])
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, f"node{local // 2}")  # before Inductor loads

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distcompile
    from distcompile._store import control_plane_counts
    from distcompile.models import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)
    lines: list[str] = []  # the compile log, for where the pieces came from and what was sent
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("distcompile").addHandler(handler)
    logging.getLogger("distcompile").setLevel(logging.INFO)  # every rank's compile log line
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    base = GPT(cfg)
    ref = DDP(__import__("copy").deepcopy(base))
    ours = distcompile.wrap(DDP(__import__("copy").deepcopy(base)), backend="inductor")
    losses = []
    first_cpu = first_wall = 0.0
    for model in (ref, ours):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = []
        for step in range(3):
            x, y = synthetic_batch(cfg, batch_size=4, step=step, rank=rank)
            c0, w0 = time.process_time(), time.perf_counter()
            loss = GPT.loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if model is ours and step == 0:
                first_cpu, first_wall = time.process_time() - c0, time.perf_counter() - w0
            run.append(float(loss))
        losses.append(run)
    record = ours.graphs[0]
    mine = {
        "rank": rank,
        "losses": losses,
        "first_step_cpu_s": first_cpu,
        "first_step_wall_s": first_wall,
        "compiled_here": record.piece_sources.get("compiled here", 0),
        "pieces": len(record.plan.compiled_pieces) - record.pieces_reused,
        "control_plane": control_plane_counts(),
        "received_mb": _mb(r"([\d.]+) MB through", lines),
        "route": next(
            (m.group(1) for x in lines if (m := re.search(r"MB through (the store|the leaders' tree)", x))),
            "",
        ),
        "sent_mb": _mb(r"([\d.]+) MB sent down the leaders' tree", lines),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(os.environ["SCALE_OUT"], "w") as f:
            json.dump(everyone, f)
    ours.close()
    dist.destroy_process_group()


def _mb(pattern: str, lines: list[str]) -> float:
    """The last figure ``pattern`` finds in the compile log (cumulative over graphs), or 0."""
    found = [float(m.group(1)) for x in lines if (m := re.search(pattern, x))]
    return found[-1] if found else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2,4,8,16")
    p.add_argument("--out", default="")
    args = p.parse_args()
    results = {}
    print(
        f"{'ranks':>5} {'folders':>7} {'parity (max rel. loss diff)':>28} {'compiles in job':>15} "
        f"{'distinct':>8} {'first-step CPU s (median/max)':>30} {'store ops/rank (max)':>20} "
        f"{'MB sent by a rank (max)':>23} {'MB a leader received':>20}",
        flush=True,
    )
    for n in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as root:
            out = os.path.join(root, "out.json")
            env = {**os.environ, "SCALE_CACHE_ROOT": root, "SCALE_OUT": out, "SCALE_WORKER": "1"}
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            t0 = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={n}",
                    __file__,
                ],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=3600,
            )
            wall = time.perf_counter() - t0
            ranks = json.load(open(out))
        diff = max(abs(a - b) / abs(a) for r in ranks for a, b in zip(*r["losses"]))
        cpu = sorted(r["first_step_cpu_s"] for r in ranks)
        ops = max(sum(o for o, _ in r["control_plane"].values()) for r in ranks)
        results[n] = {"ranks": ranks, "job_wall_s": wall, "max_rel_loss_diff": diff}
        print(
            f"{n:>5} {max(1, n // 2):>7} {diff:>28.2e} {sum(r['compiled_here'] for r in ranks):>15} "
            f"{ranks[0]['pieces']:>8} {cpu[len(cpu) // 2]:>14.2f} / {cpu[-1]:<13.2f} {ops:>20} "
            f"{max(r['sent_mb'] for r in ranks):>23.2f} {max(r['received_mb'] for r in ranks):>20.2f}",
            flush=True,
        )
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    _worker() if os.environ.get("SCALE_WORKER") == "1" else main()
