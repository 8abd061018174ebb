"""The one seam between distcompile and PyTorch's private internals.

distcompile splits TorchDynamo graphs, compiles the pieces the way PyTorch's DDPOptimizer
does, and owns DDP's gradient synchronization; some of that has no public API. Every use
of a private torch name goes through one function here, so that a torch release that
moves one of them breaks one function, which either falls back or raises
:class:`~distcompile.UnsupportedTorchError` naming the installed version and the range
distcompile was tested on, instead of a ``KeyError`` from deep inside the compiler.

The functions live by topic (``dynamo``, ``pieces``, ``dist``, ``version``) and are
all importable from here. Each function's docstring says which torch releases it was checked on ("checked:").
``tests/test_torch_compat.py`` greps the package: no other module may touch a
private torch name. To support a new torch release: run ``.ci/torch-matrix X.Y.Z``, fix
what fails here, extend ``TESTED_RANGE`` and the table in ``docs/torch-versions.md``.
"""

from . import dist, dynamo, pieces, version
from .dist import (
    ddp_comm_hook_names,
    ddp_ignored_names,
    ddp_uses_python_reducer,
    default_store,
    queue_engine_callback,
    tree_leaves,
    tree_map_only,
    write_summary,
)
from .dynamo import (
    backend_failure_cause,
    compile_cache_hits,
    compile_module,
    compiled_autograd,
    graph_break_parts,
    inductor_cache_dir,
    inductor_compiler,
    inductor_fallback_random,
    inductor_keeps_output_strides,
    is_compiled_module,
    lookup_backend,
    set_optimize_ddp,
)
from .pieces import (
    aot_autograd_counts,
    copy_dynamo_metadata,
    fake_mode_of,
    fake_module,
    piece_compiler_base,
    piece_names,
    record_piece_metadata,
    saved_tensors_hooks_disabled,
    to_fake,
)
from .version import TESTED_RANGE, torch_version, unsupported, warn_if_untested

# Every topic module's names, re-exported above: one list per topic, kept there.
__all__ = [*dist.__all__, *dynamo.__all__, *pieces.__all__, *version.__all__]
