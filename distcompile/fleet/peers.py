"""Which ranks share a compile cache folder (Note [Sharing compiles between ranks]) and
which folder each rank of the job has (Note [Compiles shared across cache folders])."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence

import torch.distributed as dist

from .. import _torch_compat as compat
from .._store import CountedStore, StoreTimeout, barrier, counted, gather_small

__all__ = [
    "PEER_WAIT_S",
    "Heartbeat",
    "cache_peers",
    "folder_of",
    "touch",
    "wait_for_peer",
    "warm_marker",
    "warm_ranks",
]

log = logging.getLogger(__name__)


def folder_of(
    store: dist.Store, prefix: str, *, rank: int, peers: Sequence[int], ranks: Sequence[int], timeout_s: float
) -> dict[int, int]:
    """Every rank's cache folder, named by the first rank that sees it (collective over ``ranks``;
    4 store operations a rank: Note [The control plane]).

    A rank that does not hear from the others in time takes every rank for a folder of its
    own: it then publishes and loads compiles through the store, slower but never wrong.

    Example:
        >>> # folder_of(default_store(), "distcompile/wrap0/folders", rank=0, peers=(0, 1), ranks=(0, 1, 2, 3), timeout_s=60)
    """
    if len(ranks) < 2:
        return {rank: rank}
    try:
        s = counted(store, "peers")
        found = gather_small(s, prefix, str(min(peers)), rank=rank, ranks=ranks, timeout_s=timeout_s)
        return {r: int(found[r]) for r in ranks}
    except (StoreTimeout, KeyError) as exc:
        log.warning("rank %d: could not learn the other ranks' cache folders (%s)", rank, exc)
        return {r: r for r in ranks}


def cache_peers(
    store: dist.Store, prefix: str, *, rank: int, ranks: Sequence[int], timeout_s: float
) -> tuple[int, ...]:
    """The ranks of ``ranks`` that see this rank's files in Inductor's cache folder (itself included).

    Collective over ``ranks`` (each must call it with the same ``prefix``). A rank that
    cannot write the folder, or does not hear from the others in time, shares with nobody.

    Example:
        >>> # cache_peers(default_store(), "distcompile/wrap0/peers", rank=0, ranks=[0, 1], timeout_s=60)
    """
    if len(ranks) < 2:
        return (rank,)
    folder = os.path.join(compat.inductor_cache_dir(), "distcompile-peers")
    mine = ""
    s = counted(store, "peers")
    try:
        # One token for the job: the first rank's offer stays (compare_set), everyone reads it.
        token = s.compare_set(f"{prefix}/token", "", uuid.uuid4().hex).decode()
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{token}-{rank}"), "w"):
                mine = os.path.join(folder, f"{token}-{rank}")
        except OSError as exc:
            log.debug("cannot write in %s (%s): this rank compiles every piece itself", folder, exc)
        barrier(s, f"{prefix}/wrote", ranks=ranks, timeout_s=timeout_s)
        # A listing of the folder, not a check per rank: its files are the ranks that share it.
        names = os.listdir(folder) if mine else []
        seen = tuple(r for r in ranks if f"{token}-{r}" in names)
        barrier(s, f"{prefix}/read", ranks=ranks, timeout_s=timeout_s)
    except StoreTimeout as exc:
        log.warning(
            "rank %d: could not find the ranks sharing its compile cache (%s); compiling alone", rank, exc
        )
        seen = ()
    finally:
        if mine:
            os.remove(mine)
    return seen or (rank,)


def warm_marker(digest: str) -> str:
    """The file in Inductor's cache folder that says it holds the compiled pieces named ``digest``.

    Example:
        >>> warm_marker("0123abcd").endswith("distcompile-peers/warm-0123abcd")
        True
    """
    return os.path.join(compat.inductor_cache_dir(), "distcompile-peers", f"warm-{digest}")


def touch(path: str) -> None:
    """Create ``path`` (and its folder) if it can; a read-only folder is only slower next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        log.debug("cannot write %s: %s", path, exc)


def warm_ranks(
    store: dist.Store, prefix: str, *, rank: int, ranks: Sequence[int], marker: str, timeout_s: float
) -> tuple[int, ...]:
    """The ranks of ``ranks`` whose folder holds the pieces (``marker`` exists there)
    (collective over ``ranks``; all of them, each compiling alone, when the others cannot be heard).

    After a restart on a fresh node, the warm ranks load the pieces from their caches and
    publish them; the cold ones compile nothing (Note [Compiles shared across cache folders]).

    Example:
        >>> # warm_ranks(default_store(), "distcompile/wrap0/compiles/call1/warm", rank=0, ranks=(0, 1), marker=m, timeout_s=60)
    """
    try:
        s = counted(store, "peers")
        flags = gather_small(
            s, prefix, "1" if os.path.exists(marker) else "0", rank=rank, ranks=ranks, timeout_s=timeout_s
        )
        warm = tuple(r for r in ranks if flags[r] == "1")
    except (StoreTimeout, KeyError) as exc:
        log.warning(
            "rank %d: could not learn which ranks have warm caches (%s); compiling every piece here",
            rank,
            exc,
        )
        return tuple(ranks)
    if warm and len(warm) < len(ranks) and rank not in warm:
        log.info("rank %d: its compile cache is cold; loading the pieces ranks %s hold", rank, list(warm))
    return warm


class Heartbeat:
    """While open, a thread adds 1 to ``key`` in the store every ``timeout_s / 4`` (at most
    every second): peers waiting for this rank's compiles see it is alive.

    Example:
        >>> import torch.distributed as dist
        >>> store = dist.HashStore()
        >>> with Heartbeat(store, "beat/0", 60.0):
        ...     pass
        >>> int(store.add("beat/0", 0)) >= 1
        True
    """

    def __init__(self, store: dist.Store, key: str, timeout_s: float) -> None:
        self._store, self._key = counted(store, "sharing"), key
        self._every = min(1.0, timeout_s / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distcompile-heartbeat", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return
            if self._stop.wait(self._every):
                return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


#: Seconds a rank waits at least for a peer's share of the compiles.
PEER_WAIT_S = 600.0
#: How often a rank looks whether a peer's share of the compiles is there: every POLL_S at
#: first, then twice as long each time up to POLL_MAX_S (store operations grow with the
#: wait, not with the number of ranks: Note [The control plane]).
POLL_S, POLL_MAX_S = 0.01, 0.5


def wait_for_peer(
    store: CountedStore, key: str, *, prefix: str, graph: str, rank: int, peer: int, timeout_s: float
) -> bool:
    """Wait for ``peer`` to set ``key`` (its share of compile ``graph``): True once set, False
    when it left the compile or gave no sign of life (then this rank compiles that share).

    Example:
        >>> # if wait_for_peer(store, done_key, prefix=p, graph="call1", rank=0, peer=1, timeout_s=60): ...
    """
    # As long as Inductor waits for another process's compile of a kernel (its file
    # locks' 10 minutes), or desync_timeout_s if longer: compiling the piece here
    # instead would take about as long. Never forever: a dead peer's piece is then
    # compiled here (and torchrun stops a job whose process died); one that left this
    # compile (abandon) is not waited for.
    # A peer that stops beating (Heartbeat: killed, or its process hung) is waited for
    # desync_timeout_s at most.
    left = f"{prefix}/{graph}/abandoned/{peer}"
    waited, limit, said = 0.0, max(timeout_s, PEER_WAIT_S), 0.0
    beat = f"{prefix}/beat/{peer}"
    beats, alive_at, why = store.add(beat, 0), 0.0, "as long as a compile lock is waited for"
    start, next_look, poll = time.monotonic(), 0.0, POLL_S
    while waited < limit:
        # Polled with check, not waited for in slices: a store wait that times out makes
        # c10d print a warning line each time (issue 45: a dozen lines in the demo).
        if store.check([key]):
            return True
        time.sleep(poll)
        poll = min(2 * poll, POLL_MAX_S)
        waited = time.monotonic() - start
        if waited < next_look:
            continue
        next_look = waited + min(1.0, timeout_s)  # then a look for the peer's abandon
        if store.check([left]):
            return False
        if waited - said >= timeout_s:
            said = waited
            log.info(
                "rank %d: waiting %.0f s so far for rank %d's share of the compiles",
                rank,
                waited,
                peer,
            )
        now = store.add(beat, 0)
        beats, alive_at = now, (waited if now != beats else alive_at)
        if waited - alive_at >= timeout_s:
            why = f"no sign of life from it for {waited - alive_at:.0f} s: killed or hung"
            break
    log.warning(
        "rank %d: rank %d did not finish its share of the compiles within %.0f s (%s); compiling that piece here",
        rank,
        peer,
        waited,
        why,
    )
    return False
