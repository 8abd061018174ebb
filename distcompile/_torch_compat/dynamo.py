"""TorchDynamo and Inductor: compiling a module, backends, configuration, counters."""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from .version import unsupported

__all__ = [
    "autocast_change",
    "backend_failure_cause",
    "compile_cache_hits",
    "compile_module",
    "compiled_autograd",
    "compiled_original",
    "dynamo_control_flow",
    "is_region_capture_break",
    "dynamo_fallback_cause",
    "graph_break_parts",
    "inductor_cache_dir",
    "inductor_compiler",
    "inductor_fallback_random",
    "inductor_keeps_output_strides",
    "inductor_modes",
    "is_compiled_module",
    "lookup_backend",
    "set_optimize_ddp",
]


# -- TorchDynamo: compiling, backends, counters --------------------------------------------
def compile_module(
    module: torch.nn.Module,
    *,
    backend: Callable,
    fullgraph: bool,
    dynamic: bool | None,
    on_guard_failure: Callable[[str], None],
) -> torch.nn.Module:
    """``torch.compile(module, backend=...)`` that also reports every failed guard of a recompile.

    ``on_guard_failure`` receives each cache entry's guard failure (``"0/1: ..."``) when
    TorchDynamo looks for a reason to recompile, in TorchDynamo's order; entries compiled
    by other ``compile_module`` calls report to their own callback. ``torch.compile`` has
    no such hook; ``torch._dynamo.optimize(guard_fail_fn=...)`` is what it is built on.
    Checked: 2.11, 2.13, 2.15.

    Example:
        >>> m = compile_module(torch.nn.Linear(2, 2), backend="eager", fullgraph=False,
        ...                    dynamic=None, on_guard_failure=print)
        >>> type(m).__name__
        'OptimizedModule'
    """
    import torch._dynamo

    # TorchDynamo keeps guard_fail_fn in each guard manager, which weakref finalizers on the
    # guarded objects (the module among them) hold in a process-wide registry: a strong
    # reference to the callback's owner from there keeps the module alive forever.
    callback: Callable[[], Callable[[str], None] | None] = (
        weakref.WeakMethod(on_guard_failure)
        if inspect.ismethod(on_guard_failure)
        else lambda: on_guard_failure
    )

    def guard_failed(failure: Any) -> None:
        report = callback()
        if report is not None:
            report(str(getattr(failure, "reason", failure)))

    try:
        ctx = torch._dynamo.optimize(backend, nopython=fullgraph, dynamic=dynamic, guard_fail_fn=guard_failed)
    except TypeError as exc:
        raise unsupported("torch._dynamo.optimize(guard_fail_fn=...)", exc) from exc
    return ctx(module)


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is already the result of ``torch.compile``. Checked: 2.11, 2.13, 2.15.

    Example:
        >>> is_compiled_module(torch.nn.Linear(1, 1))
        False
    """
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def compiled_original(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` was given, for its result ``module``. Checked: 2.13, 2.15 (``_orig_mod``).

    Example:
        >>> net = torch.nn.Linear(1, 1)
        >>> compiled_original(torch.compile(net)) is net
        True
    """
    return module._orig_mod


def lookup_backend(name: str) -> Callable:
    """The registered TorchDynamo backend called ``name`` (``eager``, ``aot_eager``). Checked: 2.11-2.15.

    Example:
        >>> callable(lookup_backend("aot_eager"))
        True
    """
    from torch._dynamo import lookup_backend as lookup

    return lookup(name)


def inductor_compiler(
    *,
    mode: str | None,
    dynamic: bool | None,
    cudagraphs: bool,
    fallback_random: bool = False,
    on_backward_error: Callable[[Exception], Exception] | None = None,
) -> Callable:
    """Inductor's compile function with ``mode``'s options, CUDA graphs and random numbers as asked.

    ``config_patches`` also apply to the backward, compiled lazily (``compile_fx`` wraps its
    inner compile with them); ``on_backward_error`` turns a failure to compile a backward
    into the exception it returns. Checked: 2.11, 2.13, 2.15 (``list_mode_options``,
    ``compile_fx(inner_compile=, config_patches=)``, ``fallback_random``); the backward's
    patches and ``is_backward``: 2.13.

    Example:
        >>> callable(inductor_compiler(mode=None, dynamic=None, cudagraphs=False))
        True
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        # A backward is compiled lazily, inside the user's backward(): a failure there would
        # reach the user with no frame of ours. ``is_backward``: Inductor's own flag.
        try:
            if kwargs.get("is_backward"):
                _say_no_donation()
                with _keyed_on_donated_buffers():
                    return compile_fx_inner(gm, example_inputs, **kwargs)
            return compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as exc:
            if on_backward_error is None or not kwargs.get("is_backward"):
                raise
            raise on_backward_error(exc) from exc

    patches = dict(list_mode_options(mode, dynamic)) if mode else {}
    # The mode presets may switch CUDA graphs on (reduce-overhead); our option decides.
    patches["triton.cudagraphs"] = cudagraphs
    if fallback_random:
        patches["fallback_random"] = True
    return functools.partial(compile_fx, inner_compile=inner_compile, config_patches=patches)


def _say_no_donation() -> None:
    """A backward compiled without donated buffers (``donated_buffer`` off while it compiles:
    ``pieces.eager_backward``) records an empty list of them, as one compiled lazily for a
    retained graph does. Left ``None``, torch's check at run time reads it as donating and
    refuses ``retain_graph=True`` (torch 2.13 ``_backward_impl``: ``bw_donated_idxs != []``),
    and so does a process that loads it from the cache. Checked: 2.13."""
    from torch._functorch import config
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if not config.donated_buffer and meta is not None and getattr(meta, "bw_donated_idxs", []) is None:
        meta.bw_donated_idxs = []


def _keyed_on_donated_buffers() -> contextlib.AbstractContextManager:
    """A context in which Inductor's FX-graph cache key includes the backward's donated buffers.

    Inductor compiles a backward that may reuse its donated inputs' memory (AOTAutograd's
    ``donated_buffer``, read from the tracing context), but its cache key leaves the
    donation out: a backward cached with donated buffers was loaded for a compile without
    them (``donated_buffer = False``, for ``backward(retain_graph=True)``), and the second
    backward's gradients came out wrong (torch 2.13, plain ``torch.compile`` too: max
    |g2 - 2 g1| 0.0076 on a 7-layer MLP, 0 with an empty cache). A custom post-grad pass that
    does nothing and whose ``uuid`` names the donated inputs puts them in the key. Checked:
    2.13 (``post_grad_custom_post_pass``, ``CustomGraphPass``, ``utils.get_donated_idxs``).
    """
    try:
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomGraphPass
        from torch._inductor.utils import get_donated_idxs
    except ImportError:
        return contextlib.nullcontext()
    donated = tuple(get_donated_idxs() or ())
    user = config.post_grad_custom_post_pass
    if user is not None and not isinstance(user, CustomGraphPass):
        return contextlib.nullcontext()  # a pass Inductor cannot key bypasses its cache anyway

    class DonationKey(CustomGraphPass):  # type: ignore[misc]
        def __call__(self, graph: Any) -> None:
            if user is not None:
                user(graph)

        def uuid(self) -> Any:
            return ("distcompile-donated-buffers", donated, user.uuid() if user is not None else None)

    return config.patch(post_grad_custom_post_pass=DonationKey())


def inductor_modes() -> frozenset[str]:
    """The ``mode`` presets Inductor knows in this torch release.

    Checked: 2.13, 2.15 (``torch._inductor.list_mode_options()``: default, lite, reduce-overhead,
    max-autotune, max-autotune-no-cudagraphs).

    Example:
        >>> "max-autotune-no-cudagraphs" in inductor_modes()
        True
    """
    from torch._inductor import list_mode_options

    return frozenset(list_mode_options())


def inductor_fallback_random() -> contextlib.AbstractContextManager:
    """A context in which Inductor compiles random ops with eager's generator (same draws).

    Checked: 2.11, 2.13, 2.15 (``torch._inductor.config.fallback_random``).

    Example:
        >>> with inductor_fallback_random():
        ...     pass
    """
    from torch._inductor import config

    return config.patch(fallback_random=True)


def inductor_keeps_output_strides() -> bool:
    """Inductor's ``keep_output_stride`` setting (outputs keep eager strides). Checked: 2.11-2.15.

    Example:
        >>> inductor_keeps_output_strides()
        True
    """
    from torch._inductor import config

    return bool(getattr(config, "keep_output_stride", True))


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache directory. Checked: 2.11, 2.13, 2.15.

    Example:
        >>> isinstance(inductor_cache_dir(), str)
        True
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def compile_cache_hits() -> int:
    """FX-graph plus AOTAutograd cache hits so far in this process. Checked: 2.11-2.15.

    Example:
        >>> compile_cache_hits() >= 0
        True
    """
    from torch._dynamo.utils import counters

    return counters["inductor"].get("fxgraph_cache_hit", 0) + counters["aot_autograd"].get(
        "autograd_cache_hit", 0
    )


def backend_failure_cause(exc: BaseException) -> BaseException | None:
    """The exception a backend raised, if ``exc`` is TorchDynamo's wrapper around it.

    Checked: 2.11, 2.13, 2.15 (``BackendCompilerFailed.inner_exception``).

    Example:
        >>> backend_failure_cause(ValueError("x")) is None
        True
    """
    from torch._dynamo.exc import BackendCompilerFailed

    if isinstance(exc, BackendCompilerFailed):
        return getattr(exc, "inner_exception", None) or exc.__cause__
    return None


def is_region_capture_break(exc: BaseException) -> bool:
    """Whether ``exc`` is TorchDynamo refusing to capture a higher-order op's body whole (a
    graph break inside a region or a checkpointed function: ``UncapturedHigherOrderOpError``).

    Checked: 2.13, 2.15 (``torch._dynamo.exc.UncapturedHigherOrderOpError``).

    Example:
        >>> is_region_capture_break(ValueError("x"))
        False
    """
    from torch._dynamo import exc as dynamo_exc

    kind = getattr(dynamo_exc, "UncapturedHigherOrderOpError", None)
    return kind is not None and isinstance(exc, kind)


def dynamo_control_flow() -> tuple[type[BaseException], ...]:
    """Exception types TorchDynamo raises to steer its own tracing (restart, skip the frame).

    They reach a backend while it compiles (AOTAutograd's scalar-tensorifying pass raises
    ``TensorifyScalarRestartAnalysis`` under ``dynamic=True``) and must go back to TorchDynamo
    untouched: it catches them, retraces and calls the backend again.

    Checked: 2.13, 2.15 (``torch._dynamo.exc.RestartAnalysis``, ``SkipFrame``; both date from torch 2.0).

    Example:
        >>> any(issubclass(ValueError, t) for t in dynamo_control_flow())
        False
    """
    from torch._dynamo.exc import RestartAnalysis, SkipFrame

    return (RestartAnalysis, SkipFrame)


def dynamo_fallback_cause(exc: BaseException) -> BaseException | None:
    """The exception in ``exc``'s chain on which TorchDynamo breaks the graph instead of failing.

    When a backend raises one of these (fake tensors met a data-dependent size with
    ``capture_dynamic_output_shape_ops`` off, as AOTAutograd does tracing the backward of
    ``out[mask] = v``, whose gradient reads ``grad[mask]``), TorchDynamo adds a graph break
    there and runs that code eagerly: how ``torch.compile`` trains such a model. Raised
    wrapped, it fails instead. Checked: 2.13 (``exc.exceptions_allowed_to_be_fallback``).

    Example:
        >>> dynamo_fallback_cause(ValueError("x")) is None
        True
    """
    from torch._dynamo import exc as dynamo_exc

    kinds = getattr(dynamo_exc, "exceptions_allowed_to_be_fallback", ())
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, kinds):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def autocast_change(node: fx.Node) -> tuple | None:
    """What a captured ``with torch.autocast(...)`` does at ``node``: its enter node gives the
    arguments of :class:`torch.autocast` it entered (device type, dtype, enabled, cache);
    its exit node ``()``; any other node ``None``. Checked: 2.13, 2.15 (TorchDynamo records
    the block as calls of ``torch.amp.autocast_mode._enter_autocast(*args)`` and
    ``_exit_autocast(mode)``).

    Example:
        >>> g = fx.Graph(); x = g.placeholder("x")
        >>> autocast_change(g.call_function(torch.relu, (x,))) is None
        True
    """
    if node.op != "call_function":
        return None
    amp = torch.amp.autocast_mode
    if node.target is getattr(amp, "_enter_autocast", None):
        return tuple(node.args)
    if node.target is getattr(amp, "_exit_autocast", None):
        return ()
    return None


def graph_break_parts(gm: fx.GraphModule) -> tuple[str, list] | None:
    """TorchDynamo's (reason, user stack) for a graph that ended at a graph break, else ``None``.

    Checked: 2.11, 2.13, 2.15 (``GraphModule.compile_subgraph_reason``).

    Example:
        >>> graph_break_parts(fx.symbolic_trace(torch.nn.Linear(1, 1))) is None
        True
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    return str(reason.reason), list(getattr(reason, "user_stack", None) or [])


@contextlib.contextmanager
def set_optimize_ddp(mode: bool | str) -> Iterator[None]:
    """Set ``torch._dynamo.config.optimize_ddp`` (PyTorch's DDPOptimizer switch) within the block.

    Only the benchmark uses it, to build PyTorch's own variants. Checked: 2.11-2.15.

    Example:
        >>> with set_optimize_ddp(True):
        ...     pass
    """
    import torch._dynamo

    with torch._dynamo.config.patch(optimize_ddp=mode):
        yield


def compiled_autograd() -> contextlib.AbstractContextManager:
    """A context that runs backward through compiled autograd. Checked: 2.11-2.15.

    Example:
        >>> ctx = compiled_autograd()
    """
    import torch._dynamo

    return torch._dynamo.config.patch(compiled_autograd=True)
