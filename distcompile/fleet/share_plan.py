"""Who compiles each piece, who publishes, and whom each rank loads from (pure).

Note [Compiles shared by folder]
--------------------------------
Background: ranks of several cache folders split a graph's distinct pieces, and the
pieces travel between folders through the job's store (Note [Compiles shared across
cache folders]). At first every rank published what it compiled and every rank of
another folder fetched it: the store served each piece once per rank of the other
folders, O(ranks x bytes) through one process.

Algorithm (this module decides; ``sharing.py`` carries it out):

- Cold start: the pieces are split between all the ranks, largest first (``assign``):
  every rank compiles its share, so compile work stays split N ways.
- Each folder has a leader, its first rank. A rank loads the pieces of its own folder's
  ranks from the folder (they are marked done in the store); the leader, once its process
  holds its folder's share (compiled or loaded), publishes it once for the other folders,
  if any other folder needs it (a graph of P distinct pieces has at most P publishers,
  however many folders there are).
- Only leaders fetch: each takes every other folder's publication once, installs it into
  its folder and marks the folder installed; the other ranks of the folder wait for that
  mark and load from the folder. Each publication is read once per other folder, then
  deleted by the last leader that needed it.
- Warm restart: ranks whose folder holds the graph's pieces load them from it; a cold
  folder's leader fetches from one warm folder's leader (cold folders spread over the
  warm ones), and its ranks load from the folder.

Cost through the store: each folder's share written once and read by F - 1 leaders (F
folders): F x the graph's compiled bytes in all, at most (F - 1) x one folder's share
served to any one reader, and nothing left in the store after the last reader. Since the
leaders' tree (Note [Compiles between folders by tree]) the publications go through the
store only after that tree failed once in the job; the plan is the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..compile.jobs import assign

__all__ = ["SharePlan", "plan_sharing"]


@dataclass(frozen=True, slots=True)
class SharePlan:
    """One rank's part in sharing one graph's compiles.

    Attributes:
        owner: For each job, the rank that compiles it (or loads it from its warm folder).
        mine: Jobs this rank compiles or loads from its own cache first (its share, and every
            job no peer can load from a cache).
        from_folder: Jobs a rank of this rank's folder makes: loaded from the folder once marked done.
        from_other: Jobs made in other folders: the leader fetches them, its folder loads them.
        leader: This rank's folder's leader.
        publishes: This rank publishes its folder's pieces for the other folders.
        fetches: The leaders whose publications this rank fetches (a leader's list; empty for others).
        fetchers: How many leaders fetch anything: the last of them deletes the publications.
        publishers: The leaders that publish: those another folder fetches from.
        rank: The rank this plan is for.
    """

    rank: int
    owner: tuple[int, ...]
    mine: tuple[int, ...]
    from_folder: tuple[int, ...]
    from_other: tuple[int, ...]
    leader: int
    publishes: bool
    fetches: tuple[int, ...]
    fetchers: int
    publishers: tuple[int, ...]

    @property
    def is_leader(self) -> bool:
        """Whether this rank leads its folder (publishes and fetches for it)."""
        return self.leader == self.rank


def _owners(
    costs: Sequence[int],
    shareable: Sequence[bool],
    rank: int,
    sharers: Sequence[int],
    folders: Mapping[int, int],
    warm: Sequence[int],
) -> list[int]:
    n = len(costs)
    if warm and rank in warm:
        return [rank] * n
    if warm:  # a cold folder takes everything from one warm folder's leader
        cold_leaders = sorted({folders[r] for r in sharers if r not in warm})
        warm_leaders = sorted({folders[r] for r in warm})
        return [warm_leaders[cold_leaders.index(folders[rank]) % len(warm_leaders)]] * n
    return [sharers[o] for o in assign([c if s else 0 for c, s in zip(costs, shareable)], len(sharers))]


def _fetched_from(
    owner: Sequence[int],
    shareable: Sequence[bool],
    sharers: Sequence[int],
    folders: Mapping[int, int],
    warm: Sequence[int],
) -> dict[int, set[int]]:
    """For each leader, the leaders it fetches from: the folders that make the shareable pieces
    its folder does not (in O(folders + pieces), not once per leader). ``owner``: any rank's
    owners at a cold start (they are the same on every rank)."""
    leaders = sorted({folders[r] for r in sharers})
    if not any(shareable):
        return {lead: set() for lead in leaders}
    if not warm:  # every rank computes the same owners
        owning = {folders[o] for o, s in zip(owner, shareable) if s}
        return {lead: owning - {lead} for lead in leaders}
    warm_set = set(warm)
    cold = sorted({folders[r] for r in sharers if r not in warm_set})
    warm_leaders = sorted({folders[r] for r in warm})
    source = {lead: warm_leaders[k % len(warm_leaders)] for k, lead in enumerate(cold)}
    return {lead: set() if lead in warm_set else {source[lead]} - {lead} for lead in leaders}


def plan_sharing(
    costs: Sequence[int],
    shareable: Sequence[bool],
    *,
    rank: int,
    sharers: Sequence[int],
    folders: Mapping[int, int],
    warm: Sequence[int] = (),
) -> SharePlan:
    """This rank's plan for a graph's jobs (their compile ``costs``, and whether a peer can load
    each from a cache) among ``sharers``; ``folders`` maps each rank to its folder's first
    rank; ``warm``: the ranks whose folder already holds the pieces (Note [Compiles shared by folder]).

    Example:
        >>> folders = {0: 0, 1: 0, 2: 2, 3: 2}
        >>> p = plan_sharing([5, 4, 3, 2], [True] * 4, rank=2, sharers=[0, 1, 2, 3], folders=folders)
        >>> p.owner, p.mine, p.from_folder, p.from_other, p.publishes, p.fetches, p.fetchers, p.publishers
        ((0, 1, 2, 3), (2,), (3,), (0, 1), True, (0,), 2, (0, 2))
    """

    owner = _owners(costs, shareable, rank, sharers, folders, warm)
    mine = [j for j in range(len(costs)) if owner[j] == rank or not shareable[j]]
    other = [j for j in range(len(costs)) if j not in mine and folders[owner[j]] != folders[rank]]
    leader = folders[rank]
    wanted = _fetched_from(owner, shareable, sharers, folders, warm)
    # Only leaders some other folder fetches from publish: at most one per piece, not one per folder.
    publishers = tuple(sorted(set().union(*wanted.values())))
    return SharePlan(
        rank=rank,
        owner=tuple(owner),
        mine=tuple(mine),
        from_folder=tuple(j for j in range(len(costs)) if j not in mine and j not in other),
        from_other=tuple(other),
        leader=leader,
        publishes=rank in publishers,
        fetches=tuple(sorted(wanted[rank])) if leader == rank else (),
        fetchers=sum(1 for w in wanted.values() if w),
        publishers=publishers,
    )
