"""The launchers, run for real: single node, elastic restart after a SIGKILL, two nodes in
namespaces, and a real two-node SLURM cluster (``tests/slurm_cluster.py``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distcompile.tools.bench.netns import can_make_namespaces, veth_pair
from tests.harness import child_env
from tests.slurm_cluster import cannot_run, slurm_cluster

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
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = _local([*TRAIN, "--steps", "3"], tmp_path, NPROC="2", TMPDIR=str(scratch))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (
        "distcompile: 1 life of the process group: recovered from 0 failure(s); the last life closed normally"
    )
    assert summary in proc.stderr, proc.stderr
    assert not list(scratch.glob("distcompile-events.*"))  # the launcher's own event file is removed
    d = _digests(proc.stdout)
    assert set(d) == {0, 1} and d[0] == d[1], proc.stdout


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _workers_of(launcher_pid: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of torchrun's worker processes below ``launcher_pid`` (torchrun or the
    launcher script that runs it)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if not any(e.startswith(b"LOCAL_RANK=") for e in env):
            continue
        agent = _parent(int(pid))
        if launcher_pid not in (agent, _parent(agent)):
            continue
        for e in env:
            if e.startswith(b"LOCAL_RANK="):
                found[int(e.split(b"=")[1])] = int(pid)
    return found


@pytest.mark.long  # a torchrun job stopped early: a launcher behaviour, in the long set
def test_sigterm_to_the_launcher_alone_stops_the_job(tmp_path: Path) -> None:
    # A supervisor that signals the launcher's pid (not its process group) must stop the
    # workers too: the launcher forwards the signal to torchrun (launchers/torchrun.bash).
    proc = subprocess.Popen(
        [str(ROOT / "launchers" / "local.sh"), *TRAIN, "--steps", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(NPROC="2"),
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while len(workers := _workers_of(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no workers started"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out + err  # stopped, not finished
    assert "distcompile: " in err, err  # the event log's summary, whatever the workers reached
    left = [pid for pid in workers.values() if Path(f"/proc/{pid}").exists()]
    assert not left, f"workers {left} still running after the launcher exited"


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
    # The launcher's summary: one failure recovered from, and where the second life resumed.
    assert "2 lives of the process group: recovered from 1 failure(s)" in err, err
    assert "resumed from" in err.split("recovered from 1 failure", 1)[1], err
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


@pytest.mark.long  # two torchrun nodes in namespaces (about 20 s); test_local_launcher runs the launcher in the README's command
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


@pytest.fixture
def slurm(tmp_path: Path):
    reason = cannot_run()
    if reason:
        pytest.skip(f"cannot bring up a SLURM cluster here: {reason}")
    root = tmp_path / "slurm"
    root.mkdir()
    with slurm_cluster(root, subnet="10.213.11") as cluster:
        yield cluster


# Inductor (the default backend), each node with its own empty compile cache at first; two
# layers, so that the graph has several distinct pieces to split between the nodes.
SLURM_TRAIN = [*TRAIN[:2], *"--n-layer 2 --n-embd 32 --steps 200 --ckpt-every 10 --ckpt-dir ckpt".split()]


def _sbatch(cluster, job_dir: Path) -> subprocess.Popen:  # noqa: ANN001 - a tests.slurm_cluster.Cluster
    """``sbatch --nodes 2 launchers/slurm.sbatch examples/train_gpt.py ...``, as docs/launching.md says."""
    job_dir.mkdir()
    script = str(ROOT / "launchers" / "slurm.sbatch")
    return cluster.submit("--nodes", "2", script, *SLURM_TRAIN, cwd=job_dir, env=_env())


def _finish(cluster, proc: subprocess.Popen, job_dir: Path) -> str:  # noqa: ANN001
    """Wait for the job; its output file, after checking that it succeeded."""
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()  # then fail below with what it printed and the daemons' logs
        out, err = proc.communicate()
    found = list(job_dir.glob(f"distcompile-{out.strip()}.out"))
    log = found[0].read_text() if found else f"(no output file for job {out.strip()!r})"
    assert proc.returncode == 0, f"sbatch exited {proc.returncode}: {err}\n{log}\n{cluster.logs()}"
    return log


def _torchrun_on(cluster, node: int) -> int:  # noqa: ANN001
    for pid in cluster.pids(node):
        with contextlib.suppress(OSError):
            if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"no torchrun in node {node + 1}'s namespace")


@pytest.mark.long  # a SLURM cluster and two 200-step jobs over two nodes
def test_slurm_two_nodes_and_a_killed_worker(slurm, tmp_path: Path) -> None:
    first = _finish(slurm, _sbatch(slurm, tmp_path / "job1"), tmp_path / "job1")
    ref = _digests(first)
    assert set(ref) == {0, 1} and ref[0] == ref[1], first
    # One compile per job: node 1's rank took pieces compiled on node 2 through the store.
    assert re.search(r"pieces: \d+ compiled here, \d+ from other-folder peers", first), first
    for node in ("node1", "node2"):  # each node's own cache holds them
        assert any((slurm.root / node / "inductor").iterdir()), node

    job = tmp_path / "job2"
    proc = _sbatch(slurm, job)
    try:
        deadline = time.monotonic() + 300
        while not (job / "ckpt" / "step-00000059.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended before the kill"
            time.sleep(0.02)
        # Node 1 comes back as if replaced: its cache is emptied (its worker has loaded its
        # kernels already), then node 2's worker is killed.
        shutil.rmtree(slurm.root / "node1" / "inductor")
        workers = _workers_of(_torchrun_on(slurm, 1))
        assert 0 in workers, workers
        os.kill(workers[0], signal.SIGKILL)  # node 2's only worker: rank 1
    finally:
        second = _finish(slurm, proc, job)
    before, resumed, after = second.partition("resumed from")
    assert resumed, second
    assert "compiled here" not in before, second  # both caches warm from the first job
    # Rank 0, on the emptied node, compiled nothing: it loaded every piece from node 2.
    assert re.search(r"pieces: \d+ from other-folder peers", after), second
    assert "compiled here" not in after, second
    # Resumed from the newest checkpoint: the parameters of the uninterrupted job, bitwise
    # (same kernels from the same caches, the same bucket layout, two ranks).
    assert _digests(second) == ref, second
