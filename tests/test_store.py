"""The control plane's store protocols (Note [The control plane]): right answers, bounded cost.

Simulated ranks are threads, each with its own client of one real TCPStore server, as
``benchmarks/control_plane.py`` does at a thousand ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist

from distcompile import DesyncError, _store
from distcompile._agreement import (
    check_agreement,
    compile_together,
    failed_ranks,
    first_rank_says,
    host_addresses,
    layouts_agree,
    mark_address,
    mark_failed,
    ranks_at,
)
from distcompile._store import StoreTimeout, agree, barrier, counted, gather, gather_small


class _Counting:
    """A client that counts its own operations (the process-wide counts mix the threads)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.ops = store, 0

    def __getattr__(self, name: str) -> object:
        method = getattr(self.store, name)
        if name in ("timeout", "set_timeout"):  # the client's own setting, not a store operation
            return method

        def call(*args: object) -> object:
            self.ops += 1
            return method(*args)

        return call


def _ranks(n: int, fn: Callable[[object, int], object]) -> tuple[list, list[int]]:
    """Run ``fn(store, rank)`` on ``n`` threads, each with its own client; results and op counts."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = [
        _Counting(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30)))
        for _ in range(n)
    ]
    out: list = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(clients[r], r)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out, [c.ops for c in clients]


def test_agree_compares_digests_in_a_bounded_number_of_operations() -> None:
    n = 32
    out, ops = _ranks(
        n,
        lambda s, r: agree(
            counted(s, "t"), "k", "same text " * 100, rank=r, ranks=list(range(n)), timeout_s=30
        ),
    )
    assert all(v.same for v in out), out
    assert max(ops) <= 6, (
        ops
    )  # here, compare_set, add, wait(done), add(ndiffer); the first rank also sets its text


def test_gather_brings_any_text_and_names_a_rank_that_never_reports() -> None:
    """doctor's exchange: every rank's report, whatever characters it holds; a rank that never
    reports is None after the timeout instead of a hang."""
    store = counted(dist.HashStore(), "test-gather")
    report = '{"error": "a=b; c"}'
    start = time.monotonic()
    found = gather(store, "doctor/eager", report, rank=0, ranks=[0, 1], timeout_s=0.5)
    assert found == {0: report, 1: None}
    assert time.monotonic() - start < 10


def test_no_module_counts_its_own_arrivals() -> None:
    """One store protocol: counting ranks in (``add(key, 1) == n``) goes through ``_store``'s
    helpers (``last_to_arrive``, ``barrier``), which the control-plane counters see."""
    import ast
    import pathlib

    import distcompile

    root = pathlib.Path(distcompile.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_store.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Call)
                and isinstance(node.left.func, ast.Attribute)
                and node.left.func.attr == "add"
                and len(node.left.args) == 2
                and isinstance(node.left.args[1], ast.Constant)
                and node.left.args[1].value == 1
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"arrivals counted outside _store: {found}"


def test_first_rank_says_gives_every_rank_its_text_in_one_operation() -> None:
    made = []

    def make(r: int) -> Callable[[], str]:
        return lambda: made.append(r) or f"[{r}, 2.5]"  # a measurement that differs by rank

    n = 16
    out, ops = _ranks(
        n, lambda s, r: first_rank_says(s, "k", make(r), rank=r, ranks=list(range(n)), timeout_s=30, what="x")
    )
    assert out == ["[0, 2.5]"] * n and made == [0]  # measured once, by the first rank
    assert max(ops) == 1, ops


def test_first_rank_says_names_a_first_rank_that_never_arrives() -> None:
    def fn(s: object, r: int) -> object:
        if r == 0:
            return None  # the first rank took another path
        return first_rank_says(
            s, "k", lambda: "[]", rank=r, ranks=[0, 1], timeout_s=1, what="graph 3's timing"
        )

    t0 = time.monotonic()
    out, _ = _ranks(2, fn)
    assert isinstance(out[1], DesyncError) and "rank(s) [0] did not compile graph 3's timing" in str(out[1])
    assert time.monotonic() - t0 < 10


def test_agree_names_the_ranks_that_differ_and_brings_both_texts() -> None:
    n = 8
    text = {r: "a\nb\nc" if r not in (3, 5) else "a\nX\nc" for r in range(n)}
    out, _ = _ranks(
        n, lambda s, r: agree(counted(s, "t"), "k", text[r], rank=r, ranks=list(range(n)), timeout_s=30)
    )
    assert not any(v.same for v in out)
    first = out[0].first
    for v in out:
        assert v.first == first
        assert sorted(v.differing) == ([3, 5] if text[first] == "a\nb\nc" else sorted(set(range(n)) - {3, 5}))
        assert len(set(v.texts.values())) == 2, v.texts  # the reference's text and a differing one


def test_agree_names_a_rank_that_never_arrives() -> None:
    def fn(s: object, r: int) -> object:
        if r == 2:
            return None  # this rank took another path
        return agree(counted(s, "t"), "k", "x", rank=r, ranks=[0, 1, 2], timeout_s=1)

    out, _ = _ranks(3, fn)
    for r in (0, 1):
        assert isinstance(out[r], StoreTimeout) and out[r].missing == [2], out[r]


def test_check_agreement_and_layouts_raise_or_return_as_before() -> None:
    def fn(s: object, r: int) -> object:
        layout = layouts_agree(
            s, "lay", [["w"], ["b"]] if r else [["w", "b"]], rank=r, ranks=[0, 1], timeout_s=30
        )
        try:
            check_agreement(
                s, "g", f"op {r % 2}", rank=r, ranks=[0, 1], timeout_s=30, what="graph 0", fix="Fix it."
            )
        except DesyncError as exc:
            return layout, str(exc)
        return layout, None

    out, _ = _ranks(2, fn)
    assert all(layout is None for layout, _ in out)  # the layouts differ: None on every rank
    for r, (_, msg) in enumerate(out):
        assert (
            msg is not None
            and f"graph 0 differs between rank {r} and rank {1 - r}" in msg
            and "Fix it." in msg
        )
        assert "-op 0" in msg or "+op 0" in msg, msg


@pytest.mark.parametrize("arrive", ["together", "alone"])
def test_compile_together_decides_once_for_every_rank(arrive: str) -> None:
    n = 6

    def fn(s: object, r: int) -> object:
        if arrive == "alone" and r == n - 1:
            return None  # one rank never recompiles
        return compile_together(
            s,
            "c",
            "g",
            rank=r,
            ranks=list(range(n)),
            wait_s=1 if arrive == "alone" else 30,
            what="graph 1",
            fix="",
        )

    out, _ = _ranks(n, fn)
    want = arrive == "together"
    assert [v for v in out if v is not None] == [want] * (n - (arrive == "alone")), out


def test_gather_barrier_and_failure_marks() -> None:
    n = 16

    def fn(s: object, r: int) -> object:
        folders = gather_small(counted(s, "t"), "f", str(r // 4), rank=r, ranks=list(range(n)), timeout_s=30)
        if r in (3, 9):
            mark_failed(s, "job", r, f"rank {r} raised")
        barrier(counted(s, "t"), "b", ranks=list(range(n)), timeout_s=30)
        return folders, failed_ranks(s, "job", list(range(n)))

    out, ops = _ranks(n, fn)
    for folders, failed in out:
        assert folders == {r: str(r // 4) for r in range(n)}
        assert failed == {3: "rank 3 raised", 9: "rank 9 raised"}
    assert max(ops) <= 16, ops  # gather 4 + barrier 2 + a mark 3 + reading the marks 4


def test_the_ranks_behind_a_peer_address_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 8
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # as the tests' gloo groups use
    addresses = host_addresses()
    assert addresses == ["127.0.0.1"], addresses

    def fn(s: object, r: int) -> object:
        mark_address(s, "job", r)
        barrier(counted(s, "t"), "b", ranks=list(range(n)), timeout_s=30)
        return ranks_at(s, "job", "[127.0.0.1]:53634"), ranks_at(s, "job", "[192.0.2.1]:1")

    out, ops = _ranks(n, fn)
    assert out == [(list(range(n)), [])] * n, out  # every rank is on this host; nobody at TEST-NET-1
    assert max(ops) <= len(addresses) + 2 + 3, ops  # an append per address, the barrier, check+get+check


def _wait_until_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is in the stopped state: a stop signal is taken by one
    thread, which then stops the others, and a thread not yet stopped (the store's server
    thread, woken by a request) still answers."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended since the listing
                continue
        if all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 30 s: thread states {states}")


def test_error_path_lookups_give_up_on_a_store_whose_host_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store host that is stopped (SIGSTOP) keeps its connections and never answers: what an
    error path asks (who failed, who is behind an address) comes back empty, and what it
    records is given up, each within LOOKUP_S."""
    code = (
        "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
        "wait_for_workers=False); print(s.port, flush=True); sys.stdin.read()"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        client = dist.TCPStore("127.0.0.1", int(server.stdout.readline()), is_master=False)
        client.set("p/failed", "1;")
        client.set("p/failed/1", "RuntimeError: boom")
        assert failed_ranks(client, "p", [1]) == {1: "RuntimeError: boom"}  # answered while it runs
        monkeypatch.setattr(_store, "LOOKUP_S", 1.0)
        os.kill(server.pid, signal.SIGSTOP)
        _wait_until_stopped(server.pid)  # kill() returns before every thread has stopped
        start = time.monotonic()
        assert failed_ranks(client, "p", [1]) == {} and ranks_at(client, "p", "[10.0.0.2]:4242") == []
        mark_failed(client, "p", 0, "RuntimeError: the error this rank raises next")  # and gives up
        assert time.monotonic() - start < 15, time.monotonic() - start
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait(timeout=60)
