"""Split a captured graph at segment boundaries and compile each piece.

Each piece is compiled on its own by the inner backend, so under AOTAutograd it becomes
its own autograd node and its backward finishes before the previous piece's starts:
that is what lets a bucket's all-reduce begin early.
"""

from __future__ import annotations

import functools
import logging
import unittest.mock
from collections.abc import Callable, Sequence

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from .. import _torch_compat as compat
from ..capture.graph import CapturedGraph
from ..planning.plan import Plan
from .reuse import backward_order, piece_key

__all__ = ["inner_compiler", "split_and_compile"]

log = logging.getLogger(__name__)

CompilerFn = Callable[[fx.GraphModule, list], Callable]


def inner_compiler(backend: str, *, mode: str | None, cudagraphs: bool, dynamic: bool | None) -> CompilerFn:
    """Return the TorchDynamo compiler function that compiles one segment.

    Example:
        >>> fn = inner_compiler("aot_eager", mode=None, cudagraphs=False, dynamic=None)
        >>> callable(fn)
        True
    """
    if backend != "inductor":
        return compat.lookup_backend(backend)
    return compat.inductor_compiler(mode=mode, dynamic=dynamic, cudagraphs=cudagraphs)


def _propagate_metadata(gm: fx.GraphModule, split_gm: fx.GraphModule) -> None:
    # AOTAutograd and Inductor read Dynamo's graph metadata and each placeholder's
    # source (for parameter detection and guards) from the module they compile.
    for name in compat.piece_names(split_gm):
        compat.copy_dynamo_metadata(gm, getattr(split_gm, name))


def _may_change_layout(piece: fx.GraphModule) -> bool:
    # Under Inductor every output of a piece keeps its eager strides unless layout
    # optimization is on, which Inductor only turns on for graphs with convolutions
    # (GraphLowering.decide_layout_opt). Matched by name so that every convolution
    # spelling (torch.conv2d, F.conv_transpose1d, aten.convolution, ...) counts.
    for node in piece.graph.nodes:
        target = piece.get_submodule(node.target) if node.op == "call_module" else node.target
        name = getattr(target, "__name__", type(target).__name__) if node.op != "call_method" else target
        if node.op != "placeholder" and node.op != "output" and "conv" in str(name).lower():
            return True
    return not compat.inductor_keeps_output_strides()


@functools.cache
def _piece_compiler_class() -> type:
    class PieceCompiler(compat.piece_compiler_base()):
        """PyTorch's DDPOptimizer interpreter, with AOTAutograd's cache left usable and repeats reused.

        DDPOptimizer compiles every piece with ``fakify_first_call`` so that the strides
        Inductor chose for a piece's outputs reach the next piece's compile; AOTAutograd
        refuses to cache such graphs, so a warm restart re-ran AOTAutograd for every piece
        (measured: 4-7 s of a warm first step). A piece without convolutions keeps eager
        strides on its outputs under Inductor, so for those (when ``cacheable``) the next
        piece's inputs come from running the uncompiled piece on fake tensors, and the
        compile is cacheable. On that path a piece interchangeable with one compiled
        before (``reuse.piece_key``: a repeated block) takes that compiled function
        instead of being compiled again.
        """

        cacheable = False

        def setup(self) -> None:
            self.by_key: dict[str, torch.nn.Module] = {}
            self.reused = 0
            self.position = 0
            # Per metadata entry: (key or None, position, piece needs a backward).
            self.entries: list[tuple[str | None, int, bool]] = []
            self.last_use: dict[str, int] = {}

        def run_node(self, n: fx.Node) -> object:
            if n.op != "call_module":
                return super().run_node(n)
            self.position += 1
            before = compat.piece_metadata_count()
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            real_mod = self.fetch_attr(str(n.target))
            key = None
            if not self.cacheable or _may_change_layout(real_mod):
                out = super().run_node(n)
            else:
                key = piece_key(real_mod, args)
                out = self._run_cacheable(n, real_mod, args, kwargs, key)
            if key is not None:
                self.last_use[key] = self.position
            needs_backward = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            for _ in range(compat.piece_metadata_count() - before):
                self.entries.append((key, self.position, needs_backward))
            return out

        def _run_cacheable(
            self, n: fx.Node, real_mod: fx.GraphModule, args: tuple, kwargs: dict, key: str | None
        ) -> object:
            fake_args = [compat.to_fake(a, self.fake_mode) for a in args]
            fake_mod = compat.fake_module(real_mod, self.fake_mode)
            compiled = self.by_key.get(key) if key is not None else None
            if compiled is not None:
                self.reused += 1
            else:
                counts = compat.aot_autograd_counts()
                compiled = self.compile_submod(real_mod, fake_args, kwargs)
                after = compat.aot_autograd_counts()
                if counts[0] != after[0] and counts[1] == after[1]:
                    # A piece loaded from AOTAutograd's cache brings its compiled backward
                    # along and takes no metadata entry; a compiled one does.
                    compat.record_piece_metadata()
                if key is not None:
                    self.by_key[key] = compiled
            self.module.delete_submodule(n.target)
            n.target = "compiled_" + n.target
            self.module.add_submodule(n.target, compiled)
            with self.fake_mode, unittest.mock.patch.object(self.fake_mode, "allow_non_fake_inputs", True):
                out = fake_mod(*fake_args, **kwargs)
            if log.isEnabledFor(logging.DEBUG):
                strides = [
                    (tuple(t.shape), t.stride())
                    for t in compat.tree_leaves(out)
                    if isinstance(t, torch.Tensor)
                ]
                log.debug("%s outputs (shape, stride): %s", n.target, strides)
            return out

        def order_metadata(self) -> None:
            """Order the metadata as the lazy backward compiles will consume it (``backward_order``)."""
            compat.reorder_piece_metadata(backward_order(self.entries, self.last_use))

    return PieceCompiler


def split_and_compile(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    *,
    captured: CapturedGraph,
    plan: Plan,
    compiler: CompilerFn,
    cacheable: bool = False,
) -> tuple[Callable, int]:
    """Compile ``gm`` as ``len(plan.pieces)`` separately compiled pieces.

    Returns a callable with the calling convention TorchDynamo expects from a backend,
    and how many pieces reused a compiled sibling instead of being compiled.
    ``cacheable`` says ``compiler`` is Inductor, whose pieces keep eager output strides
    unless they contain a convolution; those pieces are compiled so that AOTAutograd's
    cache can serve a warm restart, and a piece interchangeable with an earlier one (a
    repeated block, Note [Repeated blocks]) reuses its compiled function.

    Example:
        >>> # used by distcompile's TorchDynamo backend; see distcompile.wrap
    """
    pieces = plan.pieces or plan.segments
    if len(pieces) == 1:
        return compiler(gm, list(example_inputs)), 0
    piece_of = {}
    for k, (start, stop) in enumerate(pieces):
        piece_of.update((captured.body[i], k) for i in range(start, stop))
    split_gm = split_module(gm, None, lambda node: piece_of.get(node, 0), keep_original_order=True)
    _propagate_metadata(gm, split_gm)
    fake_mode = compat.fake_mode_of(list(example_inputs))
    # Compiling the pieces is the same job PyTorch's DDPOptimizer does after choosing
    # its own splits: run the split module under fake tensors, compile each piece with
    # the inputs it sees, and keep AOTAutograd's per-piece metadata in the tracing
    # context (needed by Inductor's lazily compiled backward). We reuse that
    # interpreter rather than re-implement those internals; the splits are ours, and
    # so are the cacheable path and the reuse of repeated pieces.
    with compat.saved_tensors_hooks_disabled():
        interpreter = _piece_compiler_class()(split_gm, compiler, fake_mode)
        interpreter.setup()
        interpreter.cacheable = cacheable
        interpreter.run(*example_inputs)
        interpreter.order_metadata()
    split_gm.recompile()
    log.debug("split graph:\n%s", split_gm.graph)
    return split_gm, interpreter.reused
