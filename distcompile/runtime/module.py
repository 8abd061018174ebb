"""``distcompile.wrap``: compile a data-parallel model with bucket-aligned segments."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import _torch_compat as compat
from .._agreement import check_agreement, default_store, failed_ranks, mark_failed
from ..capture.graph import read_graph
from .reducer import BucketReducer, StepStats, broadcast_coalesced
from .._config import Config
from ..capture.flops import node_flops
from ..planning.costs import CostModel
from .measure import measure_costs
from .._errors import CompileError, ConfigError, DistCompileError, RecompileError, UnsupportedModelError
from .._log import enable_progress
from ..planning.plan import DEFAULT_FIRST_BUCKET_BYTES, GraphCosts, Plan, plan_graph
from ..compile.segments import inner_compiler, instrument, split_and_compile
from ..telemetry.sink import Telemetry

__all__ = ["wrap", "DistCompiledModule", "GraphRecord"]

log = logging.getLogger(__name__)

_MB = 1024 * 1024
_DDP_DEFAULT_CAP_MB = 25
_wrap_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class GraphRecord:
    """One graph TorchDynamo captured and distcompile compiled.

    Attributes:
        graph_id: Order of capture within this wrapped model.
        plan: Its segments and buckets.
        compile_s: Seconds spent planning, checking and compiling it on this rank
            (Inductor compiles the backward lazily, during the first backward).
        num_nodes: Partitionable nodes in the graph.
        segment_compile_s: Forward compile seconds of each segment.
        graph_break: Why TorchDynamo ended this graph early (``None`` if it ran to the
            end of the compiled function), with the user code location.
        recompile_reasons: Every failed guard, in TorchDynamo's order (one per cached
            entry of this model's code), if this graph recompiles code compiled before.
        cache_hits: FX-graph and AOTAutograd cache hits while compiling it.
        planned_by: How the segments were chosen: the bucket caps, or the measured
            costs (``bucket_cap_mb="auto"``).
    """

    graph_id: int
    plan: Plan
    compile_s: float
    num_nodes: int
    segment_compile_s: tuple[float, ...] = ()
    graph_break: str | None = None
    recompile_reasons: tuple[str, ...] = ()
    cache_hits: int = 0
    planned_by: str = ""

    @property
    def recompile_reason(self) -> str | None:
        """All failed guards on one line (``None`` for a first compile)."""
        return "; ".join(self.recompile_reasons) or None


@dataclass(frozen=True, slots=True)
class _DDPSettings:
    group: dist.ProcessGroup | None
    bucket_cap: int
    first_bucket_cap: int
    broadcast_buffers: bool
    grad_as_view: bool
    compression: str | None
    ignored: frozenset[str]
    device: torch.device | None
    costs: CostModel | None = None  # measured when bucket_cap_mb="auto"


_HOOK_COMPRESSION = {
    "fp16_compress_hook": "fp16",
    "bf16_compress_hook": "bf16",
    "BuiltinCommHookType.FP16_COMPRESS": "fp16",
    "allreduce_hook": None,
    "BuiltinCommHookType.ALLREDUCE": None,
}


def _ddp_hook_compression(ddp: DDP) -> str | None:
    names = compat.ddp_comm_hook_names(ddp)
    for name in names:
        if name not in _HOOK_COMPRESSION:
            raise UnsupportedModelError(
                f"the DDP model has communication hook {name!r} registered; distcompile reduces "
                "gradients itself and supports only DDP's built-in allreduce, fp16 and bf16 "
                "compression hooks. Remove the hook (build the DDP without register_comm_hook) "
                "or pass compression='fp16'/'bf16' to distcompile.wrap."
            )
    return next((_HOOK_COMPRESSION[n] for n in names if _HOOK_COMPRESSION[n]), None)


def _settings(model: nn.Module, cfg: Config) -> tuple[nn.Module, _DDPSettings]:
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"distcompile.wrap expects a torch.nn.Module or DistributedDataParallel, got "
            f"{type(model).__name__}. Pass your model object (e.g. DDP(MyModel()))."
        )
    if isinstance(model, DistCompiledModule) or compat.is_compiled_module(model):
        raise UnsupportedModelError(
            f"got an already compiled model ({type(model).__name__}); distcompile compiles the "
            "model itself. Pass the uncompiled DDP model (drop torch.compile / the earlier wrap)."
        )
    if not dist.is_available() or not dist.is_initialized():
        raise UnsupportedModelError(
            "distcompile.wrap needs an initialized default process group, found none. "
            "Call torch.distributed.init_process_group() first (torchrun sets the environment), "
            "then build DistributedDataParallel(model) and wrap it."
        )
    if isinstance(model, DDP):
        if getattr(model, "mixed_precision", None) is not None:
            raise UnsupportedModelError(
                f"DDP mixed_precision={model.mixed_precision!r} is not supported. Use "
                "torch.autocast in the training loop and compression='bf16' instead."
            )
        if compat.ddp_uses_python_reducer(model):
            raise UnsupportedModelError(
                "the DDP model was built while torch._dynamo.config.optimize_ddp='python_reducer', so "
                "its Python reducer all-reduces every gradient itself and distcompile would communicate "
                "twice. Build the DDP model with the default optimize_ddp (True) before wrap()."
            )
        group = model.process_group
        try:
            dist.get_process_group_ranks(group)  # raises for a destroyed group
        except Exception as exc:  # noqa: BLE001 - any failure means the group is unusable
            raise UnsupportedModelError(
                f"the DDP model's process group is no longer usable ({type(exc).__name__}: {exc}); it "
                "was probably destroyed. Build the DDP model on a live process group before wrap()."
            ) from exc
        cap_bytes, first_cap = bucket_caps(
            model, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_cap_mb=cfg.first_bucket_cap_mb
        )
        hook_comp = _ddp_hook_compression(model)
        settings = _DDPSettings(
            group=group,
            bucket_cap=cap_bytes,
            first_bucket_cap=first_cap,
            broadcast_buffers=_pick(cfg.broadcast_buffers, model.broadcast_buffers),
            grad_as_view=_pick(cfg.gradient_as_bucket_view, model.gradient_as_bucket_view),
            compression=cfg.compression or hook_comp,
            ignored=frozenset(getattr(model, "parameters_to_ignore", ())),
            device=torch.device(model.device_type, model.device_ids[0]) if model.device_ids else None,
        )
        return model.module, settings
    cap_bytes, first_cap = bucket_caps(
        model, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_cap_mb=cfg.first_bucket_cap_mb
    )
    settings = _DDPSettings(
        group=None,
        bucket_cap=cap_bytes,
        first_bucket_cap=first_cap,
        broadcast_buffers=_pick(cfg.broadcast_buffers, True),
        grad_as_view=_pick(cfg.gradient_as_bucket_view, False),
        compression=cfg.compression,
        ignored=compat.ddp_ignored_names(model),
        device=None,
    )
    return model, settings


def graph_break_reason(gm: fx.GraphModule) -> str | None:
    """TorchDynamo's reason for ending ``gm`` at a graph break, with the user's code line.

    Example:
        >>> graph_break_reason(fx.symbolic_trace(torch.nn.Linear(1, 1))) is None
        True
    """
    parts = compat.graph_break_parts(gm)
    if parts is None:
        return None
    reason, stack = parts
    text = " ".join(reason.split())
    text = re.sub(r" Developer debug context:.*?(?= For more details|$)", "", text)  # internal detail
    if stack:
        frame = stack[-1]
        text += f" (at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()})"
    return text


def _ladder_hint(backend: str) -> str:
    lower = {"inductor": "aot_eager", "aot_eager": "eager"}.get(backend)
    if lower is None:
        return (
            "backend='eager' only captures the graph, so the failure is in TorchDynamo's capture or in "
            "splitting it: check the model under plain torch.compile(model, backend='eager')."
        )
    return (
        f"Try the next step down the debugging ladder, wrap(..., backend={lower!r}): if that works, the "
        f"problem is in the {backend} stage (distcompile.doctor walks the whole ladder)."
    )


def _make_telemetry(config: Config, rank: int, first_rank: int) -> Telemetry | None:
    if not config.logdir:
        return None
    if config.telemetry_all_ranks:
        run_dir: str | None = os.path.join(config.logdir, f"rank{rank}")
    else:
        run_dir = config.logdir if rank == first_rank else None
    return Telemetry(
        run_dir=run_dir,
        trace_dir=os.path.join(config.logdir, "traces"),
        rank=rank,
        trace_every=config.trace_every,
        figure_every=config.figure_every,
    )


def _param_checksums(module: nn.Module) -> str:
    # Two exact float64 sums per parameter (plain and position-weighted): equal bytes give
    # equal sums, and a differing value or a swap changes them. No copy to the host.
    lines = []
    with torch.no_grad():
        for name, p in module.named_parameters():
            flat = p.detach().reshape(-1).double()
            weights = (
                torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(1009).add_(1)
            )
            lines.append(
                f"{name} {tuple(p.shape)} {p.dtype} {float(flat.sum())!r} {float((flat * weights).sum())!r}"
            )
    return "\n".join(lines)


_param_checks = itertools.count()


def _check_same_params(module: nn.Module, settings: _DDPSettings, cfg: Config) -> None:
    ranks = dist.get_process_group_ranks(settings.group or dist.group.WORLD)
    check_agreement(
        default_store(),
        f"distcompile/params{next(_param_checks)}",
        _param_checksums(module),
        rank=dist.get_rank(),
        ranks=ranks,
        timeout_s=cfg.desync_timeout_s,
        what="the parameter values at wrap time",
        fix="DDP broadcast rank 0's parameters when it was built; they changed since on some rank "
        "(e.g. a checkpoint loaded on one rank only). Load the same weights on every rank before "
        "wrap(), or wrap(..., check_params=False) to skip this check.",
    )


def _check_same_shapes(module: nn.Module, cfg: Config) -> None:
    # A plain module gets no DDP constructor check; without this, ranks whose models differ
    # in shape would hang or fail inside the first broadcast.
    check_agreement(
        default_store(),
        f"distcompile/shapes{next(_param_checks)}",
        "\n".join(f"{n} {tuple(p.shape)} {p.dtype}" for n, p in module.named_parameters()),
        rank=dist.get_rank(),
        ranks=list(range(dist.get_world_size())),
        timeout_s=cfg.desync_timeout_s,
        what="the model's parameter names, shapes and dtypes",
        fix="Every rank must build the same model before wrap().",
    )


def _costs_dir() -> str:
    # Next to Inductor's compile cache: the remembered costs exist to keep that cache useful.
    return os.path.join(compat.inductor_cache_dir(), "distcompile")


def _pick(option: bool | None, inherited: bool) -> bool:
    return inherited if option is None else option


def bucket_caps(
    model: nn.Module, *, bucket_cap_mb: float | str | None, first_bucket_cap_mb: float | None
) -> tuple[int, int]:
    """Bytes of every bucket and of the first one, following DDP's rules.

    The cap is ``bucket_cap_mb``, else the DDP model's, else DDP's default (25 MiB). The
    first bucket is ``first_bucket_cap_mb``, else 1 MiB when the cap is DDP's default, else
    the cap (as in DDP, an explicit ``bucket_cap_mb`` also sizes the first bucket).

    Example:
        >>> bucket_caps(nn.Linear(1, 1), bucket_cap_mb=None, first_bucket_cap_mb=None)
        (26214400, 1048576)
    """
    if bucket_cap_mb == "auto":  # the caps only serve graphs the cost model cannot plan
        bucket_cap_mb = None
    if bucket_cap_mb is not None:
        cap = int(bucket_cap_mb * _MB)
    elif isinstance(model, DDP):
        cap = int(model.bucket_bytes_cap)
    else:
        cap = _DDP_DEFAULT_CAP_MB * _MB
    default = bucket_cap_mb is None and (
        not isinstance(model, DDP) or bool(getattr(model, "bucket_bytes_cap_default", True))
    )
    if first_bucket_cap_mb is not None:
        return cap, min(int(first_bucket_cap_mb * _MB), cap)
    return cap, (min(DEFAULT_FIRST_BUCKET_BYTES, cap) if default else cap)


class DistCompiledModule(nn.Module):
    """A model compiled by :func:`distcompile.wrap`; use it as you would the DDP model.

    ``state_dict()`` keys carry the ``module.`` prefix, as DDP's do.

    Attributes:
        module: The wrapped (inner) model.
        config: The effective options.
        graphs: One :class:`GraphRecord` per captured graph, in capture order.
    """

    def __init__(
        self, module: nn.Module, *, config: Config, settings: _DDPSettings, source: nn.Module
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.graphs: list[GraphRecord] = []
        self._settings = settings
        self._source = [source]  # keep the DDP object (and its inert reducer) alive, unregistered
        self._sync = True
        self._require_forward_param_sync = True
        self._wrap_id = next(_wrap_ids)
        self._store_prefix = f"distcompile/wrap{self._wrap_id}"
        self._graph_ids = itertools.count()
        self._rank = dist.get_rank()
        self._ranks = dist.get_process_group_ranks(settings.group or dist.group.WORLD)
        params = {n: p for n, p in module.named_parameters() if p.requires_grad and n not in settings.ignored}
        self._names_by_id = {id(p): n for n, p in params.items()}
        self._buffers_list = [b for n, b in module.named_buffers() if n not in settings.ignored]
        self._telemetry = _make_telemetry(config, self._rank, self._ranks[0])
        self._reducer = BucketReducer(
            params,
            group=settings.group,
            compression=settings.compression,
            compress_tail_only=config.compression_scope == "tail",
            grad_as_view=settings.grad_as_view,
            telemetry=self._telemetry,
            detect_nonfinite=config.detect_nonfinite,
            describe_peers=self._describe_peers,
        )
        self._compiler = inner_compiler(
            config.backend, mode=config.mode, cudagraphs=config.cudagraphs, dynamic=config.dynamic
        )
        self._guard_failures: list[str] = []
        compiled = compat.compile_module(
            module,
            backend=self._compile_graph,
            fullgraph=config.fullgraph,
            dynamic=config.dynamic,
            on_guard_failure=self._guard_failed,
        )
        object.__setattr__(self, "_compiled", compiled)  # not a registered submodule

    # -- the TorchDynamo backend -------------------------------------------------------
    def _guard_failed(self, reason: str) -> None:
        # Called by TorchDynamo for each failed guard of *this* model's cached code while
        # it looks for a reason to recompile; the compile that follows takes them all.
        self._guard_failures.append(reason)

    def _compile_graph(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        graph_id = next(self._graph_ids)
        doing = ["reading the captured graph"]
        try:
            return self._compile_graph_steps(gm, example_inputs, graph_id, doing)
        except DistCompileError:
            raise
        except Exception as exc:
            raise CompileError(
                f"rank {self._rank}: {doing[0]} of graph {graph_id} ({len(gm.graph.nodes)} FX nodes, "
                f"backend={self.config.backend!r}) failed inside torch {torch.__version__}: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:800].rstrip('.')}. "
                f"{_ladder_hint(self.config.backend)} The torch traceback is chained below; "
                "distcompile.explain(model, *inputs) shows the graphs and segments."
            ) from exc

    def _compile_graph_steps(
        self, gm: fx.GraphModule, example_inputs: list, graph_id: int, doing: list[str]
    ) -> Callable:
        t0 = time.perf_counter()
        reasons = tuple(r.splitlines()[0].strip() for r in self._guard_failures if "BACKEND_MATCH" not in r)
        self._guard_failures.clear()
        if reasons and self.config.recompile == "error" and self._reducer.steps > 0:
            raise RecompileError(
                f"rank {self._rank}: TorchDynamo is recompiling after {self._reducer.steps} step(s) because "
                f"guard(s) {list(reasons)!r} failed, and recompile='error' forbids recompiles after "
                "warm-up. Keep input shapes, dtypes and module flags (train/eval) constant, mark varying "
                "dimensions with torch._dynamo.mark_dynamic(x, dim) or wrap(..., dynamic=True) before "
                "the first step, or use recompile='allow'."
            )
        hits_before = compat.compile_cache_hits()
        s = self._settings
        captured = read_graph(gm, example_inputs, self._names_by_id)
        doing[0] = "planning segments and buckets"
        param_bytes = {n: p.numel() * p.element_size() for n, p in captured.params.items()}
        owned = self._reducer.claimed()  # parameters an earlier graph of this step buckets
        costs = self._graph_costs(gm, example_inputs, captured.body, first_graph=not owned)
        plan = plan_graph(
            captured.nodes,
            param_bytes,
            bucket_cap=s.bucket_cap,
            first_bucket_cap=s.first_bucket_cap,
            owned_elsewhere=owned,
            costs=costs,
        )
        planned_by = (
            f"measured costs: {s.costs.describe()}"
            if costs is not None and s.costs is not None
            else f"bucket caps: {s.bucket_cap / _MB:g} MiB, first bucket {s.first_bucket_cap / _MB:g} MiB"
        )
        shapes = [
            tuple(str(d) for d in x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            for x in example_inputs
        ]
        summary = f"inputs: {shapes}\n{gm.code.strip()}\nplan:\n{plan.describe()}"
        doing[0] = "checking that every rank captured the same graph"
        check_agreement(
            default_store(),
            f"{self._store_prefix}/graph{graph_id}",
            summary,
            rank=self._rank,
            ranks=self._ranks,
            timeout_s=self.config.desync_timeout_s,
            what=f"graph {graph_id}",
        )
        log.info(
            "graph %d: %d nodes -> %d segment(s), %d bucket(s) (%s); compiling with %s%s",
            graph_id,
            len(captured.nodes),
            len(plan.segments),
            len(plan.buckets),
            planned_by,
            self.config.backend,
            f" (recompile: {'; '.join(reasons)})" if reasons else "",
        )
        segment_s: list[float] = []

        def timed_compiler(piece: fx.GraphModule, inputs: list) -> Callable:
            doing[0] = f"compiling segment {len(segment_s)} of {len(plan.segments)}"
            start = time.perf_counter()
            try:
                return self._compiler(piece, inputs)
            finally:
                segment_s.append(time.perf_counter() - start)

        doing[0] = "splitting the graph into segments"
        compiled = split_and_compile(
            gm,
            example_inputs,
            captured=captured,
            plan=plan,
            compiler=timed_compiler,
            cacheable=self.config.backend == "inductor",
        )
        self._reducer.add_graph(graph_id, [b.params for b in plan.buckets])
        record = GraphRecord(
            graph_id=graph_id,
            plan=plan,
            compile_s=time.perf_counter() - t0,
            num_nodes=len(captured.nodes),
            segment_compile_s=tuple(segment_s),
            graph_break=graph_break_reason(gm),
            recompile_reasons=reasons,
            cache_hits=compat.compile_cache_hits() - hits_before,
            planned_by=planned_by,
        )
        self.graphs.append(record)
        log.info(
            "graph %d compiled in %.2f s (%d cache hit(s))%s",
            graph_id,
            record.compile_s,
            record.cache_hits,
            "; its backward compiles during the first backward" if self.config.backend != "eager" else "",
        )
        if reasons:
            # Every rank recompiles together (the agreement check above makes sure), so the
            # first rank speaks for all of them.
            log.log(
                logging.WARNING if self._rank == self._ranks[0] else logging.DEBUG,
                "graph %d is a recompile (%d failed guard(s), in TorchDynamo's order):\n  %s",
                graph_id,
                len(reasons),
                "\n  ".join(reasons),
            )
        if self._telemetry is not None:
            self._telemetry.compiled(
                graph_id=graph_id,
                step=self._reducer.steps,
                start=t0,
                end=t0 + record.compile_s,
                segment_s=segment_s,
                plan_table=f"planned by {planned_by}\n{plan.describe()}",
                breaks=[record.graph_break] if record.graph_break else [],
                recompile_reasons=reasons,
                cache_hits=record.cache_hits,
            )
            compiled = instrument(compiled, self._telemetry, graph_id)
        return _recording(compiled, self._reducer, graph_id)

    def _graph_costs(
        self, gm: fx.GraphModule, example_inputs: list, body: tuple, *, first_graph: bool
    ) -> GraphCosts | None:
        costs = self._settings.costs
        if costs is None:
            return None
        try:
            flops = node_flops(gm, example_inputs, body)
        except Exception as exc:  # noqa: BLE001 - the graph is still planned, by DDP's caps
            # Deterministic for a given graph, so every rank falls back alike (and the
            # plan agreement check would say so if not).
            log.warning(
                "bucket_cap_mb='auto': cannot count this graph's FLOPs (%s: %s); planning it with "
                "DDP's bucket caps instead",
                type(exc).__name__,
                exc,
            )
            return None
        # 16-bit compression halves the bytes on the wire: of every bucket, or of the tail
        # alone, which is the first segment of the step's first graph.
        half = 0.5 if self._settings.compression else 1.0
        if self.config.compression_scope == "tail":
            return costs.graph_costs(flops, tail_wire_scale=half if first_graph else 1.0)
        return costs.graph_costs(flops, wire_scale=half, tail_wire_scale=half)

    # -- running -----------------------------------------------------------------------
    def forward(self, *args: object, **kwargs: object) -> object:
        """Run the compiled model; a later ``backward()`` averages gradients across ranks."""
        s = self._settings
        if s.broadcast_buffers and self._require_forward_param_sync and self._buffers_list:
            with torch.no_grad():
                broadcast_coalesced(self._buffers_list, src=self._ranks[0], group=s.group)
        sync = torch.is_grad_enabled() and self._sync
        self._require_forward_param_sync = sync
        if sync:
            self._reducer.begin_forward()
        if s.device is not None:
            args, kwargs = compat.tree_map_only(
                torch.Tensor, lambda t: t.to(s.device, non_blocking=True), (args, kwargs)
            )
        self._guard_failures.clear()  # stale: failures seen while another model compiled
        if not self.graphs and self._reducer.steps == 0:
            log.info(
                "capturing %s with TorchDynamo: the first step captures, plans and compiles (backend %s)",
                type(self.module).__name__,
                self.config.backend,
            )
        try:
            return self._compiled(*args, **kwargs)
        except Exception as exc:
            # Peers blocked in an all-reduce with this rank can then name it.
            mark_failed(default_store(), self._store_prefix, self._rank, f"{type(exc).__name__}: {exc}")
            # Our own errors raised while planning inside the backend arrive wrapped by
            # TorchDynamo; show the user the distcompile error itself (with its traceback).
            inner = compat.backend_failure_cause(exc)
            if isinstance(inner, DistCompileError):
                raise inner from inner.__cause__
            raise

    def _describe_peers(self) -> str:
        others = [r for r in self._ranks if r != self._rank]
        failed = failed_ranks(default_store(), self._store_prefix, others)
        if failed:
            return "; ".join(
                f"rank {r} raised first: {' '.join(what.split())[:1000]}" for r, what in failed.items()
            )
        return (
            "No other rank recorded an error in its forward: a peer process was probably killed, "
            "raised in backward, or lost its network; its own log (or the launcher's) says why. "
            "Waiting on a dead peer is bounded by the process group's timeout "
            "(init_process_group(timeout=...))."
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronization for forwards (and their backwards) in this context.

        Example:
            >>> # with model.no_sync():
            >>> #     model(x1).sum().backward()      # accumulates locally
            >>> # model(x2).sum().backward()          # synchronizes the sum
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def close(self) -> None:
        """Flush TensorBoard files and remove gradient hooks; the module stops synchronizing.

        Example:
            >>> # model.close()  # at the end of training
        """
        self._reducer.close()
        if self._telemetry is not None:
            self._telemetry.close()

    @property
    def last_step(self) -> StepStats:
        """Communication statistics of the last synchronized step on this rank."""
        return self._reducer.last_step


def _recording(compiled: Callable, reducer: BucketReducer, graph_id: int) -> Callable:
    # TorchDynamo calls a backend's result with positional tensors (never boxed).
    def run(*args: object) -> object:
        if torch.is_grad_enabled():
            reducer.record_graph(graph_id)
        return compiled(*args)

    return run


def wrap(model: nn.Module, config: Config | None = None, **options: object) -> DistCompiledModule:
    """Compile a data-parallel model so each gradient bucket's all-reduce overlaps backward.

    ``model`` is a ``DistributedDataParallel`` model (its process group, bucket cap,
    ``broadcast_buffers``, ``gradient_as_bucket_view`` and fp16/bf16 comm hook are
    honoured) or a plain module when a default process group is initialized (its
    parameters and buffers are then broadcast from rank 0, as DDP does).

    Args:
        model: The DDP model, or a plain ``nn.Module``.
        config: Options; see :class:`distcompile.Config`.
        **options: Any ``Config`` field, overriding ``config``.

    Returns:
        A module to train exactly like the DDP model (``no_sync()`` included).

    Example:
        >>> # torch.distributed.init_process_group("gloo")
        >>> # model = distcompile.wrap(DDP(MyModel()), backend="inductor")
        >>> # loss = loss_fn(model(x), y); loss.backward(); opt.step()
    """
    cfg = config or Config()
    if options:
        cfg = cfg.replace(**options)
    inner, settings = _settings(model, cfg)
    group_ranks = dist.get_process_group_ranks(settings.group or dist.group.WORLD)
    enable_progress(rank=dist.get_rank(), first_rank=dist.get_rank() == group_ranks[0])
    params = [p for p in inner.parameters()]
    if cfg.cudagraphs and not (params and all(p.is_cuda for p in params)):
        device = params[0].device if params else "no parameters"
        raise ConfigError(
            f"cudagraphs=True needs a model on CUDA, but its parameters are on {device}. "
            "CUDA graphs record GPU kernels only; drop cudagraphs=True on this machine."
        )
    if isinstance(model, DDP) and cfg.check_params:
        _check_same_params(inner, settings, cfg)
    if cfg.bucket_cap_mb == "auto":
        device = settings.device or (params[0].device if params else torch.device("cpu"))
        costs = measure_costs(group=settings.group, device=device, remember_dir=_costs_dir())
        settings = dataclasses.replace(settings, costs=costs)
    if not isinstance(model, DDP):
        _check_same_shapes(inner, cfg)
        states = [p.detach() for p in params] + [b.detach() for b in inner.buffers()]
        if states:
            broadcast_coalesced(states, src=0, group=None)
    return DistCompiledModule(inner, config=cfg, settings=settings, source=model)
