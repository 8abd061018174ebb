"""The faults themselves, done to real processes, links and folders.

Processes are found through ``/proc``: every process a chaos run starts carries
``DISTCOMPILE_CHAOS_RUN`` (the run's tag) and ``DISTCOMPILE_CHAOS_NODE`` in its
environment, and torchrun's workers also ``LOCAL_RANK``. Links are changed with ``tc netem``
inside the node's namespace; a kill during a checkpoint waits for the checkpoint's
temporary file to appear and kills the writing rank at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "NODE_ENV",
    "RUN_ENV",
    "empty_folder",
    "kill",
    "kill_during_write",
    "link_fault",
    "processes",
    "signal_all",
]

RUN_ENV, NODE_ENV = "DISTCOMPILE_CHAOS_RUN", "DISTCOMPILE_CHAOS_NODE"


def _environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


def processes(tag: str, *, node: int | None = None, workers_only: bool = True) -> dict[int, int]:
    """pid -> LOCAL_RANK (-1 for a launcher or agent) of the live processes of run ``tag``
    (on ``node`` only, if given; only torchrun's workers with ``workers_only``).

    Example:
        >>> processes("no-such-run")
        {}
    """
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        env = _environ(pid)
        if env.get(RUN_ENV) != tag or (node is not None and env.get(NODE_ENV) != str(node)):
            continue
        if workers_only and "LOCAL_RANK" not in env:
            continue
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie: already dead
            found[int(pid)] = int(env.get("LOCAL_RANK", -1))
    return found


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to ``pid``; False if it was gone already.

    Example:
        >>> kill(2**22 + 1)
        False
    """
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_all(pids: list[int], sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every pid of ``pids``; how many were alive.

    Example:
        >>> signal_all([])
        0
    """
    return sum(kill(p, sig) for p in pids)


#: The bad link: its rate cut to this, with up to ``LINK_QUEUE`` of queueing (tbf), and
#: ``LINK_LOSS_PERCENT`` of its packets dropped each way (nftables). tc's netem (a fixed
#: delay, random loss) would be the usual tool; the kernel here has no sch_netem.
LINK_RATE, LINK_QUEUE, LINK_LOSS_PERCENT = "20mbit", "50ms", 1


def link_fault(namespace: str, device: str, on: bool) -> str:
    """Make ``device`` in ``namespace`` a bad link (``on``) or a good one again; what was done.

    Loss needs ``nft`` (Debian's nftables); without it the link is only slowed, and the
    description says so.

    Example:
        >>> # link_fault("dcab12n1", "dcab121", True); ...; link_fault("dcab12n1", "dcab121", False)
    """
    ns = ["ip", "netns", "exec", namespace]
    table = "dc_chaos"
    if not on:
        subprocess.run([*ns, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True, timeout=30)
        subprocess.run([*ns, "nft", "delete", "table", "inet", table], capture_output=True, timeout=30)
        return "link restored"
    subprocess.run(
        [*ns, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", LINK_RATE,
         "burst", "32kb", "latency", LINK_QUEUE],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    what = f"{LINK_RATE} with up to {LINK_QUEUE} of queueing"
    if shutil.which("nft") is None:
        return what + " (no packet loss: nft not installed)"
    rules = f"""table inet {table} {{
        chain out {{ type filter hook output priority 0; oifname "{device}" numgen random mod 100 < {LINK_LOSS_PERCENT} drop; }}
        chain in {{ type filter hook input priority 0; iifname "{device}" numgen random mod 100 < {LINK_LOSS_PERCENT} drop; }}
    }}"""
    subprocess.run(
        [*ns, "nft", "-f", "-"], input=rules, text=True, check=True, capture_output=True, timeout=30
    )
    return what + f", {LINK_LOSS_PERCENT}% of packets dropped each way"


def kill_during_write(
    ckpt_dir: str, pid_of_writer: Callable[[], int | None], deadline: float
) -> tuple[bool, str]:
    """Wait for a checkpoint's temporary file in ``ckpt_dir``, then SIGKILL the writing rank.

    ``pid_of_writer()`` gives the writing rank's pid (rank 0's, looked up again while waiting,
    as it changes at restarts). Returns (landed inside the write, the temporary file's name):
    True when the temporary file was still there after the kill, so the process died with
    the checkpoint half written.

    Example:
        >>> kill_during_write("/nonexistent", lambda: None, time.time())
        (False, '')
    """
    while time.time() < deadline:
        with contextlib.suppress(OSError):
            tmp = next((e.name for e in os.scandir(ckpt_dir) if ".tmp-" in e.name), None)
            if tmp:
                pid = pid_of_writer()
                if pid and kill(pid):
                    time.sleep(0.2)
                    return os.path.exists(os.path.join(ckpt_dir, tmp)), tmp
        time.sleep(0.0005)
    return False, ""


def empty_folder(path: str) -> int:
    """Delete everything in ``path`` (a node's compile cache); the number of entries removed.

    Example:
        >>> empty_folder("/nonexistent")
        0
    """
    if not os.path.isdir(path):
        return 0
    entries = os.listdir(path)
    for e in entries:
        full = os.path.join(path, e)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(full)
    return len(entries)
