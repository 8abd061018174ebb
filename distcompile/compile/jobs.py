"""What the backend hands to whoever compiles its pieces: the jobs, and the seam to compile sharing.

``compile/`` compiles locally. Sharing the compiles between ranks (``distcompile/fleet``)
sits behind :class:`SharedCompiles`, which the backend is given (``None``: this rank compiles
every piece itself) and never builds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import fx

__all__ = ["CompileJob", "SharedCompiles", "assign"]


@dataclass(frozen=True, slots=True, eq=False)
class CompileJob:
    """One distinct piece to compile.

    Attributes:
        module: The piece.
        args: Its (fake) example inputs.
        key: ``reuse.piece_key`` of the piece, or ``None`` (it stands for itself alone).
        position: Where its first use comes among the graph's pieces (1 for the first).
        needs_backward: Whether any of its inputs requires a gradient.
        shareable: Whether a peer can load it from AOTAutograd's cache
            (``compat.aot_cacheable``); if not, every rank compiles it.
    """

    module: fx.GraphModule
    args: list
    key: str | None
    position: int = 0
    needs_backward: bool = False
    shareable: bool = True

    @property
    def cost(self) -> int:
        """Operations in the piece: the compile work, roughly."""
        return sum(1 for n in self.module.graph.nodes if n.op not in ("placeholder", "output", "get_attr"))


class SharedCompiles(Protocol):
    """The backend's one seam to compile sharing (implemented by ``fleet.sharing.CompileSharing``).

    Attributes:
        sources: Where the last ``compile_all``'s pieces came from (for ``GraphRecord.piece_sources``).
    """

    sources: Mapping[str, int]

    def compile_all(
        self, jobs: Sequence[CompileJob], *, compile_one: Callable[[CompileJob], object], graph: str
    ) -> list:
        """``compile_one(job)`` for the jobs this rank compiles, the others loaded; results in job order."""

    def several_folders(self) -> bool:
        """Whether the ranks have more than one cache folder (a one-piece graph is shared then)."""

    def abandon(self, graph: str) -> None:
        """This rank left the shared compile ``graph``: peers waiting for its share stop waiting."""

    def describe(self, pieces: int) -> str:
        """For the compile log line: who split a graph of ``pieces`` pieces, and where they came from
        (``""``: every rank compiled it alone)."""

    def forget_sources(self) -> None:
        """A new graph starts: ``sources`` counts its pieces only."""


def assign(costs: Sequence[int], peers: int) -> list[int]:
    """Owner (peer index) of each job: largest first, each to the least loaded peer.

    Example:
        >>> assign([5, 20, 3, 10], 2)
        [1, 0, 1, 1]
    """
    load = [0] * peers
    owner = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        p = min(range(peers), key=lambda p: (load[p], p))
        owner[j] = p
        load[p] += costs[j]
    return owner
