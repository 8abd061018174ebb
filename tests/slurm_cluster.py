"""A real two-node SLURM cluster on one machine, for the launcher tests.

Debian's ``slurm-wlm`` daemons, authenticated by ``munge``: ``slurmctld`` and the first
``slurmd`` run in one network namespace (host name ``node1``), the second ``slurmd`` in
another (``node2``), the two joined by a veth pair (``veth_pair``). Each daemon also gets
its own UTS namespace (its host name, which is how a ``slurmd`` finds its node name and
how ``torchrun`` decides which node hosts the rendezvous) and mount namespace (an
``/etc/hosts`` that names both nodes). Everything lives in one folder: configuration,
munge key and socket, state, logs, and each node's own compile cache (a ``TaskProlog``
points ``TORCHINDUCTOR_CACHE_DIR`` at it, as node-local ``/tmp`` would on a real cluster).

Teardown kills every process in both namespaces (the daemons, and any job they still
run), then deletes the namespaces; nothing is sent outside them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from distcompile.tools.bench.netns import can_make_namespaces, veth_pair

__all__ = ["Cluster", "cannot_run", "slurm_cluster"]

_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scancel", "nsenter", "unshare")
NODES = ("node1", "node2")


def cannot_run() -> str | None:
    """``None`` if a cluster can be brought up here, else the reason it cannot."""
    reason = can_make_namespaces()
    if reason:
        return reason
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install slurm-wlm munge util-linux)"
    probe = subprocess.run(
        ["unshare", "--uts", "--mount", "true"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode:
        return f"cannot create UTS and mount namespaces: {probe.stderr.strip()}"
    return None


@dataclass(frozen=True, slots=True)
class Cluster:
    """Attributes: ``root`` (its folder), ``namespaces`` (of node1, node2), ``env`` (for clients)."""

    root: Path
    namespaces: tuple[str, str]
    env: dict[str, str]

    def in_node(self, node: int, *cmd: str) -> list[str]:
        """``cmd`` run in node ``node``'s network namespace (node 0 is also the login node)."""
        return ["nsenter", f"--net=/run/netns/{self.namespaces[node]}", *cmd]

    def client(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a SLURM client command (``sinfo``, ``scancel``) on the login node."""
        return subprocess.run(
            self.in_node(0, *cmd), capture_output=True, text=True, timeout=timeout, env=self.env
        )

    def submit(self, *args: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
        """``sbatch --wait --parsable ARGS`` from the login node, in ``cwd``; its stdout is the job id."""
        return subprocess.Popen(
            self.in_node(0, "sbatch", "--wait", "--parsable", *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env={**env, **self.env},
        )

    def pids(self, node: int) -> list[int]:
        """Every process in node ``node``'s network namespace."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True, timeout=30
        ).stdout
        return [int(p) for p in out.split()]

    def logs(self) -> str:
        """The daemons' logs, for a failure message."""
        parts = []
        for log in sorted(self.root.glob("**/*.log")):
            parts.append(f"--- {log.relative_to(self.root)}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)


def _config(root: Path, addresses: tuple[str, str]) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={os.cpu_count()}" for n, a in zip(NODES, addresses))
    return f"""\
ClusterName=distcompile-test
SlurmctldHost={NODES[0]}({addresses[0]})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/ctld
SlurmctldPidFile={root}/ctld/slurmctld.pid
SlurmctldLogFile={root}/ctld/slurmctld.log
SlurmdSpoolDir={root}/%n
SlurmdPidFile={root}/%n/slurmd.pid
SlurmdLogFile={root}/%n/slurmd.log
# The nodes share one machine's cores; take the configured CPUs at their word.
SlurmdParameters=config_overrides
# No cgroups: the namespaces' processes are tracked through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={root}/taskprolog.sh
SelectType=select/linear
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _write_files(root: Path, addresses: tuple[str, str]) -> None:
    munge = root / "munge"
    munge.mkdir(mode=0o700, parents=True)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for sub in ("ctld", *NODES):
        (root / sub).mkdir()
    (root / "hosts").write_text(
        "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in zip(NODES, addresses))
    )
    prolog = root / "taskprolog.sh"
    # A TaskProlog's "export" lines set the task's environment: a compile cache per node.
    prolog.write_text(f'#!/bin/sh\necho "export TORCHINDUCTOR_CACHE_DIR={root}/$SLURMD_NODENAME/inductor"\n')
    prolog.chmod(0o755)
    (root / "slurm.conf").write_text(_config(root, addresses))


def _wait_idle(cluster: Cluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    states = ""
    while time.monotonic() < deadline:
        states = cluster.client("sinfo", "--noheader", "--Node", "--format=%N %T").stdout
        if sorted(states.split()) == sorted([*NODES, "idle", "idle"]):
            return
        time.sleep(0.5)
    raise RuntimeError(
        f"the SLURM nodes did not come up idle in {timeout:.0f} s: {states!r}\n{cluster.logs()}"
    )


@contextlib.contextmanager
def slurm_cluster(root: Path, *, subnet: str) -> Iterator[Cluster]:
    """Bring the cluster up in ``root`` (addresses ``{subnet}.1``, ``{subnet}.2``); tear it down.

    Example:
        >>> # with slurm_cluster(tmp_path / "slurm", subnet="10.213.11") as cluster:
        >>> #     cluster.submit("--nodes", "2", "job.sbatch", cwd=tmp_path, env=os.environ).wait()
    """
    with veth_pair(subnet) as link:
        _write_files(root, link.addresses)
        cluster = Cluster(root, link.namespaces, {"SLURM_CONF": str(root / "slurm.conf")})
        daemons: list[subprocess.Popen] = []

        def start(node: int, command: str) -> None:
            # Own host name and /etc/hosts for the daemon and everything it starts.
            script = f"mount --bind {root}/hosts /etc/hosts && hostname {NODES[node]} && exec {command}"
            cmd = cluster.in_node(node, "unshare", "--uts", "--mount", "sh", "-c", script)
            log = open(root / f"{command.split()[0]}-{NODES[node]}.out", "w")  # noqa: SIM115 - the daemon's
            daemons.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **cluster.env})
            )
            log.close()

        try:
            m = root / "munge"
            start(
                0,
                f"munged -F -f -S {m}/munge.sock --key-file={m}/munge.key --log-file={m}/munged.log "
                f"--pid-file={m}/munged.pid --seed-file={m}/munged.seed",
            )
            time.sleep(0.5)  # the socket, before slurmctld authenticates its first message
            start(0, "slurmctld -D -i")
            for node in range(len(NODES)):
                start(node, "slurmd -D")
            _wait_idle(cluster)
            yield cluster
        finally:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                cluster.client("scancel", "--full", "--user=root", timeout=10)
            for node in range(len(NODES)):
                for pid in cluster.pids(node):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
            for d in daemons:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.wait(timeout=10)
