"""Compiled pieces between cache folders over a CPU group of the folders' leaders: a binomial tree.

Note [Compiles between folders by tree]
---------------------------------------
Background: with one leader per cache folder (Note [Compiles shared by folder]), each
folder's share went through the job's store: the store's server (rank 0's process) served
every publication once per other folder, (F - 1) x the graph's compiled bytes for F
folders, and held them until the last reader came. At 512 folders and tens of MB of
kernels per graph that is GBs through one process.

Algorithm: the leaders form a gloo process group of their own (made at the first
exchange, by the leaders only). The roots are every leader at a cold start (each folder
compiled a share) and one warm folder's leader at a restart (it holds every piece). Each
root's sealed payload (``transfer.seal``: hash and build fingerprint) is broadcast down a
binomial tree rooted at it: in round k, every leader that has the payload and sits at
position p < 2^k (counted from the root) sends it to position p + 2^k. A tree carries one
payload in ceil(log2 F) rounds; a leader sends it at most ceil(log2 F) times (the root
most), so for one graph no process sends more than ceil(log2 F) x the bytes published,
whatever F, and the store carries none of them. Before the tree, each publisher marks in
the store that its folder's share is ready, and every leader waits for the roots' marks as
for any peer's compile (heartbeats, ``desync_timeout_s`` for a silent one); so a leader
enters the tree only when every root can send at once, and the group's timeout
(``desync_timeout_s``) bounds what a peer lost inside it costs. After a failure inside the
group the exchange goes through the store for the rest of the job (a group left
mid-message cannot be trusted with the next one).

Cost per graph: sizes and bytes in ceil(log2 F) rounds per root; store operations: one
mark per publisher and one wait per root and leader.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["binomial_rounds", "leaders_group", "tree_broadcast"]


def binomial_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The ``(sender, receiver)`` positions of each round of a broadcast from position 0 to ``n``.

    Example:
        >>> binomial_rounds(5)
        [[(0, 1)], [(0, 2), (1, 3)], [(0, 4)]]
    """
    rounds = []
    for k in range(math.ceil(math.log2(n)) if n > 1 else 0):
        step = 1 << k
        rounds.append([(p, p + step) for p in range(step) if p + step < n])
    return rounds


def leaders_group(leaders: list[int], timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of ``leaders``, made by them alone (every leader calls it, in the same order).

    Example:
        >>> # group = leaders_group([0, 2, 4, 6], timeout_s=60)   # on ranks 0, 2, 4 and 6 only
    """
    return dist.new_group(
        ranks=leaders, backend="gloo", timeout=timedelta(seconds=timeout_s), use_local_synchronization=True
    )


def tree_broadcast(
    data: bytes | None, *, root: int, ranks: list[int], group: dist.ProcessGroup
) -> tuple[bytes, int]:
    """``root``'s ``data`` on every rank of ``ranks`` (global ranks of ``group``, in its order),
    by a binomial tree; returns it and the bytes this rank sent. A collective over ``group``.

    Example:
        >>> # payload, sent = tree_broadcast(blob if rank == 2 else None, root=2, ranks=[0, 2, 4], group=g)
    """
    me = dist.get_rank()
    order = ranks[ranks.index(root) :] + ranks[: ranks.index(root)]  # position 0 is the root
    pos = order.index(me)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if me == root and data
        else torch.empty(0, dtype=torch.uint8)
    )
    size = torch.tensor([buf.numel()], dtype=torch.int64)
    sent = 0
    for pairs in binomial_rounds(len(order)):
        for src, dst in pairs:
            if pos == src:
                dist.send(size, order[dst], group=group)
                if size.item():
                    dist.send(buf, order[dst], group=group)
                sent += int(size.item())
            elif pos == dst:
                dist.recv(size, order[src], group=group)
                buf = torch.empty(int(size.item()), dtype=torch.uint8)
                if size.item():
                    dist.recv(buf, order[src], group=group)
    return buf.numpy().tobytes(), sent
