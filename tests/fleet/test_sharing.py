"""Ranks that share a compile cache split the compiles (Note [Sharing compiles between ranks])."""

from __future__ import annotations

import logging
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

import pytest
import torch.distributed as dist
from torch import fx, nn

import distcompile.fleet.peers as peers_module
from distcompile.compile.cpu_checks import cpu_check_order
from distcompile.compile.jobs import CompileJob, assign
from distcompile.fleet.sharing import CompileSharing
from tests import workers
from tests.harness import run_ranks
from tests.runtime.test_parity import TOL, _check


def test_largest_jobs_go_first_to_the_least_loaded_peer() -> None:
    assert assign([5, 20, 3, 10], 2) == [1, 0, 1, 1]  # loads 20 and 18
    assert assign([4, 22, 2], 2) == [1, 0, 1]  # embedding and head against one block
    assert assign([7, 7, 7], 1) == [0, 0, 0]
    assert assign([], 3) == []
    assert sorted(assign([1, 1, 1, 1], 4)) == [0, 1, 2, 3]  # ties: one each, in order


def test_peers_split_the_cpu_checks_then_run_the_others() -> None:
    # Inductor lists the most extended instruction set first; it runs the most checks.
    for checks, npeers in ((4, 2), (4, 3), (2, 4), (0, 2)):
        orders = [cpu_check_order(checks, npeers, me) for me in range(npeers)]
        assert all(sorted(o) == list(range(checks)) for o in orders)  # every process runs all
        owner = assign(list(range(checks, 0, -1)), npeers)
        firsts = [o[: owner.count(me)] for me, o in enumerate(orders)]
        assert sorted(i for f in firsts for i in f) == list(range(checks))  # each share once
    loads = [sum(4 - i for i in cpu_check_order(4, 2, me)[:2]) for me in (0, 1)]
    assert loads == [5, 5]  # AMX (4) + AVX2 (1) against VNNI (3) + AVX-512 (2)


def test_a_rank_compiles_its_share_then_waits_for_its_peer_but_never_forever(caplog, monkeypatch) -> None:  # noqa: ANN001
    big = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh()))
    small = fx.symbolic_trace(nn.ReLU())
    jobs = [
        CompileJob(big, [], "big"),
        CompileJob(small, [], "small"),
        CompileJob(small, [], None, shareable=False),
    ]
    store = dist.HashStore()
    sharing = CompileSharing(lambda: store, "t", rank=0, ranks=(0, 1), timeout_s=0.2)
    sharing.peers = (0, 1)  # as cache_peers would find them; rank 1 never shows up
    monkeypatch.setattr(peers_module, "PEER_WAIT_S", 0.5)  # not 10 minutes
    order: list[int] = []
    with caplog.at_level(logging.INFO):
        out = sharing.compile_all(
            jobs, compile_one=lambda job: order.append(jobs.index(job)) or job.key, graph="g"
        )
    # Its own share (the big job) and the unshareable one first; then the peer's, after the wait.
    assert order == [0, 2, 1] and out == ["big", "small", None]
    assert "waiting 0 s so far for rank 1's share" in caplog.text  # progress every timeout_s
    assert "rank 1 did not finish its share of the compiles within 0 s" in caplog.text
    assert store.check(["t/g/3/0", "t/g/3/2"]) and not store.check(["t/g/3/1"])


def test_a_peer_that_left_the_compile_is_not_waited_for(caplog) -> None:  # noqa: ANN001
    """TorchDynamo restarted the peer's trace (or its compile failed): it marked the compile
    abandoned, and this rank compiles the peer's share at once instead of waiting."""
    import time

    small = fx.symbolic_trace(nn.ReLU())
    jobs = [CompileJob(small, [], "a"), CompileJob(small, [], "b")]
    store = dist.HashStore()
    sharing = CompileSharing(lambda: store, "t", rank=0, ranks=(0, 1), timeout_s=60)
    sharing.peers = (0, 1)
    CompileSharing(lambda: store, "t", rank=1, ranks=(0, 1), timeout_s=60).abandon("g")
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO):
        out = sharing.compile_all(jobs, compile_one=lambda job: job.key, graph="g")
    assert out == ["a", "b"] and time.monotonic() - t0 < 10, time.monotonic() - t0
    assert "did not finish its share" not in caplog.text


def _peers(rank: int, world: int, folders: list[str]) -> tuple[int, ...]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folders[rank]
    from distcompile._agreement import default_store
    from distcompile.fleet.peers import cache_peers

    return cache_peers(default_store(), "test/peers", rank=rank, ranks=list(range(world)), timeout_s=60)


def test_peers_are_the_ranks_that_see_one_cache_folder() -> None:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        assert run_ranks(_peers, 3, [a, a, b], timeout=120) == [(0, 1), (0, 1), (2,)]
        for folder in (a, b):  # the marker files are gone
            assert os.listdir(os.path.join(folder, "distcompile-peers")) == []


@pytest.mark.slow
@pytest.mark.long  # 41 s: in the long set, so that the README command stays under 8 minutes
def test_ranks_compile_their_share_and_load_the_rest() -> None:
    """2 ranks, one empty cache: each piece is compiled once in all; parity with eager DDP holds.

    Also the documented way to keep ``backward(retain_graph=True)`` with shared compiles
    (``torch._functorch.config.donated_buffer = False``).
    """
    with tempfile.TemporaryDirectory() as cache:
        results = run_ranks(workers.shared_compile, 2, cache, timeout=900)
    _check(results, TOL["inductor"])
    jobs = sum(p - r for p, r in zip(results[0]["pieces"], results[0]["pieces_reused"]))
    compiled = [r["aot_compiled"] for r in results]
    assert jobs >= 2 and sum(compiled) == jobs and min(compiled) >= 1, (jobs, compiled)
    assert [r["aot_hits"] for r in results] == [jobs - c for c in compiled]
    assert results[0]["peers"] == 0 and results[0]["warm_markers"] >= 1


_CHECKS = """
import sys
import torch
from distcompile import _torch_compat as compat
from distcompile.compile.cpu_checks import run_cpu_checks
if sys.argv[1] == "no-loads":  # a library load now fails the test: it must not happen
    from torch._inductor.cpu_vec_isa import VecISA

    def refuse(self, path):
        raise AssertionError("loaded " + path)

    VecISA._probe_load = refuse
checks = compat.cpu_isa_checks()
run_cpu_checks()
print([str(isa) for isa in checks if bool(isa)])
"""


def _loads_apart() -> bool:  # torch 2.13 on: each library is loaded by VecISA._probe_load
    from torch._inductor.cpu_vec_isa import VecISA

    return hasattr(VecISA, "_probe_load")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="Inductor checks x86 only")
@pytest.mark.skipif(
    not _loads_apart(), reason="this torch (2.11) loads each check library inline, every time"
)
@pytest.mark.long  # 35 s: in the long set, so that the README command stays under 8 minutes
def test_a_warm_start_loads_none_of_the_cpu_check_libraries_again(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def run(mode: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", _CHECKS, mode], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip()

    first = run("cold")  # builds each library and loads it once
    assert first.startswith("[") and first != "[]"  # this CPU has at least AVX2
    markers = {p.with_name(p.name + ".load_ok") for p in tmp_path.rglob("*.so")}
    assert markers and markers <= set(tmp_path.rglob("*.load_ok"))  # one per library, as torch 2.15 writes
    assert run("no-loads") == first  # a new process: the same verdicts, no library loaded
