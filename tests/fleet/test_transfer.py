"""Compiles shared across cache folders through the job's store (Note [Compiles shared across cache folders])."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import pytest
import torch.distributed as dist
from torch import fx, nn

import distcompile.fleet.peers as peers_module
from distcompile import _torch_compat as compat
from distcompile.compile.jobs import CompileJob
from distcompile.fleet import transfer
from distcompile.fleet.sharing import CompileSharing
from tests import artifact_workers, workers
from tests.harness import run_ranks
from tests.runtime.test_parity import TOL, _check

_FP = {"torch": "2.13.0", "cpu_isa": "avx2"}


def test_a_container_holds_the_entries_and_the_libraries_and_refuses_damage() -> None:
    blob = transfer.pack(b"entries", {"ab/kab.so": b"lib1", "cd/kcd.so": b"lib2"})
    assert transfer.unpack(blob) == (b"entries", {"ab/kab.so": b"lib1", "cd/kcd.so": b"lib2"})
    damaged = blob[:-1] + b"X"  # a library's last byte
    with pytest.raises(ValueError, match="does not match its hash"):
        transfer.unpack(damaged)
    with pytest.raises(ValueError, match="holds 3 bytes more"):
        transfer.unpack(blob + b"xyz")
    with pytest.raises(ValueError, match="not a distcompile artifact container"):
        transfer.unpack(b"\x00" * 8 + b"{}")


def test_the_store_carries_a_payload_in_chunks_and_checks_hash_and_fingerprint(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(transfer, "CHUNK_BYTES", 10)
    store = dist.HashStore()
    payload = bytes(range(256)) * 3
    transfer.publish(store, "k", payload, _FP)
    assert json.loads(store.get("k/meta"))["chunks"] == 77
    assert transfer.fetch(store, "k", _FP) == (payload, None)
    got, why = transfer.fetch(store, "k", {**_FP, "cpu_isa": "avx512"})
    assert got is None and why.reason == "setup" and "cpu_isa 'avx2' there, 'avx512' here" in str(why)
    store.set("k/3", b"0123456789")  # a chunk damaged in transit
    got, why = transfer.fetch(store, "k", _FP)
    assert got is None and why.reason == "damaged" and "do not match the hash" in str(why)
    assert transfer.fetch(store, "nothing", _FP) == (
        None,
        transfer.Unusable("missing", "nothing was published (its compile or its packing failed)"),
    )


def test_install_writes_libraries_inside_the_cache_folder_only(tmp_path) -> None:  # noqa: ANN001
    tmp_path = tmp_path / "inductor"
    assert compat.inductor_cache_dir() == str(tmp_path)
    transfer.install(transfer.pack(b"", {"ab/kab.so": b"\x7fELF..."}))
    lib = tmp_path / "ab" / "kab.so"
    assert lib.read_bytes() == b"\x7fELF..." and os.access(lib, os.X_OK)
    for bad in ("../evil.so", "ab/notalib.py"):
        with pytest.raises(ValueError, match="outside the cache folder"):
            transfer.install(transfer.pack(b"", {bad: b"x"}))
    assert not (tmp_path.parent / "evil.so").exists()
    # A CPU check's load mark is written after its library, and only empty.
    transfer.install(transfer.pack(b"", {"cd/kcd.so.load_ok": b"", "cd/kcd.so": b"\x7fELF"}))
    mark = tmp_path / "cd" / "kcd.so.load_ok"
    assert (
        mark.read_bytes() == b""
        and mark.stat().st_mtime_ns >= (tmp_path / "cd" / "kcd.so").stat().st_mtime_ns
    )
    with pytest.raises(ValueError, match="is not empty"):
        transfer.install(transfer.pack(b"", {"cd/kce.so.load_ok": b"x"}))


@pytest.fixture(autouse=True)
def _own_cache_folder(monkeypatch, tmp_path) -> None:  # noqa: ANN001, PT004
    # compile_all leaves a marker in the cache folder (warm_marker): not in the user's.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def _sharing(store: dist.Store, rank: int) -> CompileSharing:
    s = CompileSharing(lambda: store, "t", rank=rank, ranks=(0, 1), timeout_s=0.2)
    s.peers, s.folders = (rank,), {0: 0, 1: 1}  # as find_peers finds two folders
    # The other rank's part of warm_ranks (Note [The control plane]: gather_small): its folder is cold too.
    store.append("t/g/warm/all", f"{1 - rank}=0;")
    store.add("t/g/warm/n", 1)
    store.set("t/tree/broken", "1")  # the store's path, as after a failure in the leaders' tree
    return s


def _jobs() -> list[CompileJob]:
    big = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    return [CompileJob(big, [], "big"), CompileJob(fx.symbolic_trace(nn.ReLU()), [], "small")]


def test_pieces_a_peer_published_badly_are_compiled_here(caplog) -> None:  # noqa: ANN001
    store = dist.HashStore()
    transfer.publish(store, "t/g/art/1", b"not a container", compat.build_fingerprint())
    store.set("t/g/art/1/ready", "1")
    jobs = _jobs()
    compiled: list[str] = []
    with caplog.at_level(logging.WARNING):
        out = _sharing(store, 0).compile_all(
            jobs, compile_one=lambda j: compiled.append(j.key) or j.key, graph="g"
        )
    assert out == ["big", "small"] and compiled == ["big", "small"]  # its own share, then rank 1's
    assert (
        "not loading rank 1's compiled pieces: ValueError: not a distcompile artifact container"
        in caplog.text
    )


def test_a_peer_of_another_folder_that_never_publishes_is_not_waited_for_forever(caplog, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(peers_module, "PEER_WAIT_S", 0.5)
    jobs = _jobs()
    with caplog.at_level(logging.INFO):
        out = _sharing(dist.HashStore(), 0).compile_all(jobs, compile_one=lambda j: j.key, graph="g")
    assert out == ["big", "small"]
    assert "rank 1 did not finish its share of the compiles" in caplog.text
    assert "nothing was published" in caplog.text


def _pieces_line(result: dict) -> str:
    return next(x for x in result["log"] if "pieces:" in x)


# A GPT (several distinct pieces, split between the ranks) and a graph of one piece (one
# rank compiles it whole, the other loads it).
# Both in the long set (the README command stays under 8 minutes; tests/compile/test_tree.py keeps
# compiles between folders in it).
MODELS = [pytest.param("gpt", marks=pytest.mark.long), pytest.param("one_piece", marks=pytest.mark.long)]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_ranks_with_separate_folders_compile_each_piece_once(model: str) -> None:
    """2 ranks, each with an empty cache folder of its own (no shared filesystem): each piece
    is compiled once in the job, the other rank loads it through the store, and training
    matches eager DDP."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        results = run_ranks(workers.shared_compile, 2, [a, b], model, timeout=900)
        libs = [sorted(f for _, _, fs in os.walk(d) for f in fs if f.endswith(".so")) for d in (a, b)]
    _check(results, TOL["inductor"])
    jobs = sum(p - r for p, r in zip(results[0]["pieces"], results[0]["pieces_reused"]))
    compiled = [r["aot_compiled"] for r in results]
    assert sum(compiled) == jobs and (jobs >= 2) == (model == "gpt"), (jobs, compiled)
    assert min(compiled) >= 1 or jobs == 1, compiled  # split when there is more than one
    assert [r["aot_hits"] for r in results] == [jobs - c for c in compiled]
    for r, c in zip(results, compiled):
        line = _pieces_line(r)
        assert not c or f"{c} compiled here" in line, line
        assert c == jobs or f"{jobs - c} from other-folder peers" in line, line
    assert libs[0] and set(libs[0]) & set(libs[1]), libs  # C++ kernels travelled too


@pytest.mark.long  # about 40 s; CI runs it after the README's command
def test_a_trace_restarted_on_every_rank_is_still_compiled_once() -> None:
    """Under dynamic=True TorchDynamo restarts the trace of the GPT's first graph from inside
    the backend, on both ranks: the retry is agreed and shared under keys of its own (the
    first attempt's were stale: one rank compiled everything, the other alone)."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        results = run_ranks(workers.shared_compile, 2, [a, b], "gpt", "dynamic_true", timeout=900)
    _check(results, TOL["inductor"])
    for r in results:
        first = next(x for x in r["log"] if x.startswith("graph 0 compiled in"))
        assert "compiled here, " in first and "from other-folder peers" in first, r["log"]
        assert "; control plane: " in first and " store ops, " in first, first
        assert not any("not loading" in x for x in r["log"]), r["log"]


@pytest.mark.long  # two runs of the job (about a minute); CI runs it after the README's command
@pytest.mark.torch_compat
@pytest.mark.parametrize("model", ["gpt", "one_piece"])
def test_after_a_restart_a_rank_whose_folder_was_emptied_loads_everything(model: str) -> None:
    """The job ran once (both folders warm); then one folder is emptied, as on a replacement
    node: at the restart that rank compiles nothing, the warm rank loads its cache and
    publishes every piece."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        run_ranks(workers.shared_compile, 2, [a, b], model, timeout=900)
        shutil.rmtree(b)
        os.makedirs(b)
        results = run_ranks(workers.shared_compile, 2, [a, b], model, timeout=900)
    _check(results, TOL["inductor"])
    jobs = sum(p - r for p, r in zip(results[0]["pieces"], results[0]["pieces_reused"]))
    assert [r["aot_compiled"] for r in results] == [0, 0], [r["aot_compiled"] for r in results]
    lines = [_pieces_line(r) for r in results]
    assert f"{jobs} from the cache" in lines[0] and f"{jobs} from other-folder peers" in lines[1], lines
    assert any("its compile cache is cold" in x for x in results[1]["log"]), results[1]["log"]
    # The CPU checks' libraries came with their load marks: none loaded in a process of its own.
    assert results[1]["check_loads"] == 0, results[1]["check_loads"]


@pytest.mark.long  # two runs of the job; CI runs it after the README's command
@pytest.mark.torch_compat
def test_a_job_resumed_on_empty_caches_installs_the_pieces_saved_with_its_checkpoint() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shared, fresh = os.path.join(tmp, "node"), [os.path.join(tmp, f"fresh{r}") for r in (0, 1)]
        ckpt = os.path.join(tmp, "ckpt")
        trained = run_ranks(artifact_workers.train_or_resume, 2, [shared, shared], ckpt, "train", timeout=900)
        assert sorted(os.listdir(ckpt)) == ["step-00000001.compile", "step-00000001.pt"]
        resumed = run_ranks(artifact_workers.train_or_resume, 2, fresh, ckpt, "resume", timeout=900)
    assert sum(r["compiled"] for r in trained) >= 2
    assert [r["compiled"] for r in resumed] == [0, 0], [r["compiled"] for r in resumed]  # all from the cache
    assert all(r["hits"] >= 2 for r in resumed)
    for t, r in zip(trained, resumed):  # the resumed step is the uninterrupted run's step 2
        assert abs(t["last_loss"] - r["last_loss"]) <= 1e-5 * abs(t["last_loss"]), (
            t["last_loss"],
            r["last_loss"],
        )
        assert any("installed in the compile cache" in x for x in r["log"]), r["log"]


def test_pieces_saved_on_another_setup_are_not_installed(tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    from torch import nn as torch_nn

    import distcompile

    model = torch_nn.Linear(2, 2)
    distcompile.save_checkpoint(str(tmp_path), model=model, optimizer=None, step=0, compile_artifacts=True)
    assert (tmp_path / "step-00000000.compile").exists()
    real = compat.build_fingerprint
    monkeypatch.setattr(compat, "build_fingerprint", lambda: {**real(), "torch": "9.9.9"})
    with caplog.at_level(logging.INFO):
        distcompile.load_checkpoint(str(tmp_path), model=model)
    assert "not installed: built with another setup (torch" in caplog.text


def test_a_peer_that_stops_beating_is_waited_for_desync_timeout_s_only(caplog, monkeypatch) -> None:  # noqa: ANN001
    """Killed or hung mid-compile: no heartbeat, so not the 10 minutes a live peer's compile gets."""
    import time

    monkeypatch.setattr(peers_module, "PEER_WAIT_S", 100.0)
    store = dist.HashStore()
    waiter = CompileSharing(lambda: store, "t", rank=0, ranks=(0, 1), timeout_s=0.5)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        waiter._wait_for(store, "t/g/never", 1, "g")
    assert time.monotonic() - t0 < 5
    assert (
        "no sign of life from it for 0 s: killed or hung" in caplog.text or "for 1 s: killed" in caplog.text
    )


def test_a_peer_that_beats_is_waited_for_past_desync_timeout_s(caplog) -> None:  # noqa: ANN001
    import threading
    import time

    from distcompile.fleet.peers import Heartbeat

    store = dist.HashStore()
    waiter = CompileSharing(lambda: store, "t", rank=0, ranks=(0, 1), timeout_s=0.4)

    def slow_peer() -> None:  # compiles for 2 s (5 x desync_timeout_s), beating
        with Heartbeat(store, "t/beat/1", 0.4):
            time.sleep(2.0)
        store.set("t/g/done", "1")

    peer = threading.Thread(target=slow_peer)
    t0 = time.monotonic()
    peer.start()
    with caplog.at_level(logging.WARNING):
        waiter._wait_for(store, "t/g/done", 1, "g")
    peer.join()
    assert time.monotonic() - t0 >= 1.9 and "did not finish" not in caplog.text


@pytest.mark.long  # keeps the README's command near 10 minutes; CI runs it after that command
def test_a_peer_killed_mid_compile_does_not_stall_the_other() -> None:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        out = run_ranks(artifact_workers.killed_mid_compile, 2, [a, b], timeout=600, may_die=(1,))
    res = out[0]
    compiled = next(x for x in res["log"] if "compiled in" in x)
    assert any("rank 1 did not finish its share" in x and "no sign of life" in x for x in res["log"]), res[
        "log"
    ]
    assert "compiled here" in compiled and res["ended"] != "finished", (compiled, res["ended"])
