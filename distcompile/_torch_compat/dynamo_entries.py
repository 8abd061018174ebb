"""What TorchDynamo keeps of what it compiled (cache entries, backends), whether it is running
now, whose random numbers its graphs draw for NumPy, the time spent in what Inductor compiled,
and nn.Module's own dicts."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback

from .version import unsupported

__all__ = [
    "drop_buffer",
    "hook_dicts",
    "inductor_graph_seconds",
    "inside_dynamo",
    "module_dicts",
    "numpy_random_from_torch",
    "release_backend",
    "untraced_reasons",
]


@contextlib.contextmanager
def inductor_graph_seconds() -> Iterator[list[float]]:
    """Within it, every call of a graph Inductor compiled adds its wall time to the one entry of
    the list it yields: the generated code (kernels, extern calls such as ``mm``, buffers), not
    AOTAutograd's wrappers around it. Wraps ``CompiledFxGraph.__call__`` meanwhile. Checked: 2.13, 2.15.

    Example:
        >>> with inductor_graph_seconds() as spent:
        ...     pass
        >>> spent
        [0.0]
    """
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError as exc:
        raise unsupported("Inductor's CompiledFxGraph", exc) from exc
    spent = [0.0]
    original = CompiledFxGraph.__call__
    clock = time.perf_counter

    def timed(self: Any, inputs: list) -> Any:
        start = clock()
        try:
            return original(self, inputs)
        finally:
            spent[0] += clock() - start

    CompiledFxGraph.__call__ = timed  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        CompiledFxGraph.__call__ = original  # type: ignore[method-assign]


def release_backend(backend: Callable) -> int:
    """Drop what TorchDynamo keeps of ``backend``'s compiles; return how many cache entries went.

    TorchDynamo keeps every backend it was given in ``eval_frame.cached_backends`` (until
    ``torch._dynamo.reset()``), and each compiled frame as a cache entry on its code object
    that holds the backend and the compiled function (installed as a global of the frame's
    module until the entry dies). A closed model would live as long as the process. Each
    entry whose backend is ``backend`` is invalidated the way TorchDynamo invalidates an entry
    whose guarded object died (its guards then always fail and it holds nothing); the frames'
    code objects are found in ``convert_frame.input_codes``. Entries of other backends stay.
    Checked: 2.13.

    Example:
        >>> release_backend(lambda gm, inputs: gm.forward)  # never used: nothing to drop
        0
    """
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo import convert_frame, eval_frame
        from torch._dynamo.guards import DeletedGuardManagerWrapper
    except ImportError as exc:
        raise unsupported("TorchDynamo's cache entries (eval_frame, guards)", exc) from exc
    released = 0
    for ref in list(convert_frame.input_codes.seen):
        code = ref()
        if code is None:
            continue
        for entry in _debug_get_cache_entry_list(code):
            if entry.backend is None or eval_frame.innermost_backend(entry.backend) is not backend:
                continue
            manager = entry.guard_manager
            state = getattr(manager, "extra_state", None)
            if state is not None and getattr(manager, "cache_entry", None) is not None:
                state.invalidate(entry, DeletedGuardManagerWrapper("distcompile: its model was closed"))
                released += 1
    eval_frame.cached_backends.pop(id(backend), None)
    return released


def module_dicts(module: torch.nn.Module) -> tuple[dict, dict, dict]:
    """``module``'s own parameter, buffer and submodule dicts (the objects, not copies).

    What ``nn.Module`` registers lives in these three; comparing their entries by identity is
    how a change after ``wrap`` is seen without walking names. Checked: 2.11, 2.13, 2.15.

    Example:
        >>> params, buffers, modules = module_dicts(torch.nn.Linear(1, 1))
        >>> sorted(params), buffers, modules
        (['bias', 'weight'], {}, {})

    A TorchScript module (``torch.jit.script``) keeps its entries in C++ behind wrappers that
    are not dicts: it gets dicts of what it holds now, whose writes go through to the module
    (it cannot gain entries after scripting; one reassigned later is not in the dicts).

        >>> scripted = torch.jit.script(torch.nn.Linear(1, 1))
        >>> params, _, _ = module_dicts(scripted)
        >>> sorted(params), type(params).__name__
        (['bias', 'weight'], '_ScriptEntries')
    """
    dicts = module._parameters, module._buffers, module._modules
    if isinstance(module, torch.jit.ScriptModule):
        return tuple(map(_ScriptEntries, dicts))  # type: ignore[return-value]
    return dicts  # type: ignore[return-value]


class _ScriptEntries(dict):
    """A TorchScript module's parameters, buffers or submodules as they are now; an entry
    written here is written to the module too."""

    def __init__(self, entries: Any) -> None:
        super().__init__(entries.items())
        self._entries = entries

    def __setitem__(self, name: str, value: Any) -> None:
        self._entries[name] = value
        super().__setitem__(name, value)


@contextlib.contextmanager
def untraced_reasons() -> Iterator[list[str]]:
    """Within it, TorchDynamo's reasons for code it gave up on without a graph break to show for
    it (it skipped the frame, which runs eagerly: a TorchScript module called, ...); the list it
    yields gets each new reason at exit. TorchDynamo counts them under ``counters["unimplemented"]``
    (a break it handles moves to ``"graph_break"``). Checked: 2.13, 2.15.

    Example:
        >>> with untraced_reasons() as reasons:
        ...     pass
        >>> reasons
        []
    """
    from torch._dynamo.utils import counters

    before = dict(counters["unimplemented"])
    found: list[str] = []
    try:
        yield found
    finally:
        found.extend(k for k, n in counters["unimplemented"].items() if n > before.get(k, 0))


def drop_buffer(module: torch.nn.Module, name: str) -> None:
    """Unregister buffer ``name`` of ``module`` (persistent or not), as if never registered.

    Example:
        >>> m = torch.nn.Module(); m.register_buffer("x", torch.zeros(1), persistent=False)
        >>> drop_buffer(m, "x"); "x" in dict(m.named_buffers())
        False
    """
    module._buffers.pop(name, None)
    module._non_persistent_buffers_set.discard(name)


def hook_dicts(module: torch.nn.Module) -> list[dict]:
    """The dicts that hold ``module``'s forward, forward-pre, backward and backward-pre hooks.

    TorchDynamo does not guard on module hooks (``skip_nnmodule_hook_guards``): a hook added
    after a graph was compiled is not in it, and nothing recompiles. Their sizes tell that a
    hook came or went. (A parameter's own hooks, ``register_hook`` and post-accumulate ones,
    run in the autograd engine, outside the graphs: they need nothing.) Checked: 2.13.

    Example:
        >>> lin = torch.nn.Linear(1, 1)
        >>> _ = lin.register_forward_hook(lambda *a: None)
        >>> [len(d) for d in hook_dicts(lin)]
        [1, 0, 0, 0]
    """
    return [
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
    ]


def inside_dynamo() -> bool:
    """Whether this code runs under a TorchDynamo frame callback: inside a ``torch.compile``'d
    function (its parts between graph breaks run with the callback set, and TorchDynamo tries
    to compile every frame they call, gradient hooks included). Outside: ``None`` or ``False``.
    Checked: 2.13, 2.15 (``torch._C._dynamo.eval_frame.get_eval_frame_callback``).

    Example:
        >>> inside_dynamo()
        False
    """
    return _eval_frame_callback() not in (None, False)


def numpy_random_from_torch() -> bool:
    """Whether TorchDynamo traces ``np.random`` calls into its graphs with torch's generator
    (``use_numpy_random_stream=False``, the default): compiled, a forward that draws from
    NumPy's global generator draws other numbers than eagerly. Checked: 2.13, 2.15
    (``torch._dynamo.config.use_numpy_random_stream``).

    Example:
        >>> numpy_random_from_torch()
        True
    """
    return not torch._dynamo.config.use_numpy_random_stream
