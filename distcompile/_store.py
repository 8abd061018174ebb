"""The job's key-value store as distcompile uses it: counted, with a deadline, O(1) per rank.

Note [The control plane]
------------------------
Background: besides its all-reduces, distcompile talks between ranks through the process
group's store (rank 0's TCPStore under torchrun): that every rank captured the same graph
and made the same plan, the bucket layout, which ranks share a cache folder and which are
warm, compiled pieces, failure marks. The first versions did each such exchange by
"publish under key/rank, wait for all, read all": every rank read every other rank's
text, N² reads of the summary through one server (8.5 s a check at 512 simulated ranks).

Protocols here, and what each costs a rank (N ranks, text of S bytes):

- :func:`agree` (graphs, plans, bucket layouts): each rank hashes its text and offers the
  digest with one ``compare_set``: the first rank's digest stays, and every rank learns at
  once whether it matches the first. A rank that differs publishes its text and its rank;
  the first rank publishes its text too (one ``set``), so that any rank can explain a
  mismatch by one ``get``. Each rank then adds itself to an arrival counter; the last to
  arrive writes the verdict (how many ranks differ) under "done"; everyone else reads
  that one key with a ``get`` that waits for it up to the deadline. Cost per rank: 4
  operations (a presence mark, ``compare_set``, ``add``, ``get``; the last rank 5), plus 1
  ``set`` for the first rank and for each differing one, plus 2 ``get``\\ s to explain a
  mismatch. Bytes through the server: N digests of 16 bytes, S once (2S or more only when
  ranks differ). A rank that never arrives is named, within the timeout, from per-rank
  arrival keys read only then (N ``check``\\ s on that error path alone).
- :func:`gather_small` (a cache folder's id, a warm flag: a few bytes per rank): each rank
  appends ``rank=value;`` to one key and counts itself in; the last copies the whole list
  to "done", which the others read. 3 operations per rank (the last 4), N·(value + 6)
  bytes read by each: for a thousand ranks and 8-byte values, 14 kB per rank.
- :func:`barrier`: ``add`` and a waiting ``get`` of one "done" key: 2 operations per rank.

Every operation goes through :class:`CountedStore`, which counts operations and bytes per
phase (``agreement``, ``layout``, ``peers``, ``sharing``, ``failure``, ``doctor``) for this process;
:func:`control_plane_counts` reads them, the compile log's summary line and
``distcompile report`` show them.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from . import _torch_compat as compat

__all__ = [
    "CountedStore",
    "StoreTimeout",
    "Verdict",
    "agree",
    "answered_within",
    "barrier",
    "control_plane_counts",
    "counted",
    "describe_counts",
    "digest",
    "gather",
    "gather_small",
    "last_to_arrive",
]


class StoreTimeout(TimeoutError):
    """A store wait ran past its deadline (whatever type the installed torch raises).

    Attributes:
        missing: The ranks that did not arrive, when the protocol can name them.
    """

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)


_lock = threading.Lock()
_counts: dict[str, list[int]] = {}  # phase -> [operations, bytes]


def _count(phase: str, nbytes: int) -> None:
    with _lock:
        entry = _counts.setdefault(phase, [0, 0])
        entry[0] += 1
        entry[1] += nbytes


def _size(value: object) -> int:
    return len(value) if isinstance(value, (bytes, str)) else 0


class CountedStore:
    """A store whose operations are counted under ``phase`` (Note [The control plane]).

    Example:
        >>> s = counted(dist.HashStore(), "doc-counted")
        >>> s.set("k", "abc"); s.get("k")
        b'abc'
        >>> control_plane_counts()["doc-counted"]  # operations, bytes of keys and values
        (2, 8)
    """

    def __init__(self, store: dist.Store, phase: str) -> None:
        self.store, self.phase = store, phase

    def set(self, key: str, value: str | bytes) -> None:
        _count(self.phase, len(key) + _size(value))
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.store.get(key)
        _count(self.phase, len(key) + _size(value))
        return value

    def add(self, key: str, amount: int) -> int:
        _count(self.phase, len(key) + 8)
        return int(self.store.add(key, amount))

    def append(self, key: str, value: str | bytes) -> None:
        _count(self.phase, len(key) + _size(value))
        self.store.append(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        value = self.store.compare_set(key, expected, desired)
        _count(self.phase, len(key) + _size(expected) + _size(desired) + _size(value))
        return value

    def check(self, keys: list[str]) -> bool:
        _count(self.phase, sum(len(k) for k in keys))
        return bool(self.store.check(keys))

    def delete_key(self, key: str) -> bool:
        _count(self.phase, len(key))
        return bool(self.store.delete_key(key))

    def get_within(self, key: str, timeout_s: float) -> bytes:
        """The value of ``key`` once it is set; :class:`StoreTimeout` after ``timeout_s`` seconds."""
        value = compat.store_get_within(self.store, key, timedelta(seconds=timeout_s))
        _count(self.phase, len(key) + _size(value))
        if value is None:
            raise StoreTimeout(f"key {key!r} not set within {timeout_s:.0f} s")
        return value

    def wait(self, keys: list[str], timeout_s: float) -> None:
        """Wait for ``keys``; :class:`StoreTimeout` after ``timeout_s`` seconds."""
        _count(self.phase, sum(len(k) for k in keys))
        if not compat.store_wait(self.store, keys, timedelta(seconds=timeout_s)):
            raise StoreTimeout(
                f"keys {keys[:3]}{' ...' if len(keys) > 3 else ''} not set within {timeout_s:.0f} s"
            )


def counted(store: dist.Store | CountedStore, phase: str) -> CountedStore:
    """``store`` with its operations counted under ``phase``.

    Example:
        >>> counted(dist.HashStore(), "agreement").phase
        'agreement'
    """
    return CountedStore(store.store if isinstance(store, CountedStore) else store, phase)


def control_plane_counts() -> dict[str, tuple[int, int]]:
    """Store operations and bytes this process made so far, per phase.

    Example:
        >>> isinstance(control_plane_counts(), dict)
        True
    """
    with _lock:
        return {phase: (ops, nbytes) for phase, (ops, nbytes) in _counts.items()}


def describe_counts() -> str:
    """The counts in one line, for the compile log (``14 store ops, 3.1 kB: agreement 8, ...``).

    Example:
        >>> describe_counts().startswith(("no store", "control plane"))
        True
    """
    counts = control_plane_counts()
    if not counts:
        return "no store operations"
    ops = sum(o for o, _ in counts.values())
    nbytes = sum(b for _, b in counts.values())
    parts = ", ".join(f"{phase} {o}" for phase, (o, _) in sorted(counts.items()))
    return f"control plane: {ops} store ops, {nbytes / 1e3:.1f} kB on this rank ({parts})"


def digest(text: str) -> str:
    """A short SHA-256 digest of ``text`` (32 hex characters).

    Example:
        >>> len(digest("graph"))
        32
    """
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def last_to_arrive(store: CountedStore, key: str, expected: int) -> bool:
    """Count this caller in under ``key``: whether it is the last of ``expected`` (one ``add``;
    the last one cleans up what the others no longer read). Nothing waits.

    Example:
        >>> store = counted(dist.HashStore(), "doc")
        >>> last_to_arrive(store, "k", 2), last_to_arrive(store, "k", 2)
        (False, True)
    """
    return store.add(f"{key}/n", 1) == expected


def _arrive(
    store: CountedStore, key: str, *, ranks: Sequence[int], timeout_s: float, outcome: Callable[[], str]
) -> str:
    """Count this rank in under ``key``; the last to arrive writes ``outcome()`` to ``key/done``,
    which every rank returns (2 operations a rank, 3 for the last: ``add``, a blocking ``get``)."""
    if last_to_arrive(store, key, len(ranks)):
        done = outcome()
        store.set(f"{key}/done", done)
        return done
    return store.get_within(f"{key}/done", timeout_s).decode()


def barrier(store: CountedStore, key: str, *, ranks: Sequence[int], timeout_s: float) -> None:
    """Return once every rank of ``ranks`` has called it with ``key``; :class:`StoreTimeout` else.

    Example:
        >>> barrier(counted(dist.HashStore(), "doc"), "b", ranks=[0], timeout_s=1)
    """
    _arrive(store, key, ranks=ranks, timeout_s=timeout_s, outcome=str)


def gather_small(
    store: CountedStore, key: str, value: str, *, rank: int, ranks: Sequence[int], timeout_s: float
) -> dict[int, str]:
    """Every rank's ``value`` (a few bytes, no ``;`` or ``=``), in 4 store operations a rank.

    Example:
        >>> gather_small(counted(dist.HashStore(), "doc"), "g", "7", rank=0, ranks=[0], timeout_s=1)
        {0: '7'}
    """
    store.append(f"{key}/all", f"{rank}={value};")
    everything = _arrive(
        store, key, ranks=ranks, timeout_s=timeout_s, outcome=lambda: store.get(f"{key}/all").decode()
    )
    out = {}
    for item in everything.split(";"):
        if item:
            r, _, v = item.partition("=")
            out[int(r)] = v
    return out


def gather(
    store: CountedStore, key: str, value: str, *, rank: int, ranks: Sequence[int], timeout_s: float
) -> dict[int, str | None]:
    """Every rank's ``value`` (any text), ``None`` for a rank that did not publish within
    ``timeout_s`` (it died or hangs): a report, not a step (O(N) reads a rank; ``gather_small``
    for a few bytes a rank at 4 operations).

    Example:
        >>> gather(counted(dist.HashStore(), "doc"), "r", "{}", rank=0, ranks=[0], timeout_s=1)
        {0: '{}'}
    """
    store.set(f"{key}/{rank}", value)
    try:
        barrier(store, f"{key}/all", ranks=ranks, timeout_s=timeout_s)
    except StoreTimeout:
        pass  # the missing ranks are None below
    return {r: store.get(f"{key}/{r}").decode() if store.check([f"{key}/{r}"]) else None for r in ranks}


@dataclass
class Verdict:
    """What :func:`agree` found.

    Attributes:
        same: Every rank published the same text.
        first: The rank whose digest was published first (the reference).
        differing: Ranks whose text differs from ``first``'s.
        texts: Texts read to explain a difference: ``first``'s and one differing rank's.
    """

    same: bool
    first: int
    differing: list[int] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)


def agree(
    store: CountedStore,
    key: str,
    text: str,
    *,
    rank: int,
    ranks: Sequence[int],
    timeout_s: float,
    explain: bool = True,
) -> Verdict:
    """Whether every rank of ``ranks`` published the same ``text`` under ``key`` (Note [The control plane]).

    Raises :class:`StoreTimeout` naming the ranks that did not arrive within ``timeout_s``.
    With ``explain``, a verdict of "differ" carries the first rank's text and one differing
    rank's (the one other than this rank, when this rank is the first).

    Example:
        >>> store = counted(dist.HashStore(), "doc")
        >>> agree(store, "g0", "graph text", rank=0, ranks=[0], timeout_s=1).same
        True
    """
    mine = digest(text)
    store.set(f"{key}/here/{rank}", "")  # read only to name ranks that never arrive
    first = store.compare_set(f"{key}/first", "", f"{mine} {rank}").decode()
    first_digest, _, first_rank = first.partition(" ")  # compare_set returns what the key holds
    if int(first_rank) == rank:
        store.set(f"{key}/text/{rank}", text)
    elif first_digest != mine:
        store.set(f"{key}/text/{rank}", text)
        store.append(f"{key}/differ", f"{rank};")
        store.add(f"{key}/ndiffer", 1)
    try:  # the last to arrive writes how many ranks differ
        differ = _arrive(
            store, key, ranks=ranks, timeout_s=timeout_s, outcome=lambda: str(store.add(f"{key}/ndiffer", 0))
        )
    except StoreTimeout:
        missing = [r for r in ranks if not store.check([f"{key}/here/{r}"])]
        raise StoreTimeout(f"rank(s) {missing} did not arrive within {timeout_s:.0f} s", missing) from None
    verdict = Verdict(same=differ == "0", first=int(first_rank))
    if verdict.same or not explain:
        return verdict
    verdict.differing = [int(r) for r in store.get(f"{key}/differ").decode().split(";") if r]
    other = next((r for r in verdict.differing if r != rank), None)
    for r in {verdict.first, rank if rank in verdict.differing else other} - {None}:
        verdict.texts[r] = text if r == rank else store.get(f"{key}/text/{r}").decode()  # type: ignore[index]
    return verdict


#: Seconds an error path waits for the store to answer a question (``answered_within``).
LOOKUP_S = 5.0


def answered_within(ask: Callable[[], object], default: object, seconds: float | None = None) -> object:
    """``ask()`` if it returns within ``seconds`` (``LOOKUP_S``), else ``default``: for what an
    error path asks the store. A store whose host is stopped (SIGSTOP, a debugger, a frozen
    node) keeps the connection open and never answers, and a client's ``check`` then blocks
    past its own timeout (seen on 2.13), so the question runs in a daemon thread that is left
    behind if it does not come back; the error is raised either way.

    Example:
        >>> answered_within(lambda: 7, default=0)
        7
    """
    box: list[object] = []
    asker = threading.Thread(target=lambda: box.append(ask()), name="distcompile-store-lookup", daemon=True)
    asker.start()
    asker.join(LOOKUP_S if seconds is None else seconds)
    return box[0] if box else default
