"""Note [Sharing compiles between ranks]

Background
    Every rank of a data-parallel job compiles the same pieces. The ranks of one machine
    share Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default one folder
    per user under the system's temporary folder), yet each compiles everything itself:
    on a machine of 8 GPUs the same AOTAutograd trace and Inductor lowering runs 8
    times, side by side, and the first step waits for all of it.

Algorithm
    At the first compile, the ranks find out which of them see each other's files in the
    cache folder (``cache_peers``: each writes a file named by a token of this job, then
    looks for the others'). Those peers split the distinct pieces of a graph between
    them, largest first, each to the least loaded peer (``assign``), so every one has
    about the same work. A peer compiles its share, forward and backward at once (so that
    the cache entry is whole; ``compat.eager_backward``), and marks each piece done in
    the process group's store. Then it takes the others' pieces as they are marked done:
    AOTAutograd's cache hands it the compiled forward and backward.

Notes
    Only cacheable pieces are shared (``compile/segments.py``): those are compiled from
    fake inputs that do not depend on another piece's compiled output. A piece that
    AOTAutograd would not cache (``compat.aot_cacheable``) is compiled by every rank.
    Nothing waits forever: a peer's share is waited for as long as Inductor waits for
    another process's compile (``PEER_WAIT_S``, or ``desync_timeout_s`` if longer, with
    a log line every ``desync_timeout_s``) while the peer shows it is alive (a heartbeat
    thread counts up in the store while it compiles: ``peers.Heartbeat``), and for
    ``desync_timeout_s`` once it stops (killed, or its process hung); then this rank
    compiles the piece itself. A piece the cache does not hand over after all is compiled
    again here: slower, never wrong, since each rank still compiles or loads every piece
    it runs.

Debugging
    The compile log line names the ranks that split the compiles and counts cache hits
    (the pieces loaded); at DEBUG level (``logging.getLogger("distcompile")``) each rank
    says how many it compiled.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from .. import _torch_compat as compat
from .._store import CountedStore, counted, last_to_arrive
from ..compile.cpu_checks import run_cpu_checks, runs_on_cpu
from ..compile.jobs import CompileJob
from . import transfer, tree
from .cpu_checks import share_cpu_checks
from .peers import Heartbeat, cache_peers, folder_of, touch, wait_for_peer, warm_marker, warm_ranks
from .share_plan import SharePlan, plan_sharing

__all__ = [
    "SOURCES",
    "CompileSharing",
    "jobs_digest",
]

log = logging.getLogger(__name__)

#: Where a rank's pieces come from when the ranks share the compiles.
SOURCES = ("compiled here", "cache", "same-folder peer", "other-folder peer")


def jobs_digest(jobs: Sequence[CompileJob]) -> str:
    """A name for a graph's distinct pieces that a restarted job computes alike: their code
    and the shapes and dtypes of their inputs.

    Example:
        >>> from torch import fx
        >>> job = CompileJob(fx.symbolic_trace(torch.nn.ReLU()), [torch.zeros(2)], None)
        >>> jobs_digest([job]) == jobs_digest([job]), len(jobs_digest([job]))
        (True, 16)
    """
    h = hashlib.sha256()
    for job in jobs:
        h.update(job.module.code.encode())
        h.update(repr([(tuple(a.shape), a.dtype) for a in job.args if isinstance(a, torch.Tensor)]).encode())
    return h.hexdigest()[:16]


class CompileSharing:
    """Compiles each graph's distinct pieces, each on one of the peers, and loads the rest.

    The peers (``cache_peers``) are found at the first ``compile_all``, which every rank
    of ``ranks`` must reach (as every rank compiles its first graph); ``enabled=False``
    compiles everything here.

    Example:
        >>> solo = CompileSharing(lambda: None, "", rank=0, ranks=(0,), timeout_s=1)
        >>> solo.compile_all([], compile_one=lambda job: None, graph="call1")
        []
    """

    def __init__(
        self,
        store: Callable[[], object],
        prefix: str,
        *,
        rank: int,
        ranks: Sequence[int],
        timeout_s: float,
        enabled: bool = True,
    ) -> None:
        self._store = store
        self.prefix = prefix
        self.rank = rank
        self.ranks = tuple(ranks) if enabled else (rank,)
        self.timeout_s = timeout_s
        self.peers: tuple[int, ...] | None = None
        self.folders: dict[int, int] = {}  # rank -> its folder's first rank
        self.sources: Counter[str] = Counter()  # where the last compile_all's pieces came from
        self.received_bytes = 0
        self.sent_bytes = 0  # through the leaders' tree (Note [Compiles between folders by tree])
        self.route = "the store"  # how the last compile's pieces came from other folders
        self._taken: set[str] = set()  # "installed" keys this rank already fetched or waited for
        self._group: object | None = None  # the leaders' gloo group, made at first use
        self._blob: bytes = b""  # this leader's sealed share, for the tree
        self._roots: tuple[int, ...] = ()  # the leaders whose shares go down the tree
        self._broken = f"{prefix}/tree/broken"  # set once the tree failed: the store from then on

    def find_peers(self) -> tuple[int, ...]:
        """The peers, found on first use (collective over ``ranks``), and every rank's folder."""
        if self.peers is None:
            store = counted(self._store(), "peers")
            self.peers = cache_peers(
                store, f"{self.prefix}/peers", rank=self.rank, ranks=self.ranks, timeout_s=self.timeout_s
            )
            self.folders = folder_of(
                store,
                f"{self.prefix}/folders",
                rank=self.rank,
                peers=self.peers,
                ranks=self.ranks,
                timeout_s=self.timeout_s,
            )
        return self.peers

    @property
    def sharers(self) -> tuple[int, ...]:
        """The ranks that split the compiles: the whole job when the ranks have several
        cache folders (Note [Compiles shared across cache folders]), else the folder's peers."""
        return self.ranks if self.several_folders() else self.find_peers()

    def several_folders(self) -> bool:
        """Whether the ranks have more than one cache folder (collective at first use)."""
        self.find_peers()
        return len(set(self.folders.values())) > 1

    def abandon(self, graph: str) -> None:
        """This rank left the shared compile ``graph`` (TorchDynamo restarted its trace, or it
        failed): the peers waiting for its share compile those pieces themselves, now."""
        try:
            counted(self._store(), "sharing").set(f"{self.prefix}/{graph}/abandoned/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the original exception matters more
            log.debug("rank %d: could not mark compile %s abandoned", self.rank, graph)

    def _wait_for(self, store: CountedStore, key: str, peer: int, graph: str) -> bool:
        """Wait for ``peer``'s ``key`` (its share of a compile): True once it is there."""
        return wait_for_peer(
            store, key, prefix=self.prefix, graph=graph, rank=self.rank, peer=peer, timeout_s=self.timeout_s
        )

    def compile_all(
        self, jobs: Sequence[CompileJob], *, compile_one: Callable[[CompileJob], object], graph: str
    ) -> list:
        """``compile_one(job)`` for every job, this rank's share first; the results in job order.

        ``graph`` names the compile (the same on every rank), so that its jobs' keys in
        the store are its own. Under ``compat.eager_backward`` when shared.
        """
        self.find_peers()
        self.sources = Counter()
        marker = warm_marker(jobs_digest(jobs))
        if len(self.sharers) == 1:
            out = [self._compile_here(compile_one, job) for job in jobs]
        else:
            store = counted(self._store(), "sharing")
            with Heartbeat(store, f"{self.prefix}/beat/{self.rank}", self.timeout_s):
                out = self._compile_shared(store, jobs, compile_one, graph, marker)
        touch(marker)
        return out

    def _compile_shared(
        self,
        store: CountedStore,
        jobs: Sequence[CompileJob],
        compile_one: Callable[[CompileJob], object],
        graph: str,
        marker: str,
    ) -> list:
        """Carry out this rank's ``plan_sharing`` (Note [Compiles shared by folder])."""
        sharers = self.sharers
        folders = self.folders if self.folders else {r: sharers[0] for r in sharers}
        warm: tuple[int, ...] = ()
        if len({folders.get(r) for r in sharers}) > 1:  # cold folders load from warm ones
            warm = warm_ranks(
                store,
                f"{self.prefix}/{graph}/warm",
                rank=self.rank,
                ranks=sharers,
                marker=marker,
                timeout_s=self.timeout_s,
            )
        plan = plan_sharing(
            [job.cost for job in jobs],
            [job.shareable for job in jobs],
            rank=self.rank,
            sharers=sharers,
            folders=folders,
            warm=warm,
        )
        # By position: every rank has the same jobs (the graphs agree); piece keys name
        # objects by their id, which differs between ranks.
        done = [f"{self.prefix}/{graph}/{len(jobs)}/{j}" for j in range(len(jobs))]
        installed = f"{self.prefix}/{graph}/installed/{plan.leader}"
        out: list = [None] * len(jobs)
        by_tree = self._by_tree(store, plan, folders)
        self.route = "the leaders' tree" if by_tree else "the store"
        # Cold start: every leader's share; restart: one warm folder holds every piece.
        self._roots = plan.publishers[:1] if warm else plan.publishers
        if runs_on_cpu(a for job in jobs for a in job.args):
            if warm and self.rank not in warm:  # a cold folder: the warm folder's CPU-check libraries first
                self._take_other_folders(store, plan, graph, installed, by_tree)
            # Inductor's one-time CPU checks come before its first C++ kernel: split them too.
            if not warm and len(set(folders.values())) > 1:  # and carried to the other folders
                wait, key = (
                    functools.partial(self._wait_for, store, graph=graph),
                    f"{self.prefix}/{graph}/checks",
                )
                share_cpu_checks(store, key, rank=self.rank, sharers=sharers, folders=folders, wait=wait)
            else:
                run_cpu_checks(len(sharers), sharers.index(self.rank))
        with compat.eager_backward():
            for j in plan.mine:
                try:
                    out[j] = self._compile_here(compile_one, jobs[j])
                finally:  # done or failed: the peers stop waiting either way
                    store.set(done[j], str(self.rank))
            for j in plan.from_folder:
                self._wait_for(store, done[j], plan.owner[j], graph)
                out[j] = self._compile_from(compile_one, jobs[j], "same-folder peer")
            if plan.publishes:
                self._publish(store, f"{self.prefix}/{graph}/art/{self.rank}", by_tree)
            if plan.from_other or (by_tree and plan.is_leader):  # every leader is in the tree
                self._take_other_folders(store, plan, graph, installed, by_tree)
            for j in plan.from_other:
                out[j] = self._compile_from(compile_one, jobs[j], "other-folder peer")
        log.debug("rank %d: pieces of %s: %s; plan %s", self.rank, graph, dict(self.sources), plan)
        return out

    def _by_tree(self, store: CountedStore, plan: SharePlan, folders: dict[int, int]) -> bool:
        """Whether the folders' shares go down the leaders' tree (Note [Compiles between folders by
        tree]), not through the store: several leaders, something to send, no failure in it yet."""
        return len(set(folders.values())) > 1 and bool(plan.publishers) and not store.check([self._broken])

    def _take_other_folders(
        self, store: CountedStore, plan: SharePlan, graph: str, installed: str, by_tree: bool
    ) -> None:
        """The leader fetches the other folders' publications once and marks its folder installed
        (the last fetcher deletes them); the others wait for that mark. Once per graph."""
        if installed in self._taken:
            return
        self._taken.add(installed)
        if not plan.is_leader:
            self._wait_for(store, installed, plan.leader, graph)
            return
        try:
            if by_tree:
                self._exchange_by_tree(store, plan, graph)
            for lead in () if by_tree else plan.fetches:
                self._load_from(store, lead, graph)
        finally:
            store.set(installed, "1")  # loaded or not: the folder's ranks compile what is missing
        if not by_tree and last_to_arrive(store, f"{self.prefix}/{graph}/art/fetched", plan.fetchers):
            for lead in plan.publishers:
                transfer.delete(store, f"{self.prefix}/{graph}/art/{lead}")

    def _compile_from(
        self, compile_one: Callable[[CompileJob], object], job: CompileJob, source: str
    ) -> object:
        """A piece another rank made: a cache hit, counted as ``source``; else compiled here."""
        hits = compat.compile_cache_hits()
        out = compile_one(job)
        self.sources[source if compat.compile_cache_hits() > hits else "compiled here"] += 1
        return out

    def describe(self, pieces: int) -> str:
        """For the compile log line: the ranks that split a graph of ``pieces`` pieces and where
        its pieces came from; ``""`` when every rank compiled it alone (one piece, one folder).

        Example:
            >>> CompileSharing(lambda: None, "", rank=0, ranks=(0,), timeout_s=1).describe(3)
            ''
        """
        peers = self.sharers if self.peers is not None else ()
        if len(peers) <= 1 or (pieces <= 1 and not self.sources):
            return ""
        sources = self.describe_sources()
        return f"; compiles split between ranks {list(peers)} (backward included)" + (
            f"; {sources}" if sources else ""
        )

    def forget_sources(self) -> None:
        """A new graph starts: ``sources`` counts its pieces only."""
        self.sources.clear()

    def describe_sources(self) -> str:
        """Where the last compile's pieces came from, for the compile log line.

        Example:
            >>> s = CompileSharing(lambda: None, "", rank=0, ranks=(0,), timeout_s=1)
            >>> s.sources.update({"compiled here": 2, "other-folder peer": 3}); s.received_bytes = 2_500_000
            >>> s.describe_sources()
            'pieces: 2 compiled here, 3 from other-folder peers (2.5 MB through the store)'
        """
        parts = [f"{n} compiled here" for n in [self.sources["compiled here"]] if n]
        parts += [f"{n} from the cache" for n in [self.sources["cache"]] if n]
        parts += [f"{n} from same-folder peers" for n in [self.sources["same-folder peer"]] if n]
        parts += [
            f"{n} from other-folder peers ({self.received_bytes / 1e6:.1f} MB through {self.route})"
            for n in [self.sources["other-folder peer"]]
            if n
        ]
        parts += [
            f"{self.sent_bytes / 1e6:.1f} MB sent down the leaders' tree" for _ in [0] if self.sent_bytes
        ]
        return "pieces: " + ", ".join(parts) if parts else ""

    def _compile_here(self, compile_one: Callable[[CompileJob], object], job: CompileJob) -> object:
        hits = compat.compile_cache_hits()
        out = compile_one(job)
        self.sources["cache" if compat.compile_cache_hits() > hits else "compiled here"] += 1
        return out

    def _exchange_by_tree(self, store: CountedStore, plan: SharePlan, graph: str) -> None:
        """Every leader: once each publisher is ready, its sealed share down a binomial tree;
        the leaders that need other folders' pieces install what arrives."""
        leaders = sorted(set(self.folders.values()))
        for lead in self._roots:
            if lead != self.rank and not self._wait_for(
                store, f"{self.prefix}/{graph}/art/{lead}/ready", lead, graph
            ):
                return  # the others' tree times out on this leader too, and they compile what is missing
        try:
            if self._group is None:
                self._group = tree.leaders_group(leaders, self.timeout_s)
            for lead in self._roots:
                data, sent = tree.tree_broadcast(
                    self._blob if lead == self.rank else None, root=lead, ranks=leaders, group=self._group
                )
                self.sent_bytes += sent
                if lead != self.rank and plan.fetches and data:
                    self._install(*transfer.unseal(data, compat.build_fingerprint()), lead)
        except Exception as exc:  # noqa: BLE001 - compiled here instead, which is never wrong
            store.set(self._broken, "1")  # the rest of the job goes through the store
            log.warning(
                "rank %d: the leaders' tree failed (%s: %s); compiling what is missing here, later graphs "
                "go through the store",
                self.rank,
                type(exc).__name__,
                exc,
            )
        finally:
            self._blob = b""

    def _install(self, payload: bytes | None, why: object, peer: int) -> bool:
        """Install ``peer``'s pieces, or say why not (this rank then compiles them)."""
        try:
            if payload is not None:
                transfer.install(payload)
                self.received_bytes += len(payload)
                return True
        except Exception as exc:  # noqa: BLE001 - compiled here instead, which is never wrong
            why = f"{type(exc).__name__}: {exc}"
        log.warning(
            "rank %d: not loading rank %d's compiled pieces: %s; compiling them here", self.rank, peer, why
        )
        return False

    def _publish(self, store: CountedStore, key: str, by_tree: bool = False) -> None:
        # Whatever happens, "ready" is set: the other folders stop waiting and compile
        # themselves if nothing usable was published.
        try:
            payload = transfer.collect()
            if payload and by_tree:  # sent down the tree by _exchange_by_tree
                self._blob = transfer.seal(payload, compat.build_fingerprint())
            elif payload:
                transfer.publish(store, key, payload, compat.build_fingerprint())
            compat.forget_artifacts()  # the next publication carries only what is new
        except Exception as exc:  # noqa: BLE001 - the others compile what they cannot load
            log.warning(
                "rank %d: could not publish its compiled pieces (%s: %s)", self.rank, type(exc).__name__, exc
            )
        finally:
            store.set(f"{key}/ready", "1")

    def _load_from(self, store: CountedStore, peer: int, graph: str) -> bool:
        """Load ``peer``'s published pieces of ``graph`` (another folder) into the caches here."""
        key = f"{self.prefix}/{graph}/art/{peer}"
        self._wait_for(store, f"{key}/ready", peer, graph)
        try:
            payload, why = transfer.fetch(store, key, compat.build_fingerprint())
        except Exception as exc:  # noqa: BLE001 - compiled here instead, which is never wrong
            payload, why = None, f"{type(exc).__name__}: {exc}"
        return self._install(payload, why, peer)
