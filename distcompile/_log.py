"""Progress lines and warnings on the console, rank-prefixed, unless the application says otherwise.

Everything distcompile reports goes through ``logging.getLogger("distcompile.*")``. So that
a first step of 20-60 s is not silent, ``wrap`` and ``doctor`` attach one console handler
to the ``distcompile`` logger when neither it nor the root logger has a handler: progress
(INFO) on the job's first rank, warnings on every rank, each line prefixed with the rank.
To quiet progress: ``logging.getLogger("distcompile").setLevel(logging.WARNING)`` (before or
after ``wrap``); an application that configures logging itself gets no handler from us.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["enable_progress"]

_LOGGER = "distcompile"


class _RankLevel(logging.Filter):
    def __init__(self, rank: int, first: bool) -> None:
        super().__init__()
        self.rank = rank
        self.min_level = logging.INFO if first else logging.WARNING

    def filter(self, record: logging.LogRecord) -> bool:
        record.dc_rank = self.rank
        return record.levelno >= self.min_level


def enable_progress(*, rank: int, first_rank: bool) -> None:
    """Attach the rank-prefixed console handler (once per process, only where logging is unconfigured).

    Example:
        >>> enable_progress(rank=0, first_rank=True)
    """
    logger = logging.getLogger(_LOGGER)
    if logger.handlers or logging.getLogger().handlers:
        return  # the application decides where (and whether) our records go
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankLevel(rank, first_rank))
    handler.setFormatter(logging.Formatter("[distcompile rank %(dc_rank)d] %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False  # no second copy through Python's last-resort handler
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
