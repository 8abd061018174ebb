"""What distcompile's control plane costs at N ranks: the real protocols, simulated ranks, one real store.

Run from a checkout (the simulator is not part of the installed package):
    python benchmarks/control_plane.py --ranks 2,8,64,256,1024 --summary-kb 16 \
        --out benchmarks/results/2026-11-26-control-plane

N threads stand for N ranks, each with its own client of one real ``TCPStore`` server
in this process (as rank 0's store serves a torchrun job), and call distcompile's own
functions, unmodified, with synthetic inputs of stated sizes (no model, no compile):

- ``agreement``: ``_agreement.check_agreement`` of one graph's summary (the captured
  graph's structure and its plan: ``--summary-kb``), as the first step does per graph;
- ``costs``: ``_agreement.first_rank_says`` of the backward timings ``bucket_cap_mb="auto"``
  shares at the first step's compiles (one figure per summary line, as JSON), which the
  first rank measures and the others read;
- ``layout``: ``_agreement.layouts_agree`` of a bucket layout of 64 buckets;
- ``recompile``: ``_agreement.compile_together`` (whether the ranks recompile together);
- ``peers``: ``fleet.peers.folder_of`` and ``warm_ranks`` with one folder per 2 ranks;
- ``sharing``: ``fleet.sharing.CompileSharing.compile_all`` of one graph of 4 distinct
  pieces, one folder per 2 ranks, cold, through the store (the path after a failure in the
  leaders' tree, which is a gloo group and cannot run in threads; the tree's bytes per
  process are arithmetic: Note [Compiles between folders by tree]). Its heartbeats, marks,
  waits, publications, fetches and deletions are the real ones; only the compiled bytes are
  synthetic: ``transfer.collect`` returns ``--payload-kb`` of random bytes for each piece
  the rank compiled or loaded since its last publication (a leader: its folder's share),
  and ``transfer.install`` loads nothing into torch's caches.

The store's server runs in a process of its own, so that its memory is its own: the table
gives its resident memory after each phase and its peak (``VmHWM``) above what it held at
the start of the job size.

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
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

PHASES = ("agreement", "costs", "layout", "recompile", "peers", "sharing")
#: One graph's distinct pieces in the ``sharing`` phase.
PIECES = 4


class _Client:
    """One simulated rank's store client, counting what it does."""

    def __init__(self, port: int) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=600)
        )
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


def _phase_calls(summary: str, layout: list[list[str]], payload_kb: float) -> dict[str, Callable]:
    from distcompile._agreement import check_agreement, compile_together, first_rank_says, layouts_agree
    from distcompile.fleet.peers import folder_of, warm_ranks

    def agreement(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        check_agreement(store, key, summary, rank=rank, ranks=ranks, timeout_s=600, what="graph 0")

    timed = json.dumps([1.2345678e9] * summary.count("\n"))  # one backward's work per node

    def costs(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        if (
            first_rank_says(store, key, lambda: timed, rank=rank, ranks=ranks, timeout_s=600, what="graph 0")
            != timed
        ):
            raise RuntimeError("the timings differ")

    def layout_(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        if layouts_agree(store, key, layout, rank=rank, ranks=ranks, timeout_s=600) is None:
            raise RuntimeError("layouts differ")

    def recompile(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        compile_together(store, key, summary, rank=rank, ranks=ranks, wait_s=600, what="graph 1", fix="")

    def peers(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        folder_of(store, f"{key}/folders", rank=rank, peers=(rank - rank % 2,), ranks=ranks, timeout_s=600)
        marker = f"/nonexistent/distcompile-sim-{rank % 4}"  # no rank warm: the common cold start
        warm_ranks(store, f"{key}/warm", rank=rank, ranks=ranks, marker=marker, timeout_s=600)

    return {
        "agreement": agreement,
        "costs": costs,
        "layout": layout_,
        "recompile": recompile,
        "peers": peers,
        "sharing": _sharing_call(payload_kb),
    }


def _sharing_call(payload_kb: float) -> Callable:
    """One rank's ``compile_all`` of a graph of ``PIECES`` pieces, two ranks a folder, through the store."""
    from torch import fx, nn

    from distcompile.fleet import sharing, transfer

    piece, done = os.urandom(int(payload_kb * 1024)), threading.local()

    def compile_one(job: sharing.CompileJob) -> str:  # compiled or loaded here: its bytes are held
        done.pieces = getattr(done, "pieces", 0) + 1
        return job.key

    def collect() -> bytes:  # what this rank's process compiled or loaded since its last publication
        n, done.pieces = getattr(done, "pieces", 0), 0
        return piece * n

    transfer.collect = collect
    transfer.install = lambda data: 0  # nothing real to load into torch's caches
    jobs = [
        sharing.CompileJob(fx.symbolic_trace(nn.Sequential(*[nn.ReLU()] * (j + 1))), [], f"p{j}")
        for j in range(PIECES)
    ]

    def run(store: _Client, rank: int, ranks: list[int], key: str) -> None:
        s = sharing.CompileSharing(lambda: store, key, rank=rank, ranks=ranks, timeout_s=600)
        s.peers = tuple(p for p in (rank - rank % 2, rank - rank % 2 + 1) if p < len(ranks))  # 2 a folder
        s.folders = {r: r - r % 2 for r in ranks}
        if rank == 0:
            store.set(f"{key}/tree/broken", "1")  # the store's path (the tree needs processes)
        store.wait([f"{key}/tree/broken"])
        s.compile_all(jobs, compile_one=compile_one, graph="g")
        if s.received_bytes % len(piece):
            raise RuntimeError(f"received {s.received_bytes} bytes, not whole pieces")

    return run


def simulate(n: int, summary_kb: float, payload_kb: float) -> dict:
    """Run every phase with ``n`` simulated ranks against a new server of their own."""
    server = _Server()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"dc_sim{n}_")  # a cold folder
    summary = ("call_function linear reads blocks.0.attn.weight | blocks.0.attn (model.py:42)\n" * 10_000)[
        : int(summary_kb * 1024)
    ]
    layout = [[f"blocks.{i}.w{j}" for j in range(4)] for i in range(64)]
    calls = _phase_calls(summary, layout, payload_kb)
    clients = [_Client(server.port) for _ in range(n)]
    ranks = list(range(n))
    out = {}
    for phase in PHASES:
        for c in clients:
            c.ops = c.bytes = 0
        errors: list[str] = []
        start = threading.Barrier(n + 1)

        def run(
            rank: int, phase: str = phase, start: threading.Barrier = start, errors: list[str] = errors
        ) -> None:
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
            **server.memory(),
        }
    server.close()
    shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    return out


class _Server:
    """The store's server in a process of its own, whose memory is read from ``/proc``."""

    def __init__(self) -> None:
        code = (
            "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
            "wait_for_workers=False); print(s.port, flush=True); sys.stdin.read()"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.port = int(self.proc.stdout.readline())
        self.start_kb = self._status()["VmRSS"]

    def _status(self) -> dict[str, int]:
        with open(f"/proc/{self.proc.pid}/status") as f:
            rows = [line.split() for line in f if line.startswith(("VmRSS", "VmHWM"))]
        return {r[0].rstrip(":"): int(r[1]) for r in rows}

    def memory(self) -> dict[str, float]:
        """The server's resident memory now and its peak so far, in MB above its start."""
        now = self._status()
        return {
            "server_mb": (now["VmRSS"] - self.start_kb) / 1024,
            "server_peak_mb": (now["VmHWM"] - self.start_kb) / 1024,
        }

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


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
    p.add_argument("--payload-kb", type=float, default=1024.0, help="one piece's compiled bytes (sharing)")
    p.add_argument("--out", default="", help="write OUT.json (and print the table)")
    args = p.parse_args(argv)
    if args.out:  # the folder exists before the run, not found missing after it
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = {}
    print(
        f"{'ranks':>6} {'phase':<10} {'wall s':>8} {'ops/rank':>9} {'kB/rank':>9} {'MB total':>9} "
        f"{'server MB':>9} {'peak MB':>8}",
        flush=True,
    )
    for n in [int(x) for x in args.ranks.split(",")]:
        results[n] = simulate(n, args.summary_kb, args.payload_kb)
        for phase, r in results[n].items():
            print(
                f"{n:>6} {phase:<10} {r['wall_s']:>8.3f} {r['ops_per_rank_max']:>9} "
                f"{r['bytes_per_rank_max'] / 1e3:>9.1f} {r['bytes_total'] / 1e6:>9.2f} "
                f"{r['server_mb']:>9.1f} {r['server_peak_mb']:>8.1f}"
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
            "payload_kb": args.payload_kb,
            "pieces": PIECES,
            "store": "one TCPStore server in a process of its own (new per job size), one client per simulated rank (threads)",
        }
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"wrote {args.out}.json", flush=True)


if __name__ == "__main__":
    sys.exit(main())
