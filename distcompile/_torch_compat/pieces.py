"""Compiling split pieces the way DDPOptimizer does: names, metadata, fake tensors, AOTAutograd."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

from .version import unsupported

__all__ = [
    "aot_autograd_counts",
    "aot_cacheable",
    "backward_compiled_eagerly",
    "compile_caches_enabled",
    "copy_dynamo_metadata",
    "eager_backward",
    "fake_mode_of",
    "fake_module",
    "is_fake",
    "piece_compiler_base",
    "piece_names",
    "python_dispatcher",
    "real_inputs_allowed",
    "record_piece_metadata",
    "piece_metadata_count",
    "reorder_piece_metadata",
    "saved_tensors_hooks_active",
    "saved_tensors_hooks_disabled",
    "to_fake",
]


# -- compiling split pieces the way DDPOptimizer does ---------------------------------------
def piece_names(split_gm: fx.GraphModule) -> list[str]:
    """Names of the pieces ``split_module`` made, in partition order.

    ``split_module`` records them in ``meta["partition_names"]`` from torch 2.13 on (as a
    set: its order follows string hashing, so it is sorted here); older releases do not,
    and their pieces are the ``submod_<partition>`` children. Checked: 2.11 (children),
    2.13, 2.15 (meta).

    Example:
        >>> from torch.fx.passes.split_module import split_module
        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
        >>> parts = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        >>> piece_names(split_module(gm, None, lambda n: parts[n.name]))
        ['submod_1', 'submod_2']
    """
    names = split_gm.meta.get("partition_names")
    if names is None:
        names = [n for n, _ in split_gm.named_children() if n.startswith("submod_")]
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]))


def copy_dynamo_metadata(gm: fx.GraphModule, piece: fx.GraphModule) -> None:
    """Give ``piece`` (split from ``gm``) the TorchDynamo metadata AOTAutograd and Inductor read.

    That is the graph's ``meta``, its parameter-name-to-source map and each placeholder's
    source (for parameter detection and guards). Checked: 2.11, 2.13, 2.15.

    Example:
        >>> # copy_dynamo_metadata(dynamo_gm, split_gm.submod_0)
    """
    sources = {n.name: getattr(n, "_dynamo_source", None) for n in gm.graph.find_nodes(op="placeholder")}
    piece.meta = gm.meta
    if hasattr(gm, "_param_name_to_source"):
        piece._param_name_to_source = gm._param_name_to_source
    for node in piece.graph.find_nodes(op="placeholder"):
        node._dynamo_source = sources.get(node.name)


def piece_compiler_base() -> type:
    """PyTorch's DDPOptimizer interpreter (``SubmodCompiler``): compiles each piece of a split graph.

    Its constructor is ``(split_gm, compiler, fake_mode)``; ``run_node``,
    ``compile_submod(module, args, kwargs)`` and ``fake_mode`` are used.
    Checked: 2.11, 2.13, 2.15.

    Example:
        >>> piece_compiler_base().__name__
        'SubmodCompiler'
    """
    try:
        from torch._dynamo.backends.distributed import SubmodCompiler
    except ImportError as exc:
        raise unsupported("DDPOptimizer's SubmodCompiler", exc) from exc
    return SubmodCompiler


@contextlib.contextmanager
def real_inputs_allowed(fake_mode: Any) -> Iterator[None]:
    """Within: ``fake_mode`` lets real tensors (a piece's parameters) meet fake ones, as
    DDPOptimizer runs its pieces on fake inputs. Restored on exit. Checked: 2.11-2.15
    (``FakeTensorMode.allow_non_fake_inputs``).

    Example:
        >>> mode = fake_mode_of([])
        >>> with real_inputs_allowed(mode):
        ...     mode.allow_non_fake_inputs
        True
    """
    before = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        fake_mode.allow_non_fake_inputs = before


def fake_mode_of(example_inputs: list) -> Any:
    """The fake-tensor mode TorchDynamo traced ``example_inputs`` under (a new one if none).

    Checked: 2.11, 2.13, 2.15.

    Example:
        >>> type(fake_mode_of([torch.zeros(1)])).__name__
        'FakeTensorMode'
    """
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)


def to_fake(value: object, fake_mode: Any) -> object:
    """``value`` as a fake tensor of ``fake_mode`` (non-tensors and fakes unchanged). Checked: 2.11-2.15.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> type(to_fake(torch.zeros(1), FakeTensorMode())).__name__
        'FakeTensor'
    """
    from torch._dynamo.utils import to_fake_tensor
    from torch._subclasses import FakeTensor

    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        return to_fake_tensor(value, fake_mode)
    return value


def python_dispatcher() -> contextlib.AbstractContextManager:
    """The context TorchDynamo runs fake tensors under: composite ops decompose in Python.

    Without it, a composite op such as ``F.linear`` on a 3-d input reads the sizes of a
    fake tensor with symbolic shapes as ints in C++ on torch 2.11, which fixes a dynamic
    dimension to the value at hand (every new length then recompiled). Checked: 2.11,
    2.13, 2.15 (``torch._dispatch.python.enable_python_dispatcher``).

    Example:
        >>> with python_dispatcher():
        ...     pass
    """
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()


def is_fake(value: object) -> bool:
    """Whether ``value`` is a fake tensor (an activation while compiling). Checked: 2.11-2.15.

    Example:
        >>> is_fake(torch.zeros(1))
        False
    """
    from torch._subclasses import FakeTensor

    return isinstance(value, FakeTensor)


def fake_module(module: torch.nn.Module, fake_mode: Any) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers are fake tensors. Checked: 2.11-2.15.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> type(fake_module(torch.nn.Linear(1, 1), FakeTensorMode()).weight).__name__
        'FakeTensor'
    """
    from torch._dynamo.utils import deepcopy_to_fake_tensor

    return deepcopy_to_fake_tensor(module, fake_mode)


def aot_autograd_counts() -> tuple[int, int]:
    """(AOTAutograd compiles, AOTAutograd cache hits) so far in this process. Checked: 2.11-2.15.

    Example:
        >>> len(aot_autograd_counts())
        2
    """
    from torch._dynamo.utils import counters

    aot = counters["aot_autograd"]
    return aot["total"], aot["autograd_cache_hit"]


def record_piece_metadata() -> None:
    """Append the piece just compiled to DDPOptimizer's per-piece AOTAutograd metadata.

    Inductor compiles a piece's backward lazily, in reverse piece order, and reads that
    piece's metadata from this list (see ``SubmodCompiler.run_node``); a piece compiled
    outside ``SubmodCompiler.run_node`` must add its entry itself. Checked: 2.11-2.15.

    Example:
        >>> record_piece_metadata()  # outside a compile: nothing to record
    """
    tracing = torch._guards.TracingContext.try_get()
    if tracing is None:
        return
    ctx = getattr(tracing, "ddp_optimizer_ctx", None)
    if ctx is None:
        raise unsupported("the tracing context's ddp_optimizer_ctx", AttributeError("ddp_optimizer_ctx"))
    ctx.curr_bucket += 1
    ctx.metadata_per_bucket.append(tracing.fw_metadata)


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensors hooks are in effect now (``torch.autograd.graph.saved_tensors_hooks``,
    ``save_on_cpu``). Checked: 2.13, 2.15.

    Example:
        >>> with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        ...     saved_tensors_hooks_active()
        True
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def saved_tensors_hooks_disabled() -> contextlib.AbstractContextManager:
    """The context TorchDynamo compiles under: saved-tensors hooks off. Checked: 2.11-2.15.

    Example:
        >>> with saved_tensors_hooks_disabled():
        ...     pass
    """
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing

    return _disable_saved_tensors_hooks_during_tracing()


def _ddp_ctx() -> Any:
    tracing = torch._guards.TracingContext.try_get()
    return None if tracing is None else getattr(tracing, "ddp_optimizer_ctx", None)


def piece_metadata_count() -> int:
    """How many pieces' AOTAutograd metadata the open compile holds (0 outside one). Checked: 2.13.

    Example:
        >>> piece_metadata_count()
        0
    """
    ctx = _ddp_ctx()
    return 0 if ctx is None else len(ctx.metadata_per_bucket)


def reorder_piece_metadata(order: list[int]) -> None:
    """Put the per-piece AOTAutograd metadata in the order the lazy backward compiles will pop it.

    Inductor compiles each piece's backward at its first backward call and takes the
    metadata from the end of the list (``_prepare_lazy_backward_context``), so the list
    must run in ascending order of each compiled function's *last* forward use; ``order``
    lists the current indices in the wanted order. Checked: 2.13 (the list is the one
    ``record_piece_metadata`` appends to).

    Example:
        >>> reorder_piece_metadata([])  # outside a compile: nothing to reorder
    """
    ctx = _ddp_ctx()
    if ctx is None or not order:
        return
    if sorted(order) != list(range(len(ctx.metadata_per_bucket))):
        raise ValueError(f"order {order} is not a permutation of {len(ctx.metadata_per_bucket)} entries")
    ctx.metadata_per_bucket[:] = [ctx.metadata_per_bucket[i] for i in order]


def eager_backward() -> contextlib.AbstractContextManager:
    """A context in which AOTAutograd compiles a piece's backward with its forward.

    Normally the backward is compiled at its first run, and AOTAutograd's cache entry is
    written only then; compiled at once, the entry is whole when the compile returns, so
    another process can load both. Compiled at its first run, a backward that retains its
    graph (``retain_graph=True``, ``autograd.grad`` of two losses) is compiled without
    donated buffers (its results in memory of their own, not in saved activations it would
    read again); compiled at once, it cannot know, so it is compiled without them too: a
    shared compile trains every step that ``torch.compile`` trains. The cost: such backwards
    do not reuse freed activations for their results (a little more peak memory in
    backward); Inductor's cache key includes the donation (``_keyed_on_donated_buffers``).
    Checked: 2.13, 2.15 (``torch._functorch.config.force_non_lazy_backward_lowering``,
    ``donated_buffer``).

    Example:
        >>> with eager_backward():
        ...     pass
    """
    from torch._functorch import config

    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True, donated_buffer=False)


def compile_caches_enabled() -> bool:
    """Whether compiles go through Inductor's FX-graph cache and AOTAutograd's cache. Checked: 2.11-2.15.

    Example:
        >>> isinstance(compile_caches_enabled(), bool)
        True
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    return bool(
        config.fx_graph_cache
        and not config.force_disable_caches
        and getattr(functorch_config, "enable_autograd_cache", False)
    )


def backward_compiled_eagerly() -> bool:
    """Whether AOTAutograd compiles backwards with their forwards now (``eager_backward``).

    Checked: 2.13, 2.15.

    Example:
        >>> backward_compiled_eagerly()
        False
    """
    from torch._functorch import config

    return bool(getattr(config, "force_non_lazy_backward_lowering", False))


def aot_cacheable(piece: fx.GraphModule) -> bool:
    """Whether AOTAutograd's cache would take ``piece`` (its per-operation check only).

    A call of an unknown Python function (``allow_in_graph``, a plain wrapped helper)
    makes AOTAutograd bypass its cache. Checked: 2.13, 2.15
    (``torch._functorch._aot_autograd.autograd_cache.check_cacheable``).

    Example:
        >>> aot_cacheable(fx.symbolic_trace(torch.nn.ReLU()))
        True
    """
    try:
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable
    except ImportError:
        return True  # the compile itself tells; a shared piece is then compiled again
    try:
        check_cacheable(piece)
    except BypassAOTAutogradCache:
        return False
    return True
