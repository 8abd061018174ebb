"""The job's event log: a line of JSON per event, for launchers and tools to read after a fault.

Off unless the environment names a file (``DISTCOMPILE_EVENTS``; the launchers in
``launchers/`` set one per node). Then every rank appends what a person or a tool needs to
tell what happened to a job that was restarted: each life of the process group (``start``:
rank, world, torchrun's restart count, pid), the checkpoint it resumed from
(``resumed``), checkpoints written (``checkpoint``), each graph's compile and where its
pieces came from (``compiled``), the synchronized steps (``step``, from the first rank of
each node only), the first error a rank raised (``error``) and ``close``. Writes are one
``write`` of one line to a file opened for appending, so ranks and nodes may share the
file; a write that fails is dropped (the log never stops training).

``summary(paths)`` turns the log into the few lines the launchers print at the end of a job
(``distcompile events FILE ...``): how many times the job was restarted, why,
where each life resumed and how far the job got.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable

__all__ = ["ENV", "emit", "enabled", "read", "started", "summary"]

#: The variable that names the event file.
ENV = "DISTCOMPILE_EVENTS"

_life: dict[str, object] = {}


def enabled(*, first_of_node: bool = False) -> bool:
    """Whether events are written (``DISTCOMPILE_EVENTS`` names a file); with ``first_of_node``,
    and this is the node's first rank (``LOCAL_RANK`` 0, or unset).

    Example:
        >>> isinstance(enabled(first_of_node=True), bool)
        True
    """
    return bool(os.environ.get(ENV)) and (not first_of_node or os.environ.get("LOCAL_RANK", "0") == "0")


def started() -> bool:
    """Whether this process opened its life in the log (its first ``wrap`` did).

    Example:
        >>> isinstance(started(), bool)
        True
    """
    return bool(_life)


def emit(kind: str, **fields: object) -> None:
    """Append one event of ``kind`` with ``fields`` (and the time, pid, rank and life of the group).

    ``kind="start"`` fields (``rank``, ``world``, ``life``) are kept and repeated in every
    later event of this process. Never raises.

    Example:
        >>> emit("checkpoint", step=9, path="ckpt/step-00000009.pt")  # a no-op without DISTCOMPILE_EVENTS
    """
    path = os.environ.get(ENV)
    if not path:
        return
    if kind == "start":
        _life.update(fields)
        fields = {
            **fields,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "host": socket.gethostname(),
        }
    event = {"t": round(time.time(), 3), "kind": kind, "pid": os.getpid(), **_life, **fields}
    try:
        line = (json.dumps(event, default=str) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass


def read(paths: Iterable[str]) -> list[dict]:
    """Every event in ``paths``, by time (lines that do not parse, e.g. cut by a kill, skipped).

    Example:
        >>> read([])
        []
    """
    events = []
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return sorted(events, key=lambda e: e.get("t", 0.0))


def _lives(events: list[dict]) -> list[list[dict]]:
    """The events split by life of the process group, in the order the lives started."""
    order: dict[str, list[dict]] = {}
    for e in events:
        order.setdefault(str(e.get("life")), []).append(e)
    return [evs for life, evs in order.items() if life != "None"]


def summary(paths: Iterable[str]) -> str:
    """A few lines on the job: its lives, why each ended, where each resumed, how far it got.

    Example:
        >>> summary([])
        'distcompile: no events recorded'
    """
    lives = _lives(read(paths))
    if not lives:
        return "distcompile: no events recorded"
    lines = []
    for i, evs in enumerate(lives):
        world = next((e.get("world") for e in evs if e["kind"] == "start"), "?")
        resumed = next((e for e in evs if e["kind"] == "resumed"), None)
        steps = max((int(e.get("n", 0)) for e in evs if e["kind"] == "step"), default=0)
        errors = [e for e in evs if e["kind"] == "error"]
        if resumed:
            start = f"resumed from {resumed['path']}, {steps} steps seen"
        elif steps:
            start = f"started fresh, {steps} steps seen"
        else:  # stopped while it started: whether it would have resumed is not known
            start = "no checkpoint loaded and no step seen"
        lines.append(f"  life {i + 1}: {world} ranks, {start}")
        for e in errors[:3]:
            lines.append(f"    rank {e.get('rank')}: {e.get('error')}: {e.get('message', '')[:300]}")
        if not errors and i + 1 < len(lives):
            lines.append("    ended without an error from distcompile (a process was killed or exited)")
    ended = "closed normally" if any(e["kind"] == "close" for e in lives[-1]) else "did not close"
    head = (
        f"distcompile: {len(lives)} li{'ves' if len(lives) > 1 else 'fe'} of the process group: recovered "
        f"from {len(lives) - 1} failure(s); the last life {ended}"
    )
    return "\n".join([head, *lines])
