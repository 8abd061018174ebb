"""What a failed collective says happened, the peers behind it, and the errors a reducer raises
for a bucket (communication failed; NaN/Inf after the all-reduce)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from .. import _events
from ..errors import CommunicationError, NonFiniteGradientError

__all__ = ["NO_PEERS", "Peers", "comm_error", "raise_if_nonfinite", "what_happened"]


def raise_if_nonfinite(buckets: Sequence, step: int) -> None:
    """Raise ``NonFiniteGradientError`` naming the first bucket (``FlatBucket`` or sparse) whose
    synchronized gradients hold NaN or Inf (``detect_nonfinite``), before any optimizer steps.

    Example:
        >>> raise_if_nonfinite([], 0)  # nothing to check
    """
    for bucket in buckets:
        bad = bucket.nonfinite()
        if bad:
            raise NonFiniteGradientError(
                f"step {step}: bucket {bucket.index} holds NaN/Inf gradients after the all-reduce, in "
                f"{', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}. Every rank stops here (they all "
                "see the same averaged gradients), before any optimizer in backward stepped. Lower the "
                "learning rate, check the inputs of this step, or use a loss scaler; set "
                "detect_nonfinite=False to skip the check."
            )


#: What a failed collective's message says happened, first match wins (gloo's and NCCL's words).
_CAUSES = (
    (r"closed by peer|reset by peer|broken pipe|connection refused|\bEOF\b|aborted|no route to host",
     "a peer died (its process exited or was killed, or its node or link went down)"),
    (r"timed? ?out|timeout|deadline", "a peer stalled or the link timed out (no data within the "
     "process group's timeout)"),
)  # fmt: skip


def what_happened(exc: BaseException, ranks_at: Callable[[str], list[int]] = lambda address: []) -> str:
    """A peer died, stalled, or the link timed out: what ``exc`` from a collective says, in words,
    with the ranks behind the peer's address where ``ranks_at`` knows them.

    Example:
        >>> what_happened(RuntimeError("[pair.cc:534] Read error [10.0.0.2]:4242: Connection reset by peer"),
        ...               lambda address: [2, 3])
        'a peer died (its process exited or was killed, or its node or link went down) at [10.0.0.2]:4242 (ranks 2, 3)'
    """
    text = " ".join(str(exc).split())
    where = re.search(r"\[[0-9a-fA-F.:]+\]:\d+", text)
    for pattern, words in _CAUSES:
        if re.search(pattern, text, re.IGNORECASE):
            if where is None:
                return words
            ranks = ranks_at(where.group(0))
            named = (
                f" ({'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))})" if ranks else ""
            )
            return f"{words} at {where.group(0)}{named}"
    return "the collective failed"


@dataclass(frozen=True)
class Peers:
    """What a rank can learn of its peers when a collective fails: ``describe()`` what the other
    ranks recorded, and ``at(address)``, the other ranks behind a peer's address (Note [Naming
    the peer behind an address] in ``_agreement.py``).

    Example:
        >>> Peers(describe=lambda: "rank 1 raised first: ...").at("[10.0.0.2]:4242")
        []
    """

    describe: Callable[[], str] = lambda: ""
    at: Callable[[str], list[int]] = lambda address: []


#: Knows nothing of the peers (a reducer used on its own, as in the tests).
NO_PEERS = Peers()


def comm_error(bucket: object, step: int, peers: Peers, doing: str, exc: Exception) -> CommunicationError:
    """The error for a failed all-reduce of ``bucket`` in ``step``, with what is known of the peers.

    Also logs its first line at once (before Python's traceback reaches the console) and
    records it in the job's event log.

    Example:
        >>> b = type("B", (), {"index": 1, "nbytes": 8, "params": [None], "collective": "all-reduce"})()
        >>> str(comm_error(b, 3, Peers(), "waiting for", RuntimeError("gone")))[:61]
        'rank 0: step 3, bucket 1: the collective failed while waiting'
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    head = (
        f"rank {rank}: step {step}, bucket {bucket.index}: {what_happened(exc, peers.at)} while {doing} "  # type: ignore[attr-defined]
        f"its {bucket.collective} ({bucket.nbytes} bytes, {len(bucket.params)} parameters)"  # type: ignore[attr-defined]
    )
    logging.getLogger("distcompile").error("%s", head)
    _events.emit("error", error="CommunicationError", message=head)
    return CommunicationError(
        f"{head}. {type(exc).__name__}: {' '.join(str(exc).split())[:500]}. {peers.describe()}"
    )
