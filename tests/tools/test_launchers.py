"""The launchers, run for real: single node, elastic restart after a SIGKILL, two nodes in namespaces."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distcompile.tools.bench.netns import can_make_namespaces, veth_pair
from tests.harness import child_env

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [
    str(ROOT / "examples" / "train_gpt.py"),
    "--distcompile",
    "--backend",
    "eager",
    "--n-layer",
    "1",
    "--n-embd",
    "32",
]


def _env(**extra: str) -> dict:
    return child_env(OMP_NUM_THREADS="1", **extra)


def _digests(out: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"rank (\d+) final parameter digest (\S+)", out)}


def _local(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "launchers" / "local.sh"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(**env),
        cwd=tmp,
    )


def test_local_launcher(tmp_path: Path) -> None:
    proc = _local([*TRAIN, "--steps", "3"], tmp_path, NPROC="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = _digests(proc.stdout)
    assert set(d) == {0, 1} and d[0] == d[1], proc.stdout


def _workers_of(launcher_pid: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of torchrun's worker processes below ``launcher_pid``."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if not any(e.startswith(b"LOCAL_RANK=") for e in env):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid != launcher_pid:
            continue
        for e in env:
            if e.startswith(b"LOCAL_RANK="):
                found[int(e.split(b"=")[1])] = int(pid)
    return found


@pytest.mark.long  # three torchrun jobs of 60 steps: an end-to-end run, in the long set
def test_elastic_restart_after_sigkill_resumes_without_loss(tmp_path: Path) -> None:
    steps = ["--steps", "60", "--ckpt-every", "5"]
    reference = _local([*TRAIN, *steps], tmp_path, NPROC="2")
    assert reference.returncode == 0, reference.stderr
    ref = _digests(reference.stdout)

    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [str(ROOT / "launchers" / "local.sh"), *TRAIN, *steps, "--ckpt-dir", str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(NPROC="2", MAX_RESTARTS="1"),
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 300
        while not (ckpt / "step-00000009.pt").exists():  # mid-training: after the second checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, "training ended before the kill"
            time.sleep(0.02)
        workers = _workers_of(proc.pid)
        assert 1 in workers, workers
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert "resumed from" in out, out + err
    got = _digests(out)
    # Resumed from the last checkpoint with the same data, optimizer state and RNG: the final
    # parameters are bitwise those of the uninterrupted run (CPU, same kernels, 2 ranks).
    assert got == ref, (got, ref)
    print(f"restart and finish took {time.monotonic() - killed_at:.1f} s after the kill")


@pytest.fixture
def two_namespaces():
    reason = can_make_namespaces()
    if reason:
        pytest.skip(f"cannot create network namespaces here: {reason}")
    try:
        with veth_pair("10.213.7") as pair:
            yield list(zip(pair.namespaces, pair.devices, pair.addresses))
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr!r}")


def test_two_nodes_in_network_namespaces(two_namespaces, tmp_path: Path) -> None:
    endpoint = f"{two_namespaces[0][2]}:29531"
    procs = []
    for node, (ns, veth, addr) in enumerate(two_namespaces):
        env = _env(
            NNODES="2",
            NODE_RANK=str(node),
            NPROC="1",
            RDZV_ENDPOINT=endpoint,
            LOCAL_ADDR=addr,
            GLOO_SOCKET_IFNAME=veth,
            RDZV_ID=f"test{os.getpid()}",
            RDZV_CONF=f"is_host={int(node == 0)}",
        )
        cmd = ["ip", "netns", "exec", ns, str(ROOT / "launchers" / "multinode.sh"), *TRAIN, "--steps", "4"]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            outs.append(out + err)
            assert p.returncode == 0, out + err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    digests = _digests("\n".join(outs))
    assert set(digests) == {0, 1} and digests[0] == digests[1], outs
