"""Run a function on several real ranks (forked from a preloaded server process, gloo) and collect results.

Each child's traceback comes back to the parent; the parent kills everything and fails
after ``timeout`` seconds instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["child_env", "free_port", "run_ranks", "RankFailure"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this checkout importable first, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What every rank imports, imported once: ranks are forked from a server process that
#: holds them (a fresh process per rank cost 3.5 s of imports, most of the suite's CPU time).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "distcompile",
    "tests.workers",
]


def _context(start: str) -> Any:
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RankFailure(AssertionError):
    """A rank raised, died or timed out; the message holds its traceback."""


def _portable(obj: Any) -> Any:
    # Tensors would travel as shared-memory handles that die with the child; numpy copies do not.
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().float().numpy().copy() if obj.dtype.is_floating_point else obj.numpy().copy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def _child(fn: Callable, rank: int, world: int, init_file: str, results: Any, args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        out = fn(rank, world, *args)
        results.put((rank, "ok", _portable(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable,
    world: int,
    *args: Any,
    timeout: float = 300,
    may_die: tuple[int, ...] = (),
    start: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    ``fn`` must be importable (a module-level function). Ranks in ``may_die`` may exit
    without a result (their result is ``None``), for tests that kill a rank on purpose.
    ``start="spawn"`` gives each rank a fresh interpreter: what ranks that use CUDA need
    once the test process has touched CUDA (its forked children cannot initialize it).
    """
    ctx = _context(start)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_child, args=(fn, r, world, init_file, results, args), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(errors) < world:
                if all(
                    r in out or r in errors or (r in may_die and procs[r].exitcode is not None)
                    for r in range(world)
                ):
                    break
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise RankFailure(
                            f"timed out after {timeout:.0f} s; ranks {sorted(set(range(world)) - set(out) - set(errors))} "
                            f"did not finish. Errors so far: {errors}"
                        ) from None
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0)
                        and r not in out
                        and r not in errors
                        and r not in may_die
                    ]
                    if dead and results.empty():
                        time.sleep(1.0)
                        if results.empty():
                            raise RankFailure(
                                f"rank(s) {dead} died with exit codes "
                                f"{[procs[r].exitcode for r in dead]}; errors: {errors}"
                            ) from None
                    continue
                (out if status == "ok" else errors)[rank] = value
                if errors and status == "error":
                    deadline = min(deadline, time.monotonic() + 30)  # give peers a moment to report
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise RankFailure("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out.get(r) for r in range(world)]


def distcompile_messages(level: int = logging.INFO) -> list[str]:
    """Collect the messages distcompile logs at ``level`` and above in this process, from now on."""
    lines: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("distcompile")
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    return lines
