"""Check that every rank captured the same graph and made the same plan.

A rank that captured a different graph would issue different collectives and hang the
job. Each rank publishes a summary of what it compiled through the process group's
key-value store and compares it with every other rank's, with a deadline.
"""

from __future__ import annotations

import difflib
import logging
from datetime import timedelta

import torch.distributed as dist

from . import _torch_compat as compat
from ._errors import DesyncError

__all__ = ["check_agreement", "default_store", "mark_failed", "failed_ranks"]

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
    """Publish ``summary`` under ``key`` and raise :class:`DesyncError` unless all ``ranks`` agree.

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
    store.set(f"{key}/{rank}", summary)
    keys = [f"{key}/{r}" for r in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises a timeout error type that differs across versions
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise DesyncError(
            f"rank {rank}: rank(s) {missing} did not compile {what} within {timeout_s:.0f} s "
            "(desync_timeout_s). Those ranks either took a different code path (their "
            "inputs, shapes or control flow differ, so TorchDynamo captured a different "
            "graph or none), are still compiling, or died. Make every rank run the same "
            "model code on same-shaped inputs, or raise desync_timeout_s if compiles are slow."
        ) from exc
    for r, k in zip(ranks, keys):
        other = store.get(k).decode()
        if other != summary:
            diff = "\n".join(
                list(
                    difflib.unified_diff(
                        summary.splitlines(),
                        other.splitlines(),
                        f"rank {rank}",
                        f"rank {r}",
                        lineterm="",
                        n=1,
                    )
                )[:40]
            )
            raise DesyncError(
                f"rank {rank}: {what} differs between rank {rank} and rank {r}; continuing would "
                f"issue mismatched all-reduces or train apart. {fix} First differences:\n{diff}"
            )
    log.debug("%s agrees across ranks %s", what, ranks)


def mark_failed(store: dist.Store, prefix: str, rank: int, what: str) -> None:
    """Record that ``rank`` raised, so peers waiting on it can name it. Never raises."""
    try:
        store.set(f"{prefix}/failed/{rank}", what[:2000])
    except Exception:  # noqa: BLE001 - the store may be gone too; the original error matters more
        log.debug("could not record the failure of rank %d in the store", rank)


def failed_ranks(store: dist.Store, prefix: str, ranks: list[int]) -> dict[int, str]:
    """Ranks that recorded a failure under ``prefix``, with what they recorded."""
    out = {}
    for r in ranks:
        key = f"{prefix}/failed/{r}"
        try:
            if store.check([key]):
                out[r] = store.get(key).decode()
        except Exception:  # noqa: BLE001 - a store that is down cannot tell us more
            break
    return out
