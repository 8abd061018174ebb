"""Fleet: compiles shared between the ranks of a job, through the compile caches and the store.

May import ``compile`` (the jobs and the ``SharedCompiles`` seam it implements) and the
leaves. The backend never imports it: ``runtime`` builds the sharing
(``sharing.sharing_for``) and hands it to the backend, which only calls the seam; with one
rank, ``share_compiles=False`` or a backend other than Inductor nothing here runs.

- ``sharing.py``: compiles split between the ranks that share a cache folder, and across folders.
- ``share_plan.py``: who compiles each piece, who publishes, whom each rank loads from (pure).
- ``peers.py``: which ranks share a folder, which are warm; the heartbeat.
- ``transfer.py``: compiled pieces packed, published and installed through the store.
- ``tree.py``: compiled pieces between folders' leaders down a binomial tree (a gloo group).
- ``cpu_checks.py``: Inductor's one-time CPU checks shared across folders.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import _torch_compat as compat
from .._agreement import default_store
from .._config import Config
from .sharing import CompileSharing

__all__ = ["sharing_for"]


def sharing_for(
    config: Config, *, store_prefix: str, rank: int, ranks: Sequence[int]
) -> CompileSharing | None:
    """The compile sharing a wrapped model's backend is given, or ``None`` where nothing can be
    shared (one rank, ``share_compiles=False``, a backend other than Inductor, or torch's
    compile caches off): the backend then compiles every piece itself and no code of this
    package runs.

    Example:
        >>> from distcompile import Config
        >>> sharing_for(Config(), store_prefix="m", rank=0, ranks=(0,)) is None
        True
    """
    if len(ranks) < 2 or not config.share_compiles or config.backend != "inductor":
        return None
    if not compat.compile_caches_enabled():
        return None
    return CompileSharing(
        default_store,
        f"{store_prefix}/compiles",
        rank=rank,
        ranks=ranks,
        timeout_s=config.desync_timeout_s,
    )
