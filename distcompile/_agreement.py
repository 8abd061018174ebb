"""Check that every rank captured the same graph and made the same plan.

A rank that captured a different graph would issue different collectives and hang the
job. Each rank publishes a summary of what it compiled through the process group's
key-value store and compares it with every other rank's, with a deadline.
"""

from __future__ import annotations

import difflib
import json
import logging
import time
from datetime import timedelta

import torch.distributed as dist

from . import _torch_compat as compat
from ._errors import DesyncError

__all__ = [
    "check_agreement",
    "compile_together",
    "default_store",
    "failed_ranks",
    "layouts_agree",
    "mark_failed",
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
            "(desync_timeout_s). Those ranks either took a different code path before it "
            "(Python control flow that differs between ranks, so TorchDynamo captured another "
            "graph or none), are still compiling, or died. Make every rank run the same model "
            "code, or raise desync_timeout_s if compiles are slow."
        ) from exc
    _compare(store, summary, rank=rank, ranks=ranks, keys=keys, what=what, fix=fix)


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
    others' did not). Each rank publishes ``summary`` under ``key`` and waits up to
    ``wait_s`` for the others; the first rank that sees all of them records "together",
    the first whose wait ends records "alone" (one atomic ``compare_set``: every rank reads
    the same decision). Together, the summaries are compared (:class:`DesyncError` if they
    differ, or with ``mismatch_ok`` alone) and the ranks may share the compile; alone, each
    compiles by itself.

    Example:
        >>> # compile_together(default_store(), "wrap0/compile/3/0", text, rank=r, ranks=[0, 1],
        >>> #                  wait_s=5, what="graph 4", fix="...")
    """
    store.set(f"{key}/{rank}", summary)
    keys = [f"{key}/{r}" for r in ranks]
    deadline = time.monotonic() + wait_s
    while True:
        if store.check(keys):
            decision = store.compare_set(f"{key}/decision", "", "together")
        elif time.monotonic() > deadline:
            decision = store.compare_set(f"{key}/decision", "", "alone")
        elif store.check([f"{key}/decision"]):
            decision = store.get(f"{key}/decision")
        else:
            time.sleep(0.01)
            continue
        break
    if decision != b"together":
        log.debug(
            "%s: compiled by this rank alone (the others did not compile it within %.0f s)", what, wait_s
        )
        return False
    if mismatch_ok:  # graphs that may differ by data: another graph here is no error, just no sharing
        return all(store.get(k).decode() == summary for k in keys)
    _compare(store, summary, rank=rank, ranks=ranks, keys=keys, what=what, fix=fix)
    return True


def _compare(
    store: dist.Store, summary: str, *, rank: int, ranks: list[int], keys: list[str], what: str, fix: str
) -> None:
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


def layouts_agree(
    store: dist.Store, key: str, groups: list[list[str]], *, rank: int, ranks: list[int], timeout_s: float
) -> list[list[str]] | None:
    """``groups`` (a bucket layout) if every rank published the same under ``key``, else ``None``.

    Once per wrapped model (its layout is frozen then); a rank that does not publish within
    ``timeout_s`` is a :class:`DesyncError`.

    Example:
        >>> # layouts_agree(default_store(), "wrap0/layout", [["b.weight"], ["a.weight"]], rank=0, ranks=[0, 1], timeout_s=60)
    """
    mine = json.dumps(groups)
    store.set(f"{key}/{rank}", mine)
    keys = [f"{key}/{r}" for r in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # the store's timeout error type differs across versions
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise DesyncError(
            f"rank {rank}: rank(s) {missing} did not fix their gradient buckets within {timeout_s:.0f} s "
            "(desync_timeout_s): they did not reach the same step, or took no data-dependent graph break "
            "where this rank took one. Every rank must run the same model code."
        ) from exc
    same = all(store.get(k).decode() == mine for k in keys)
    return groups if same else None


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
