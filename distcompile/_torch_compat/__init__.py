"""The one seam between distcompile and PyTorch's private internals.

distcompile splits TorchDynamo graphs, compiles the pieces the way PyTorch's DDPOptimizer
does, and owns DDP's gradient synchronization; some of that has no public API. Every use
of a private torch name goes through one function here, so that a torch release that
moves one of them breaks one function, which either falls back or raises
:class:`~distcompile.UnsupportedTorchError` naming the installed version and the range
distcompile was tested on, instead of a ``KeyError`` from deep inside the compiler.

The functions live by topic (``dynamo``, ``dynamo_entries``, ``cpu_checks``, ``pieces``, ``donation``, ``dist``, ``hot_path``, ``artifacts``, ``event_files``, ``version``) and are
all importable from here. Each function's docstring says which torch releases it was checked on ("checked:").
``tests/test_torch_compat.py`` greps the package: no other module may touch a
private torch name. To support a new torch release: run ``.ci/torch-matrix X.Y.Z``, fix
what fails here, extend ``TESTED_RANGE`` and the table in ``docs/torch-versions.md``.
"""

from . import (
    artifacts,
    cpu_checks,
    dist,
    donation,
    dynamo,
    dynamo_entries,
    event_files,
    hot_path,
    pieces,
    version,
)

# Re-export each topic module's names; the lists live in the topic modules only.
from .artifacts import *  # noqa: F403
from .cpu_checks import *  # noqa: F403
from .dist import *  # noqa: F403
from .donation import *  # noqa: F403
from .dynamo import *  # noqa: F403
from .dynamo_entries import *  # noqa: F403
from .event_files import *  # noqa: F403
from .hot_path import *  # noqa: F403
from .pieces import *  # noqa: F403
from .version import *  # noqa: F403

__all__ = [
    *artifacts.__all__,
    *cpu_checks.__all__,
    *dist.__all__,
    *donation.__all__,
    *dynamo.__all__,
    *dynamo_entries.__all__,
    *event_files.__all__,
    *hot_path.__all__,
    *pieces.__all__,
    *version.__all__,
]
