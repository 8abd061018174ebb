"""Train a small GPT data-parallel, with eager DDP or with distcompile.

Run it:
    # one process (a world of one rank)
    torchrun --standalone --nproc-per-node 1 examples/train_gpt.py --distcompile
    # two local ranks (gloo on CPU, NCCL on GPUs)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --distcompile --steps 50
    # buckets chosen from the measured link and compute speed
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --distcompile --bucket-cap-mb auto
    # eager DDP, for comparison
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    # two nodes: run on each node, with the first node's address
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_gpt.py --distcompile
    # resumable: checkpoints every 10 steps; restarted ranks resume from the newest one
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_gpt.py --distcompile \\
        --ckpt-dir ckpt

The data is a synthetic token stream (see distcompile.models.synthetic_batch), so nothing
is downloaded; the loss falls from ln(vocab) towards ln(3).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile.models import GPT, GPTConfig, synthetic_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distcompile", action="store_true", help="wrap the DDP model with distcompile")
    p.add_argument("--backend", default="inductor", choices=("eager", "aot_eager", "inductor"))
    p.add_argument("--compression", choices=("bf16", "fp16"), default=None)
    p.add_argument(
        "--bucket-cap-mb",
        default=None,
        help="gradient bucket MiB, or 'auto' (chosen from the measured link); default: DDP's",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--logdir", default=None, help="TensorBoard directory for distcompile's scalars")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory; an existing checkpoint is resumed")
    p.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    args = p.parse_args()

    # torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; NCCL needs one GPU per local rank.
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = gpus >= local_world
    if gpus and not use_cuda and local_rank == 0:
        print(
            f"{local_world} local ranks but {gpus} GPU(s): training on CPU with gloo. Launch "
            f"--nproc-per-node {gpus} to use the GPUs (one rank per GPU).",
            flush=True,
        )
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd)
    torch.manual_seed(0)
    model = DDP(GPT(cfg).to(device), device_ids=[device.index] if use_cuda else None)
    if args.distcompile:
        cap = args.bucket_cap_mb
        model = distcompile.wrap(
            model,
            backend=args.backend,
            compression=args.compression,
            bucket_cap_mb=cap if cap in (None, "auto") else float(cap),
            logdir=args.logdir,
        )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.ckpt_dir:
        # After a crash, torchrun --max-restarts restarts every rank; they resume here.
        state = distcompile.load_checkpoint(args.ckpt_dir, model=model, optimizer=opt)
        start = state["step"] + 1 if state else 0
        if state and rank == 0:
            print(f"resumed from {state['path']} at step {start}", flush=True)

    for step in range(start, args.steps):
        t0 = time.perf_counter()
        x, y = synthetic_batch(cfg, batch_size=args.batch_size, step=step, rank=rank, device=device)
        loss = GPT.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(
                f"step {step:4d}  loss {loss.item():.4f}  {1e3 * (time.perf_counter() - t0):7.1f} ms",
                flush=True,
            )
        if args.ckpt_dir and (step + 1) % args.ckpt_every == 0:
            # The data of step s is synthetic_batch(step=s): the step is the data position.
            distcompile.save_checkpoint(args.ckpt_dir, model=model, optimizer=opt, step=step)

    # A fingerprint of the final weights, per rank: equal on every rank, and equal to an
    # uninterrupted run's after a resume.
    with torch.no_grad():
        digest = sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(model.parameters()))
    # One write per line: two ranks printing at once must not interleave within a line.
    sys.stdout.write(f"rank {rank} final parameter digest {digest!r}\n")
    sys.stdout.flush()
    if args.distcompile:
        model.close()  # flushes telemetry (also done at exit if a script forgets)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
