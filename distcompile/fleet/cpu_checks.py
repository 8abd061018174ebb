"""Inductor's one-time CPU checks shared across cache folders: each rank builds its share, the
folders' leaders install the others' (Note [Compiles shared across cache folders])."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from .. import _torch_compat as compat
from .._store import CountedStore, last_to_arrive
from ..compile.jobs import assign
from . import transfer

__all__ = ["share_cpu_checks"]

log = logging.getLogger(__name__)


def share_cpu_checks(
    store: CountedStore,
    prefix: str,
    *,
    rank: int,
    sharers: Sequence[int],
    folders: Mapping[int, int],
    wait: Callable[[str, int], bool],
) -> None:
    """Inductor's CPU checks when the sharers have several cache folders: each rank builds its
    share and publishes the libraries it built (a few small files, with their load marks);
    each folder's leader (its first rank) installs the shares built in other folders once,
    for its folder, and marks it installed; then every rank runs the rest, which load
    instead of building. Without it every folder built every check (15.7 s for the 4 checks
    of this project's machine, against half of it for two ranks of one folder). The store
    serves each share once per other folder, not once per rank: at most the checks'
    libraries x folders bytes (about 150 kB x folders here; CPU kernels only), and the last
    leader deletes them. ``wait(key, peer)`` waits for a peer's mark (heartbeats, timeouts:
    ``peers.wait_for_peer``); a share that does not arrive is built here.

    Example:
        >>> # share_cpu_checks(store, f"{prefix}/checks", rank=0, sharers=(0, 1), folders={0: 0, 1: 1}, wait=w)
    """
    checks = compat.cpu_isa_checks()  # [] where they ran already in this process
    owner = [sharers[o] for o in assign(list(range(len(checks), 0, -1)), len(sharers))] if checks else []
    try:
        for i in range(len(checks)):
            if owner[i] == rank:
                compat.run_cpu_isa_check(checks[i])
        if rank in owner:
            payload = transfer.pack(b"", transfer.read_libraries(compat.kernel_libraries()))
            transfer.publish(store, f"{prefix}/{rank}", payload, compat.build_fingerprint())
    finally:  # built, failed or nothing to do: the others stop waiting (and build what is missing)
        store.set(f"{prefix}/{rank}/ready", "1")
    leader, others = folders[rank], sorted({o for o in owner if folders[o] != folders[rank]})
    if leader != rank:
        if others:
            wait(f"{prefix}/installed/{leader}", leader)  # its libraries are in this folder then
    else:
        try:
            for peer in others:
                _install_share(store, prefix, rank, peer, wait)
        finally:
            store.set(f"{prefix}/installed/{rank}", "1")
        if owner and last_to_arrive(store, f"{prefix}/leaders_done", len({folders[r] for r in sharers})):
            for peer in sorted(set(owner)):  # the last leader: nobody reads them any more
                transfer.delete(store, f"{prefix}/{peer}")
    for i in range(len(checks)):
        if owner[i] != rank:
            compat.run_cpu_isa_check(checks[i])  # loads what arrived; builds what did not


def _install_share(
    store: CountedStore, prefix: str, rank: int, peer: int, wait: Callable[[str, int], bool]
) -> None:
    """Install ``peer``'s published CPU-check libraries here, or say why not (they are then built here)."""
    if not wait(f"{prefix}/{peer}/ready", peer):
        return
    try:  # anything wrong: the checks are built here, as without sharing
        payload, why = transfer.fetch(store, f"{prefix}/{peer}", compat.build_fingerprint())
        if payload is not None:
            transfer.install(payload)
        elif why is not None and why.reason != "missing":
            log.warning("rank %d: not installing rank %d's CPU-check libraries: %s", rank, peer, why)
    except Exception as exc:  # noqa: BLE001
        log.warning("rank %d: not installing rank %d's CPU-check libraries: %s", rank, peer, exc)
