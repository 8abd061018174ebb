"""Note [Graphs that differ by data]: which compiles the ranks do together, and what must agree.

Background
    Ranks that run the same model capture the same graphs, in the same order, in the first
    step; a rank that captured something else would issue other all-reduces and hang the
    job, so those compiles are checked against each other (and their pieces shared between
    the ranks: Note [Sharing compiles between ranks]). But graphs may also differ by data,
    legitimately: the sizes of a routed mixture-of-experts layer's token groups, a batch
    size or a sequence length that differs per rank; a recompile that only the rank whose
    inputs changed needs; and after a graph break on a tensor's values (``nonzero``, a
    boolean mask, ``.item()``), the code that runs next (which experts a rank calls, how
    many times a loop turns) may differ between ranks.

Algorithm
    * What is compared is the graph's structure (``capture.graph.structure``: operations,
      parameters read, module path and code line of each node) and its plan, never sizes.
    * The first compiles of the first step (not recompiles), up to a data-dependent break in
      a call, are checked with every rank, waiting up to ``desync_timeout_s``: a missing rank
      or another structure raises :class:`DesyncError` naming the module path and code line
      where the ranks part. A recompile is the same code under other guards (another size,
      a value TorchDynamo specialized on): compared, never required equal.
    * A later compile is done together if every rank reaches it within ``LOCKSTEP_WAIT_S``
      (all ranks recompile for a new sequence length: checked and shared), else alone: a
      recompile of this rank's own (``_agreement.compile_together``).
    * After a data-dependent break, the rest of that call compiles alone, unchecked; from then
      on (and from the start under ``find_unused_parameters=True``, DDP's own sign that the
      parameters used differ between steps and ranks) only the model's first graph must be
      the same on every rank (under ``find_unused_parameters=True`` even that one is
      compared, not required: when TorchDynamo skips the model's own forward, which it does
      for a graph break inside a loop, such as ``if mask.any():`` over the experts of a
      mixture, the first graph is the first expert a rank routes tokens to, and it
      differs by data): a later one that differs is compiled alone, and the gradients
      travel in a bucket layout that does not depend on which graphs ran (frozen once,
      agreed by every rank: ``BucketRegistry.freeze_layout``, runtime/reducer.py). Every rank
      reaches the first such break in the same step, before its first backward.

Notes
    Keys are the step and the compile's rank among that step's checked compiles, so that a
    rank's extra recompile does not shift the others' keys.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .._agreement import check_agreement, compile_together, default_store, first_rank_says
from ..capture.graph import CapturedGraph, structure
from ..planning.plan import Plan

__all__ = ["LOCKSTEP_WAIT_S", "Lockstep"]

log = logging.getLogger(__name__)

#: Seconds a recompile after the first step waits for the other ranks to recompile too.
LOCKSTEP_WAIT_S = 5.0

_FIX = (
    "Their structure differs (operations, the parameters they read, or the code they come "
    "from; sizes are not compared, they may differ by data). The lines below name the module "
    "path and code line where the ranks' graphs part: every rank must run the same model code "
    "(a branch on a rank-dependent Python value, or on a tensor TorchDynamo specialized on, gives "
    "another graph). Under bucket_cap_mb='auto' the plan also follows each rank's FLOPs, so ranks "
    "with different batch sizes can plan apart: use a fixed bucket_cap_mb there."
)


class Lockstep:
    """The compile-time agreement of one wrapped model (Note [Graphs that differ by data]).

    Example:
        >>> # lockstep = Lockstep(prefix, rank=0, ranks=(0, 1), timeout_s=60)
        >>> # together = lockstep.agree(captured, plan, step=0, what="graph 0")
    """

    def __init__(
        self, prefix: str, *, rank: int, ranks: tuple[int, ...], timeout_s: float, differ: bool = False
    ) -> None:
        self.prefix = prefix
        self.rank = rank
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        # Graphs may differ by data (find_unused_parameters=True, or a data-dependent break seen):
        # only the model's first graph must agree; later ones are compared, not required equal.
        self.data_dependent = differ
        self._declared = differ  # find_unused_parameters=True: even the first graph may differ
        self._after_break = False  # in this call, after a data-dependent break
        self._step = -1
        self._k = 0
        self._restarted = False
        self._retry = 0  # how many times TorchDynamo restarted the trace of the graph checked
        self.name = ""  # the last compile checked, "step_k" (names its shared compile, when together)

    def restarted(self) -> None:
        """TorchDynamo restarted the trace of the graph just checked (its own control flow, from
        inside a compile): the next graph is that one again, checked under a key of its own
        (the first attempt's summaries and compile marks in the store are stale: a rank that
        read them compared against a graph its peer no longer compiles). A rank that loaded
        its pieces from a peer's compile may not restart: a retry is compared, not required,
        and the peers that did not retry leave it to compile alone after ``LOCKSTEP_WAIT_S``."""
        self._k -= 1
        self._restarted = True
        self._retry += 1

    def new_call(self) -> None:
        """A forward call begins: its compiles are checked again until a data-dependent break."""
        self._after_break = False

    def upcoming(self, *, step: int, recompile: bool = False) -> tuple[str, bool]:
        """The next compile's store key, and whether it is checked with every rank (the
        first compiles of the first step): what ``agree`` will do, without doing it."""
        k = (self._k if step == self._step else 0) + 1
        retry = f".{self._retry}" if self._restarted and self._retry else ""
        first = not self.data_dependent or (k == 1 and not self._declared)
        checked = not self._after_break and step == 0 and not (recompile or self._restarted) and first
        return f"{self.prefix}/compile/{step}/{k}{retry}", checked

    def first_says(self, make: Callable[[], str], *, step: int, recompile: bool, what: str) -> str | None:
        """``make()`` of the first rank, on every rank, for a compile checked with every rank
        (it plans alike on all of them); ``None`` for any other (``make`` not called).

        Example:
            >>> # timed = lockstep.first_says(measure, step=0, recompile=False, what="graph 0")
        """
        key, checked = self.upcoming(step=step, recompile=recompile)
        if not checked:
            return None
        return first_rank_says(
            default_store(),
            f"{key}/costs",
            make,
            rank=self.rank,
            ranks=self.ranks,
            timeout_s=self.timeout_s,
            what=what,
        )

    def agree(
        self, captured: CapturedGraph, plan: Plan, *, step: int, what: str, recompile: bool = False
    ) -> bool:
        """Check this compile with the other ranks; whether they compile it together (and share).

        A recompile (``recompile``: a guard of code compiled before failed) is data-driven by
        nature: it is compared, never required equal.
        """
        if self._after_break:
            return False
        key, checked = self.upcoming(step=step, recompile=recompile)
        again, self._restarted = self._restarted, False
        self._step, self._k = step, (self._k if step == self._step else 0) + 1
        self._retry = self._retry if again else 0
        self.name = key.rpartition("/compile/")[2].replace("/", "_")
        recompile = recompile or again
        summary = "\n".join(structure(captured)) + "\nplan:\n" + plan.describe()
        if checked:
            check_agreement(
                default_store(),
                key,
                summary,
                rank=self.rank,
                ranks=self.ranks,
                timeout_s=self.timeout_s,
                what=what,
                fix=_FIX,
            )
            return True
        wait = min(LOCKSTEP_WAIT_S, self.timeout_s)
        store = default_store()
        return compile_together(
            store,
            key,
            summary,
            rank=self.rank,
            ranks=self.ranks,
            wait_s=wait,
            what=what,
            fix=_FIX,
            mismatch_ok=self.data_dependent or recompile,
        )

    def ended_at(self, graph_break: str | None, *, data_dependent: bool) -> bool:
        """The graph just compiled ended at ``graph_break``; True when it is the model's first
        data-dependent one (the caller switches to the static bucket layout)."""
        if not data_dependent:
            return False
        self._after_break = True
        first, self.data_dependent = not self.data_dependent, True
        if first:
            log.info(
                "a graph ends at a break on a tensor's values (%s): what runs after it may differ between "
                "ranks, so those compiles are each rank's own, and gradients travel in DDP's bucket layout "
                "(reverse parameter order, cut at the bucket caps) instead of graph-aligned buckets",
                (graph_break or "")[:300],
            )
        return first
