"""What the chaos run knows of the job: the nodes' event logs (``distcompile._events``), read as they grow.

Each node's ranks write their own file. A life of the process group (every rank's ``start``
with one ``life`` id) begins after each restart; a step event carries the count of
synchronized steps since ``wrap``, which becomes the training step through the checkpoint
the life resumed from (the example trains step ``s`` on the data of step ``s``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Life", "Monitor"]


@dataclass
class Life:
    """One life of the process group, as seen in the events.

    Attributes:
        life: Its id (the store prefix its first ``wrap`` drew).
        started: Time of its first ``start``.
        pids: rank -> pid.
        resumed: The checkpoint step it resumed from (``None``: it started fresh).
        steps: (time, training step) of every step, when the first node reported it.
        compiled_here: node -> pieces compiled on that node (not loaded) in this life.
        errors: The ``error`` events of its ranks.
    """

    life: str
    started: float
    pids: dict[int, int] = field(default_factory=dict)
    resumed: int | None = None
    steps: list[tuple[float, int]] = field(default_factory=list)
    compiled_here: dict[int, int] = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)

    def step_of(self, n: int) -> int:
        """The training step of this life's ``n``-th synchronized step (1-based)."""
        return (self.resumed + 1 if self.resumed is not None else 0) + n - 1


class Monitor:
    """Reads the nodes' event files as they grow.

    Example:
        >>> m = Monitor(["/nonexistent"]); m.poll(); m.current() is None
        True
    """

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self._offsets = [0] * len(paths)
        self.lives: dict[str, Life] = {}
        self.checkpoints: list[tuple[float, int]] = []
        self.closed = 0

    def poll(self) -> None:
        """Read what the files gained since the last poll."""
        for node, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[node])
                    data = f.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]
            self._offsets[node] += len(complete)
            for line in complete.splitlines():
                try:
                    self._take(node, json.loads(line))
                except ValueError:
                    continue

    def _take(self, node: int, e: dict) -> None:
        life = self.lives.get(str(e.get("life")))
        if e["kind"] == "start":
            life = self.lives.setdefault(e["life"], Life(e["life"], e["t"]))
            life.pids[e["rank"]] = e["pid"]
        if life is None:
            return
        if e["kind"] == "resumed":
            life.resumed = e["step"]
        elif e["kind"] == "step":  # one line per node and step: the first node's counts
            step = life.step_of(e["n"])
            if not life.steps or step > life.steps[-1][1]:
                life.steps.append((e["t"], step))
        elif e["kind"] == "compiled":
            here = int(e.get("sources", {}).get("compiled here", 0))
            life.compiled_here[node] = life.compiled_here.get(node, 0) + here
        elif e["kind"] == "checkpoint":
            self.checkpoints.append((e["t"], e["step"]))
        elif e["kind"] == "error":
            life.errors.append({**e, "node": node})
        elif e["kind"] == "close":
            self.closed += 1

    def current(self) -> Life | None:
        """The newest life, or ``None`` before the first ``start``."""
        return max(self.lives.values(), key=lambda lf: lf.started, default=None)

    def last_step(self) -> tuple[float, int] | None:
        """(time, training step) of the newest step of the newest life."""
        life = self.current()
        return life.steps[-1] if life and life.steps else None

    def wait(self, done: Callable[[], object], timeout_s: float, poll_s: float = 0.05) -> bool:
        """Poll until ``done()`` is true (True) or ``timeout_s`` passed (False)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self.poll()
            if done():
                return True
            time.sleep(poll_s)
        return False
