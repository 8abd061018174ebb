"""What the planner knows of one graph node (``NodeInfo``): its parameters and its last reader.

Its own module so that the plan (``plan.py``) and the schedule search (``search.py``) can
both use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeInfo"]


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One forward graph node as the planner sees it.

    Attributes:
        name: The FX node name.
        params: Names of the trainable parameters the node reads.
        last_user: Index of the last node that reads this node's value
            (``len(nodes)`` for the graph output, ``-1`` if nothing reads it).
        lookups: Those of ``params`` read as the table of an embedding lookup (their
            gradient from this node touches only the rows looked up).
    """

    name: str
    params: tuple[str, ...] = ()
    last_user: int = -1
    lookups: tuple[str, ...] = ()
