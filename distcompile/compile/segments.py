"""Split a captured graph at segment boundaries and compile each piece.

Each piece is compiled on its own by the inner backend, so under AOTAutograd it becomes
its own autograd node and its backward finishes before the previous piece's starts:
that is what lets a bucket's all-reduce begin early.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from .. import _torch_compat as compat
from ..capture.graph import CapturedGraph
from ..planning.plan import Plan
from .cpu_checks import run_cpu_checks, runs_on_cpu
from .jobs import CompileJob, SharedCompiles
from .reuse import backward_order, piece_key

__all__ = ["inner_compiler", "split_and_compile"]

log = logging.getLogger(__name__)

CompilerFn = Callable[[fx.GraphModule, list], Callable]


def inner_compiler(
    backend: str,
    *,
    mode: str | None,
    cudagraphs: bool,
    dynamic: bool | None,
    fallback_random: bool = False,
    on_backward_error: Callable[[Exception], Exception] | None = None,
) -> CompilerFn:
    """Return the TorchDynamo compiler function that compiles one segment.

    ``fallback_random``: Inductor draws random numbers from torch's generator, as eager does.
    ``on_backward_error``: what a failure to compile a backward (lazily, in ``backward()``) becomes.

    Example:
        >>> fn = inner_compiler("aot_eager", mode=None, cudagraphs=False, dynamic=None)
        >>> callable(fn)
        True
    """
    if backend != "inductor":
        return compat.lookup_backend(backend)
    return compat.inductor_compiler(
        mode=mode,
        dynamic=dynamic,
        cudagraphs=cudagraphs,
        fallback_random=fallback_random,
        on_backward_error=on_backward_error,
    )


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


def _strides(out: object) -> list[tuple]:
    return [(tuple(t.shape), t.stride()) for t in compat.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _fresh_outputs_allowed(out: object, inputs: Sequence[object]) -> bool:
    """Whether new tensors shaped like ``out`` stand for a sibling piece's outputs.

    Yes when every output is a tensor with a storage of its own, shared with no input and
    no other output (a view would have to alias its sibling's input instead).
    """
    leaves = compat.tree_leaves(out)
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        return False
    ref = torch.multiprocessing.reductions.StorageWeakRef
    taken = {ref(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor)}
    for t in leaves:
        storage = ref(t.untyped_storage())
        if storage in taken:
            return False
        taken.add(storage)
    return True


def _fresh_outputs(template: object, fake_mode: object) -> object | None:
    """New fake tensors with ``template``'s shapes, strides, dtypes and ``requires_grad``.

    Running a repeated block's piece again on fake tensors would give the same metadata
    (its inputs match its first sibling's: ``reuse.piece_key``) at the cost of tracing
    it; at depth, and with symbolic shapes, that was most of the walk. ``None`` if there
    is no template or a stride would not come out the same.
    """
    if template is None:
        return None

    def fresh(t: torch.Tensor) -> torch.Tensor:
        new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        # A non-leaf, like a computed output (a leaf requiring grad refuses in-place use).
        return new.requires_grad_().clone(memory_format=torch.preserve_format) if t.requires_grad else new

    with fake_mode:
        out = compat.tree_map_only(torch.Tensor, fresh, template)
    pairs = zip(compat.tree_leaves(out), compat.tree_leaves(template))
    return out if all(a.stride() == b.stride() for a, b in pairs) else None


def _is_scalar(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _scalars_stay_local(gm: fx.GraphModule, piece_of: dict[fx.Node, int]) -> None:
    """Copy each scalar node (a ``SymInt``/``SymFloat`` computed in the graph) into every other
    piece that reads it, instead of passing it from piece to piece.

    Under ``dynamic=True``, a value such as ``math.sqrt(2 / math.pi)`` in HF GPT-2's GELU is a
    ``SymFloat``; as a piece's output, AOTAutograd (2.13) saw a plain float in the forward
    graph's outputs and failed (``'float' object has no attribute 'meta'``), as
    ``torch.compile(DDP(model), dynamic=True)`` fails in DDPOptimizer. Copies go right before
    their first reader; a copy's own scalar inputs are copied in turn, tensors are passed.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    pending = [n for n in gm.graph.nodes if n in piece_of and _is_scalar(n)]
    while pending:
        node = pending.pop()
        readers: dict[int, list[fx.Node]] = {}
        for user in node.users:
            if user in piece_of and piece_of[user] != piece_of[node]:
                readers.setdefault(piece_of[user], []).append(user)
        for piece, users in readers.items():
            with gm.graph.inserting_before(min(users, key=lambda u: order[u])):
                copy = gm.graph.node_copy(node)
            copy.meta = dict(node.meta)
            piece_of[copy] = piece
            order[copy] = min(order[u] for u in users) - 0.5
            for user in users:
                user.replace_input_with(node, copy)
            pending.extend(a for a in copy.all_input_nodes if a in piece_of and _is_scalar(a))
    gm.graph.lint()


def _needs_backward(args: Sequence[object]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


@functools.cache
def _piece_compiler_class() -> type:
    class PieceCompiler(compat.piece_compiler_base()):
        """PyTorch's DDPOptimizer interpreter, with AOTAutograd's cache left usable and repeats reused.

        DDPOptimizer compiles every piece with ``fakify_first_call`` so that the strides
        Inductor chose for a piece's outputs reach the next piece's compile, which
        AOTAutograd refuses to cache. A piece without convolutions keeps eager strides on
        its outputs under Inductor, so for those (when ``cacheable``) the next piece's
        inputs come from running the uncompiled piece on fake tensors, and the piece is
        collected as a job, one per distinct piece (``reuse.piece_key``: a repeated block
        is one job), compiled after the walk (``_compile_jobs``), cacheably, and shared
        between ranks (Note [Sharing compiles between ranks]).
        """

        cacheable = False

        def setup(self) -> None:
            self.jobs: list[CompileJob] = []
            self.job_of_key: dict[str, int] = {}
            self.deferred: list[tuple[fx.Node, int]] = []
            self.outputs: dict[int, object] = {}  # job -> its first piece's fake outputs
            self.reused = 0
            self.position = 0
            # Per metadata entry: (key or None, position, piece needs a backward).
            self.entries: list[tuple[str | None, int, bool]] = []
            self.last_use: dict[str, int] = {}

        def run_node(self, n: fx.Node) -> object:
            if n.op != "call_module":
                return super().run_node(n)
            self.position += 1
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            real_mod = self.fetch_attr(str(n.target))
            if self.cacheable and not _may_change_layout(real_mod):
                return self._defer(n, real_mod, args)
            before = compat.piece_metadata_count()
            out = super().run_node(n)
            for _ in range(compat.piece_metadata_count() - before):
                self.entries.append((None, self.position, _needs_backward(args)))
            return out

        def _fake(self, args: tuple) -> list:
            return [compat.to_fake(a, self.fake_mode) for a in args]

        def _defer(self, n: fx.Node, real_mod: fx.GraphModule, args: tuple) -> object:
            key = piece_key(real_mod, args)
            job = self.job_of_key.get(key) if key is not None else None
            fake_args = None
            if job is None:
                fake_args = self._fake(args)
                job = len(self.jobs)
                shareable = compat.aot_cacheable(real_mod)
                self.jobs.append(
                    CompileJob(real_mod, fake_args, key, self.position, _needs_backward(args), shareable)
                )
                if key is not None:
                    self.job_of_key[key] = job
            else:
                self.reused += 1
            if key is not None:
                self.last_use[key] = self.position
            self.deferred.append((n, job))
            out = _fresh_outputs(self.outputs.get(job), self.fake_mode)
            if out is not None:  # a repeated block: its outputs are like its first sibling's
                return out
            fake_args = self._fake(args) if fake_args is None else fake_args
            # A piece with a key holds no tensors (reuse.piece_key), so it runs on fake
            # inputs as it is; any other gets fake copies of its parameters and buffers.
            fake_mod = real_mod if key is not None else compat.fake_module(real_mod, self.fake_mode)
            with self.fake_mode, compat.python_dispatcher(), compat.real_inputs_allowed(self.fake_mode):
                out = fake_mod(*fake_args)
            if key is not None and _fresh_outputs_allowed(out, fake_args):
                self.outputs[job] = out
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s outputs (shape, stride): %s", n.target, _strides(out))
            return out

    return PieceCompiler


def _compile_jobs(interpreter: fx.Interpreter, sharing: SharedCompiles | None, graph: str) -> None:
    """Compile the walk's jobs, put each compiled piece in its nodes' place, order the metadata.

    Alone, a job's backward is compiled at its first run, which reads the piece's
    AOTAutograd metadata from the tracing context: a compiled job adds its entry (one
    loaded from AOTAutograd's cache brings its backward along and adds none), and the
    entries are put in the order the lazy backward compiles take them (``backward_order``).
    Shared, the backward is compiled with the forward and needs no entry.
    """
    entries = interpreter.entries

    def compile_one(job: CompileJob) -> object:
        counts = compat.aot_autograd_counts()
        compiled = interpreter.compile_submod(job.module, job.args, {})
        after = compat.aot_autograd_counts()
        if not compat.backward_compiled_eagerly() and counts[0] != after[0] and counts[1] == after[1]:
            compat.record_piece_metadata()
            entries.append((job.key, job.position, job.needs_backward))
        return compiled

    if sharing is None:  # this rank compiles alone (Note [Graphs that differ by data])
        compiled = [compile_one(job) for job in interpreter.jobs]
    else:
        compiled = sharing.compile_all(interpreter.jobs, compile_one=compile_one, graph=graph)
    for n, job in interpreter.deferred:
        interpreter.module.delete_submodule(n.target)
        n.target = "compiled_" + n.target
        interpreter.module.add_submodule(n.target, compiled[job])
    compat.reorder_piece_metadata(backward_order(entries, interpreter.last_use))


def _whole_shared(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    *,
    compiler: CompilerFn,
    sharing: SharedCompiles,
    graph: str,
) -> Callable:
    """A graph of one piece, when the ranks have several cache folders: one rank compiles
    it and the others load it (Note [Compiles shared across cache folders]), so that a
    restart on an emptied folder loads instead of compiling while the warm ranks wait.
    With one folder every rank compiles it: Inductor's own cache is shared already."""
    job = CompileJob(
        gm, list(example_inputs), None, 1, _needs_backward(example_inputs), compat.aot_cacheable(gm)
    )
    (compiled,) = sharing.compile_all([job], compile_one=lambda j: compiler(j.module, j.args), graph=graph)
    return compiled


def split_and_compile(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    *,
    captured: CapturedGraph,
    plan: Plan,
    compiler: CompilerFn,
    sharing: SharedCompiles | None,
    graph: str,
    cacheable: bool = False,
) -> tuple[Callable, int]:
    """Compile ``gm`` as ``len(plan.pieces)`` separately compiled pieces.

    Returns a callable with the calling convention TorchDynamo expects from a backend,
    and how many pieces reused a compiled sibling instead of being compiled.
    ``cacheable`` says ``compiler`` is Inductor, whose pieces keep eager output strides
    unless they contain a convolution; those pieces are compiled so that AOTAutograd's
    cache can serve a warm restart, and a piece interchangeable with an earlier one (a
    repeated block, Note [Repeated blocks]) reuses its compiled function. ``sharing``
    compiles those, split between the ranks that share a compile cache (``graph`` names
    this compile in the store; Note [Sharing compiles between ranks]); ``None``: this rank
    compiles every piece itself.

    Example:
        >>> # used by distcompile's TorchDynamo backend; see distcompile.wrap
    """
    pieces = plan.compiled_pieces
    if sharing is not None:
        sharing.forget_sources()  # this graph's pieces, counted by compile_all if it runs
    if len(pieces) == 1:
        if cacheable and sharing is not None and sharing.several_folders():
            return _whole_shared(gm, example_inputs, compiler=compiler, sharing=sharing, graph=graph), 0
        if cacheable and runs_on_cpu(example_inputs):
            run_cpu_checks()  # compiled whole on every rank: each runs its checks in Inductor's order
        return compiler(gm, list(example_inputs)), 0
    piece_of = {}
    for k, (start, stop) in enumerate(pieces):
        piece_of.update((captured.body[i], k) for i in range(start, stop))
    _scalars_stay_local(gm, piece_of)
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
        _compile_jobs(interpreter, sharing, graph)
    split_gm.recompile()
    log.debug("split graph:\n%s", split_gm.graph)
    return split_gm, interpreter.reused
