"""Step time of a mixture of experts whose graphs differ by data: eager DDP, ``torch.compile``
with DDPOptimizer, and distcompile, in one run (Note [Graphs that differ by data]).

Run (2 local ranks, CPU, gloo):
    torchrun --standalone --nproc-per-node 2 benchmarks/moe.py --out benchmarks/results/moe.json

The model is Hugging Face Mixtral from a small random config (2 layers, hidden 128, 8
experts, top 2; no download) with transformers' eager expert loop
(``experts_implementation="eager"``: a loop over the experts that received tokens, which
differ per rank and step), ``find_unused_parameters=True`` everywhere. ``--experts grouped``
uses transformers' default grouped experts instead. Each variant trains its own copy with
AdamW on the same per-rank batches; the variants take turns in blocks of steps so that
drift of the machine cancels. Round 0 compiles and warms up and is not measured. Reports
the median step (forward, backward, optimizer) of the slower rank, min and max, and the
ratio to eager DDP.
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


def _model(experts: str) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.MixtralConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    kwargs = {"experts_implementation": "eager"} if experts == "eager" else {}
    return tf.MixtralForCausalLM._from_config(cfg, **kwargs).train()


def _variants(experts: str) -> dict[str, torch.nn.Module]:
    out = {}
    for name in ("eager DDP", "torch.compile(DDP)", "distcompile"):
        torch.manual_seed(0)
        ddp = DDP(_model(experts), find_unused_parameters=True)
        if name == "torch.compile(DDP)":
            out[name] = torch.compile(ddp)  # DDPOptimizer splits the graph at DDP's buckets
        elif name == "distcompile":
            out[name] = distcompile.wrap(ddp)
        else:
            out[name] = ddp
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", choices=("eager", "grouped"), default="eager")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=5, help="steps per variant per round")
    p.add_argument("--tokens", type=int, default=128, help="sequence length (batch 4)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    models = _variants(args.experts)
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    times: dict[str, list[float]] = {n: [] for n in models}
    step = 0
    for r in range(args.rounds + 1):  # round 0 compiles and warms up
        for name, model in models.items():
            for _ in range(args.block):
                g = torch.Generator().manual_seed(1000 * step + rank)
                ids = torch.randint(0, 1024, (4, args.tokens), generator=g)
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                opts[name].step()
                opts[name].zero_grad()
                if r > 0:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                step += 1
        if rank == 0:
            print(f"round {r}/{args.rounds} done{' (warm-up)' if r == 0 else ''}", flush=True)
    # The slower rank's median per variant (every rank waits for it).
    mine = torch.tensor([statistics.median(times[n]) for n in models])
    # distcompile's own count of the graphs it compiled (recompiles and graph breaks included).
    graphs = {"distcompile": len(models["distcompile"].graphs)}
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        base = float(mine[0])
        rows = []
        for i, name in enumerate(models):
            rows.append(
                {
                    "variant": name,
                    "median_ms": round(float(mine[i]), 2),
                    "min_ms": round(min(times[name]), 2),
                    "max_ms": round(max(times[name]), 2),
                    "vs_eager_ddp": round(float(mine[i]) / base, 3),
                    "graphs": graphs.get(name),
                }
            )
        print(
            f"\nMixtral ({args.experts} experts), {world} ranks, batch 4 x {args.tokens}, {args.rounds} x {args.block} steps each"
        )
        print(f"{'variant':<20} {'median step':>12} {'min':>9} {'max':>9} {'vs eager DDP':>13} {'graphs':>7}")
        for row in rows:
            print(
                f"{row['variant']:<20} {row['median_ms']:>9.1f} ms {row['min_ms']:>6.1f} ms "
                f"{row['max_ms']:>6.1f} ms {row['vs_eager_ddp']:>12.3f}x {row['graphs'] or '-':>7}"
            )
        if args.out:
            import transformers

            meta = {
                "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s) per rank, {world} gloo ranks on loopback",
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "experts": args.experts,
                "tokens": args.tokens,
                "rounds": args.rounds,
                "block": args.block,
            }
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
