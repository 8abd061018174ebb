"""What distcompile's control plane costs at N ranks: the real protocols, simulated ranks, one real store.

Run (``distcompile bench --control-plane`` runs the same):
    python benchmarks/control_plane.py --ranks 2,8,64,256,1024 --summary-kb 16 \
        --out benchmarks/results/2026-11-26-control-plane

N threads stand for N ranks, each with its own client of one real ``TCPStore`` server
in this process (as rank 0's store serves a torchrun job), and call distcompile's own
functions, unmodified, with synthetic inputs of stated sizes (no model, no compile):

- ``agreement``: ``_agreement.check_agreement`` of one graph's summary (the captured
  graph's structure and its plan: ``--summary-kb``), as the first step does per graph;
- ``layout``: ``_agreement.layouts_agree`` of a bucket layout of 64 buckets;
- ``recompile``: ``_agreement.compile_together`` (whether the ranks recompile together);
- ``peers``: ``compile.peers.folder_of`` and ``warm_ranks`` with one folder per 2 ranks.

Each rank's client counts its operations and the bytes it sent and received; a phase's
wall time is from the first rank's start to the last rank's end. Which distcompile is
measured is whichever ``import distcompile`` finds: ``PYTHONPATH=/path/to/other/checkout``
measures another version (the JSON records the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

PHASES = ("agreement", "layout", "recompile", "peers")


class _Client:
    """One simulated rank's store client, counting what it does."""

    def __init__(self, port: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=600))
        self.ops = 0
        self.bytes = 0

    def _n(self, *values: object) -> None:
        self.ops += 1
        self.bytes += sum(len(v) for v in values if isinstance(v, (str, bytes)))
        self.bytes += sum(sum(len(k) for k in v) for v in values if isinstance(v, list))

    def set(self, key, value):  # noqa: ANN001, ANN201
        self._n(key, value)
        return self.store.set(key, value)

    def get(self, key):  # noqa: ANN001, ANN201
        value = self.store.get(key)
        self._n(key, value)
        return value

    def add(self, key, amount):  # noqa: ANN001, ANN201
        self._n(key)
        return self.store.add(key, amount)

    def append(self, key, value):  # noqa: ANN001, ANN201
        self._n(key, value)
        return self.store.append(key, value)

    def compare_set(self, key, expected, desired):  # noqa: ANN001, ANN201
        value = self.store.compare_set(key, expected, desired)
        self._n(key, expected, desired, value)
        return value

    def check(self, keys):  # noqa: ANN001, ANN201
        self._n(keys)
        return self.store.check(keys)

    def wait(self, keys, timeout=None):  # noqa: ANN001, ANN201
        self._n(keys)
        return self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)

    @property
    def timeout(self):  # noqa: ANN201 - the client's own setting, not a store operation
        return self.store.timeout

    def set_timeout(self, timeout):  # noqa: ANN001, ANN201
        return self.store.set_timeout(timeout)

    def delete_key(self, key):  # noqa: ANN001, ANN201
        self._n(key)
        return self.store.delete_key(key)

    def multi_get(self, keys):  # noqa: ANN001, ANN201
        values = self.store.multi_get(keys)
        self._n(keys, *values)
        return values


def _phase_calls(summary: str, layout: list[list[str]]) -> dict[str, Callable]:
    from distcompile._agreement import check_agreement, compile_together, layouts_agree
    from distcompile.compile.peers import folder_of, warm_ranks

    def agreement(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        check_agreement(store, key, summary, rank=rank, ranks=ranks, timeout_s=600, what="graph 0")

    def layout_(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        if layouts_agree(store, key, layout, rank=rank, ranks=ranks, timeout_s=600) is None:
            raise RuntimeError("layouts differ")

    def recompile(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        compile_together(store, key, summary, rank=rank, ranks=ranks, wait_s=600, what="graph 1", fix="")

    def peers(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        folder_of(store, f"{key}/folders", rank=rank, peers=(rank - rank % 2,), ranks=ranks, timeout_s=600)
        marker = f"/nonexistent/distcompile-sim-{rank % 4}"  # no rank warm: the common cold start
        warm_ranks(store, f"{key}/warm", rank=rank, ranks=ranks, marker=marker, timeout_s=600)

    return {"agreement": agreement, "layout": layout_, "recompile": recompile, "peers": peers}


def simulate(n: int, summary_kb: float, port: int) -> dict:
    """Run every phase with ``n`` simulated ranks against the server on ``port``."""
    summary = ("call_function linear reads blocks.0.attn.weight | blocks.0.attn (model.py:42)\n" * 10_000)[
        : int(summary_kb * 1024)
    ]
    layout = [[f"blocks.{i}.w{j}" for j in range(4)] for i in range(64)]
    calls = _phase_calls(summary, layout)
    clients = [_Client(port) for _ in range(n)]
    ranks = list(range(n))
    out = {}
    for phase in PHASES:
        for c in clients:
            c.ops = c.bytes = 0
        errors: list[str] = []
        start = threading.Barrier(n + 1)

        def run(rank: int, phase: str = phase) -> None:
            start.wait()
            try:
                calls[phase](clients[rank], rank, ranks, f"sim{n}/{phase}")
            except Exception as exc:  # noqa: BLE001 - reported in the results
                errors.append(f"rank {rank}: {type(exc).__name__}: {exc}"[:300])

        threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        out[phase] = {
            "wall_s": wall,
            "ops_per_rank_max": max(c.ops for c in clients),
            "bytes_per_rank_max": max(c.bytes for c in clients),
            "bytes_total": sum(c.bytes for c in clients),
            "errors": errors[:3],
        }
    return out


def _commit() -> str:
    import distcompile

    root = os.path.dirname(os.path.dirname(os.path.abspath(distcompile.__file__)))
    try:
        return subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,8,64,256,1024", help="simulated job sizes, comma-separated")
    p.add_argument("--summary-kb", type=float, default=16.0, help="size of one graph's summary text")
    p.add_argument("--out", default="", help="write OUT.json (and print the table)")
    args = p.parse_args(argv)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = {}
    print(f"{'ranks':>6} {'phase':<10} {'wall s':>8} {'ops/rank':>9} {'kB/rank':>9} {'MB total':>9}", flush=True)
    for n in [int(x) for x in args.ranks.split(",")]:
        results[n] = simulate(n, args.summary_kb, server.port)
        for phase, r in results[n].items():
            print(
                f"{n:>6} {phase:<10} {r['wall_s']:>8.3f} {r['ops_per_rank_max']:>9} "
                f"{r['bytes_per_rank_max'] / 1e3:>9.1f} {r['bytes_total'] / 1e6:>9.2f}"
                + (f"  errors: {r['errors'][0]}" if r["errors"] else ""),
                flush=True,
            )
    if args.out:
        meta = {
            "distcompile_commit": _commit(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "summary_kb": args.summary_kb,
            "store": "one TCPStore server in this process, one client per simulated rank (threads)",
        }
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"wrote {args.out}.json", flush=True)


if __name__ == "__main__":
    sys.exit(main())
