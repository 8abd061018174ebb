"""The seeded fault schedule of a chaos run: which fault, on which node, after how many steps.

Pure: the same seed gives the same schedule, so a run that found a bug can be repeated.
Faults come one at a time: each waits ``gap`` completed steps after the training recovered
from the previous one. A gap is longer than the checkpoint interval, so a checkpoint is
written between two faults and the job always gets further, however the faults fall.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["KINDS", "RESTARTING", "Fault", "make_schedule", "steps_needed"]

#: Every kind of fault, in the order a schedule first covers them.
KINDS = (
    "kill_worker",  # SIGKILL one worker
    "kill_node_compiling",  # a restart, then SIGKILL every worker of a node between wrap and its first step
    "stall",  # SIGSTOP a worker for longer than a step, shorter than desync_timeout_s; SIGCONT
    "bad_link",  # one node's link slowed (queueing delay) and dropping 1% of packets, for a while
    "empty_cache",  # empty a node's compile cache folder, then SIGKILL one of its workers
    "kill_in_checkpoint",  # SIGKILL the writing rank while a checkpoint is being written
)
#: The kinds after which the job restarts (every other kind must not restart it).
RESTARTING = frozenset(KINDS) - {"stall", "bad_link"}


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault.

    Attributes:
        index: Its place in the schedule (0-based).
        kind: One of ``KINDS``.
        node: The node it hits.
        worker: The node's local rank it hits (kills, stalls).
        gap: Completed steps to wait after the previous fault's recovery.
        seconds: How long a stall or a link fault lasts (0 for the others).
    """

    index: int
    kind: str
    node: int
    worker: int
    gap: int
    seconds: float


def make_schedule(
    seed: int,
    faults: int,
    *,
    nodes: int,
    ranks_per_node: int,
    ckpt_every: int,
    stall_s: tuple[float, float] = (5.0, 20.0),
    long_stall_s: float = 30.0,
) -> list[Fault]:
    """``faults`` faults: the first ``len(KINDS)`` cover every kind (in a seeded order), then
    kinds at random; one stall (the first) lasts ``long_stall_s``, the others ``stall_s``.

    Example:
        >>> s = make_schedule(0, 8, nodes=4, ranks_per_node=2, ckpt_every=4)
        >>> sorted({f.kind for f in s}) == sorted(KINDS), all(f.gap > 4 for f in s)
        (True, True)
    """
    if faults < 1 or nodes < 2 or ranks_per_node < 1 or ckpt_every < 1:
        raise ValueError(
            f"a chaos run needs faults >= 1, nodes >= 2, ranks_per_node >= 1 and ckpt_every >= 1; got "
            f"{faults}, {nodes}, {ranks_per_node} and {ckpt_every}"
        )
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    kinds += [rng.choice(KINDS) for _ in range(faults - len(kinds))]
    out, long_done = [], False
    for i, kind in enumerate(kinds[:faults]):
        seconds = 0.0
        if kind == "stall":
            seconds = long_stall_s if not long_done else round(rng.uniform(*stall_s), 1)
            long_done = True
        elif kind == "bad_link":
            seconds = round(rng.uniform(10.0, 20.0), 1)
        gap = rng.randint(ckpt_every + 1, 2 * ckpt_every + 2)
        out.append(Fault(i, kind, rng.randrange(nodes), rng.randrange(ranks_per_node), gap, seconds))
    return out


def steps_needed(schedule: list[Fault], *, tail: int) -> int:
    """Steps the training must run so that every fault of ``schedule`` comes before its end
    and ``tail`` steps follow the last recovery (a fault fires at most ``gap + 1`` steps after
    the step at which the previous fault fired; a bad link lasts ``gap`` steps at most).

    Example:
        >>> steps_needed([Fault(0, "stall", 0, 0, 6, 5.0), Fault(1, "bad_link", 1, 0, 7, 9.0)], tail=5)
        27
    """
    return sum(f.gap + 1 + (f.gap if f.kind == "bad_link" else 0) for f in schedule) + tail
