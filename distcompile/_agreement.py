"""Check that every rank captured the same graph and made the same plan.

A rank that captured a different graph would issue different collectives and hang the
job. Each rank offers a digest of what it compiled through the process group's key-value
store, with a deadline; texts travel only to explain a difference (Note [The control
plane] in ``_store.py``: a bounded number of store operations a rank, whatever the
number of ranks).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable

import torch.distributed as dist

from . import _torch_compat as compat
from ._store import StoreTimeout, Verdict, agree, answered_within, counted, digest, last_to_arrive
from .errors import DesyncError

__all__ = [
    "check_agreement",
    "compile_together",
    "default_store",
    "failed_ranks",
    "first_rank_says",
    "host_addresses",
    "layouts_agree",
    "mark_address",
    "mark_failed",
    "ranks_at",
]

log = logging.getLogger(__name__)


def default_store() -> dist.Store:
    """The default process group's store (shared by every rank of the job)."""
    return compat.default_store()


def check_agreement(
    store: dist.Store,
    key: str,
    summary: str,
    *,
    rank: int,
    ranks: list[int],
    timeout_s: float,
    what: str,
    fix: str = "Ranks must capture identical graphs (same model code, same input shapes and dtypes, "
    "same parameters).",
) -> None:
    """Raise :class:`DesyncError` unless all ``ranks`` publish the same ``summary`` under ``key``.

    Digests are compared, texts read only to explain a difference (Note [The control plane]
    in ``_store.py``: 4 store operations a rank, the text sent once).

    Args:
        store: A store every rank reaches.
        key: Unique name of the thing being compared (same on every rank).
        summary: Text that must be identical on all ranks; shown in the error if not.
        rank: This process's global rank.
        ranks: Global ranks that must publish.
        timeout_s: How long to wait for the other ranks.
        what: A short description for the error message (e.g. ``"graph 2"``).
        fix: What the user should change, for the mismatch message.

    Example:
        >>> # check_agreement(default_store(), "wrap0/graph0", text, rank=r, ranks=[0, 1],
        >>> #                 timeout_s=60, what="graph 0")
    """
    try:
        verdict = agree(
            counted(store, "agreement"), key, summary, rank=rank, ranks=ranks, timeout_s=timeout_s
        )
    except StoreTimeout as exc:
        raise _did_not_compile(rank, exc.missing, what, timeout_s) from exc
    if not verdict.same:
        _raise_differs(verdict, summary, rank=rank, what=what, fix=fix)
    log.debug("%s agrees across %d ranks", what, len(ranks))


def _did_not_compile(rank: int, missing: object, what: str, timeout_s: float) -> DesyncError:
    return DesyncError(
        f"rank {rank}: rank(s) {missing} did not compile {what} within {timeout_s:.0f} s "
        "(desync_timeout_s). Those ranks either took a "
        "different code path before it (Python control flow that differs between ranks, so "
        "TorchDynamo captured another graph or none), are still compiling, or died. Make every "
        "rank run the same model code, or raise desync_timeout_s if compiles are slow."
    )


def first_rank_says(
    store: dist.Store,
    key: str,
    make: Callable[[], str],
    *,
    rank: int,
    ranks: list[int],
    timeout_s: float,
    what: str,
) -> str:
    """``make()`` on the first of ``ranks``, the same text on every rank: one store
    operation a rank. The others wait up to ``timeout_s`` (:class:`DesyncError` naming the
    first rank after it). For figures each rank would measure a little differently, which
    must be equal everywhere (every rank plans the same segments from them).

    Example:
        >>> # work = first_rank_says(default_store(), key + "/costs", measure, rank=r,
        >>> #                        ranks=[0, 1], timeout_s=60, what="graph 0")
    """
    s = counted(store, "agreement")
    if rank == ranks[0]:
        text = make()
        s.set(key, text)
        return text
    try:
        return s.get_within(key, timeout_s).decode()
    except StoreTimeout as exc:
        raise _did_not_compile(rank, [ranks[0]], what, timeout_s) from exc


def compile_together(
    store: dist.Store,
    key: str,
    summary: str,
    *,
    rank: int,
    ranks: list[int],
    wait_s: float,
    what: str,
    fix: str,
    mismatch_ok: bool = False,
) -> bool:
    """Whether every rank compiles this graph now, together; if so, their ``summary`` agree.

    A recompile after the first step may be one rank's alone (its inputs changed, the
    others' did not). Each rank offers its digest and counts itself in (Note [The control
    plane]); the rank that completes the count records "together", the first whose wait of
    ``wait_s`` ends records "alone" (one atomic ``compare_set``: every rank reads the same
    decision, polling that one key). Together, the digests are compared
    (:class:`DesyncError` if they differ, or with ``mismatch_ok`` no sharing) and the ranks
    may share the compile; alone, each compiles by itself.

    Example:
        >>> # compile_together(default_store(), "wrap0/compile/3/0", text, rank=r, ranks=[0, 1],
        >>> #                  wait_s=5, what="graph 4", fix="...")
    """
    s = counted(store, "agreement")
    mine = digest(summary)
    first = s.compare_set(f"{key}/first", "", f"{mine} {rank}").decode()
    same_as_first = first.partition(" ")[0] == mine
    if not same_as_first:
        s.add(f"{key}/ndiffer", 1)
    if last_to_arrive(s, key, len(ranks)):
        s.compare_set(f"{key}/decision", "", "together")
    deadline, poll = time.monotonic() + wait_s, 0.005
    while True:  # one key, polled (backing off to 0.1 s): the decision
        if s.check([f"{key}/decision"]):
            decision = s.get(f"{key}/decision")
            break
        if time.monotonic() > deadline:
            decision = s.compare_set(f"{key}/decision", "", "alone")
            break
        time.sleep(poll)
        poll = min(2 * poll, 0.1)
    if decision != b"together":
        log.debug(
            "%s: compiled by this rank alone (the others did not compile it within %.0f s)", what, wait_s
        )
        return False
    same = s.add(f"{key}/ndiffer", 0) == 0
    if same or mismatch_ok:  # graphs that may differ by data: another graph here is no error, just no sharing
        return same
    verdict = agree(s, f"{key}/explain", summary, rank=rank, ranks=ranks, timeout_s=max(wait_s, 60))
    if not verdict.same:
        _raise_differs(verdict, summary, rank=rank, what=what, fix=fix)
    return True


def _raise_differs(verdict: Verdict, summary: str, *, rank: int, what: str, fix: str) -> None:
    other = next((r for r in verdict.texts if r != rank), None)
    theirs = verdict.texts.get(other, "") if other is not None else ""
    diff = "\n".join(
        list(
            difflib.unified_diff(
                summary.splitlines(), theirs.splitlines(), f"rank {rank}", f"rank {other}", lineterm="", n=1
            )
        )[:40]
    )
    others = [r for r in verdict.differing if r != rank] or [verdict.first]
    more = (
        f" (ranks differing from rank {verdict.first}: {verdict.differing[:8]})"
        if len(verdict.differing) > 1
        else ""
    )
    raise DesyncError(
        f"rank {rank}: {what} differs between rank {rank} and rank {others[0]}{more}; continuing would "
        f"issue mismatched all-reduces or train apart. {fix} First differences:\n{diff}"
    )


def layouts_agree(
    store: dist.Store, key: str, groups: list[list[str]], *, rank: int, ranks: list[int], timeout_s: float
) -> list[list[str]] | None:
    """``groups`` (a bucket layout) if every rank published the same under ``key``, else ``None``.

    Once per wrapped model (its layout is frozen then); a rank that does not publish within
    ``timeout_s`` is a :class:`DesyncError`. Digests compared (Note [The control plane]).

    Example:
        >>> # layouts_agree(default_store(), "wrap0/layout", [["b.weight"], ["a.weight"]], rank=0, ranks=[0, 1], timeout_s=60)
    """
    try:
        verdict = agree(
            counted(store, "layout"),
            key,
            json.dumps(groups),
            rank=rank,
            ranks=ranks,
            timeout_s=timeout_s,
            explain=False,
        )
    except StoreTimeout as exc:
        raise DesyncError(
            f"rank {rank}: rank(s) {exc.missing} did not fix their gradient buckets within {timeout_s:.0f} s "
            "(desync_timeout_s): they did not reach the "
            "same step, or took no data-dependent graph break where this rank took one. Every rank must "
            "run the same model code."
        ) from exc
    return groups if verdict.same else None


def mark_failed(store: dist.Store, prefix: str, rank: int, what: str) -> None:
    """Record that ``rank`` raised, so peers waiting on it can name it. Never raises, and
    gives up after ``_store.LOOKUP_S`` on a store that does not answer.

    One key for the whole job (``prefix/failed``, appended to): a peer reads it with one
    ``get`` whatever the number of ranks.
    """

    def record() -> bool:
        try:
            s = counted(store, "failure")
            s.set(f"{prefix}/failed/{rank}", what[:2000])
            s.append(f"{prefix}/failed", f"{rank};")
            return True
        except Exception:  # noqa: BLE001 - the store may be gone too; the original error matters more
            return False

    if not answered_within(record, False):
        log.debug("could not record the failure of rank %d in the store", rank)


def failed_ranks(store: dist.Store, prefix: str, ranks: list[int]) -> dict[int, str]:
    """Ranks of ``ranks`` that recorded a failure under ``prefix``, with what they recorded
    (one ``check`` and one ``get`` when none failed, whatever the number of ranks; nothing
    if the store does not answer within ``_store.LOOKUP_S``)."""

    def ask() -> dict[int, str]:
        out: dict[int, str] = {}
        try:
            s = counted(store, "failure")
            if not s.check([f"{prefix}/failed"]):
                return out
            wanted = set(ranks)
            for r in dict.fromkeys(int(x) for x in s.get(f"{prefix}/failed").decode().split(";") if x):
                if r in wanted and len(out) < 16:
                    out[r] = s.get(f"{prefix}/failed/{r}").decode()
        except Exception:  # noqa: BLE001 - a store that is down cannot tell us more
            pass
        return out

    return answered_within(ask, {})  # type: ignore[return-value]


# Note [Naming the peer behind an address]: gloo's error for a dead or silent peer gives the
# peer's address ("[10.0.0.2]:53634"), not its rank. Each rank appends itself under each
# IPv4 address gloo advertises for it (``host_addresses``: usually one), at wrap (one
# ``append`` per address), and a rank
# whose all-reduce failed reads the one key of that address (one ``get``, on the error path
# alone). Loopback addresses are keyed by host name too: every node has 127.0.0.1.


def _address_key(prefix: str, ip: str) -> str:
    local = ip.startswith("127.") or ip == "::1"
    return f"{prefix}/at/{socket.gethostname()}/{ip}" if local else f"{prefix}/at/{ip}"


def host_addresses() -> list[str]:
    """The IPv4 addresses gloo advertises for this host: those of the ``GLOO_SOCKET_IFNAME``
    interfaces if set, else its host name's (gloo's default; loopback if the name does not
    resolve, as gloo falls back to it).

    Example:
        >>> all(a.count(".") == 3 for a in host_addresses())
        True
    """
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    out: list[str] = []
    try:
        if names:
            import fcntl  # POSIX only, as is GLOO_SOCKET_IFNAME's use

            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for name in names:  # SIOCGIFADDR: the interface's IPv4 address
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                    out.append(socket.inet_ntoa(packed[20:24]))
        else:
            out = [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except (ImportError, OSError):  # no such interface, no IPv4 address on it, a name that does not resolve
        pass
    return list(dict.fromkeys(out)) or ["127.0.0.1"]


def mark_address(store: dist.Store, prefix: str, rank: int) -> None:
    """Record ``rank`` under each address of this host (Note [Naming the peer behind an
    address]): one ``append`` per address. Never raises."""
    try:
        s = counted(store, "failure")
        for ip in host_addresses():
            s.append(_address_key(prefix, ip), f"{rank};")
    except Exception:  # noqa: BLE001 - naming peers in errors is a courtesy, not a requirement
        log.debug("could not record the addresses of rank %d in the store", rank)


def ranks_at(store: dist.Store, prefix: str, address: str, besides: int = -1) -> list[int]:
    """The ranks but ``besides`` that recorded ``address`` (an IP, or gloo's ``[IP]:port``) with
    :func:`mark_address`: one ``check`` and one ``get``; empty if none, or the store is gone
    or does not answer within ``_store.LOOKUP_S``."""
    ip = address.rpartition("]")[0].lstrip("[") if address.startswith("[") else address
    key = _address_key(prefix, ip)

    def ask() -> list[int]:
        try:
            s = counted(store, "failure")
            if not s.check([key]):
                return []
            return sorted({int(r) for r in s.get(key).decode().split(";") if r} - {besides})
        except Exception:  # noqa: BLE001 - a store that is down cannot tell us more
            return []

    return answered_within(ask, [])  # type: ignore[return-value]
