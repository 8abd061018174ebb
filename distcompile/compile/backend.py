"""The TorchDynamo backend: one captured graph in, compiled bucket-aligned segments out.

``GraphCompiler.__call__`` is the recipe, one named step each:

1. ``_take_recompile_reasons``: the guards that failed (a recompile), and the policy.
2. ``_plan``: inline its nested compile regions, read it, price it, plan segments and buckets.
3. ``lockstep.agree``: every rank captured the same graph (or this rank compiles alone).
4. ``_compile``: split the graph at the segment boundaries and compile each piece (timed).
5. ``registry.add_graph``: the reducer learns the graph's buckets.
6. ``_record``: a ``GraphRecord``, the log lines, and the observer (telemetry).

Any exception from inside torch becomes a ``CompileError`` naming the step, graph, backend, torch
version and next step down the debugging ladder, except TorchDynamo's own control flow ("restart
the trace", "skip this frame": ``compat.dynamo_control_flow``), which goes back to it untouched.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import fx

from .. import _events
from .. import _torch_compat as compat
from .._config import Config
from .._store import describe_counts
from ..capture.breaks import graph_break_reason, is_data_dependent
from ..capture.graph import CapturedGraph, lookup_indices, read_graph, refuse_untracked
from ..capture.guards import condense_guard_failures, recompile_forbidden, recompile_note
from ..capture.regions import inline_regions
from ..errors import CompileError, DistCompileError
from ..planning.costs import CostModel
from ..planning.plan import Plan, plan_graph
from ..planning.split import SplitPlan, split_shared
from .failures import compile_failure, dynamo_fallback
from .jobs import SharedCompiles
from .pricing import graph_costs, planned_by
from .ranks_together import Lockstep
from .record import GraphRecord
from .segments import inner_compiler, split_and_compile
from .wrappers import AsCaptured, divert_parts, recording

__all__ = ["BucketRegistry", "CompileObserver", "CompileTarget", "GraphCompiler"]

log = logging.getLogger(__name__)


class BucketRegistry(Protocol):
    """What the backend needs of the gradient reducer (``runtime.reducer.BucketReducer``)."""

    steps: int

    def claimed(self) -> set[str]:
        """Parameters bucketed by graphs that already ran in the open step."""

    def add_graph(
        self, graph_id: int, buckets: Sequence[Sequence[str]], split: SplitPlan, plan: Plan
    ) -> None:
        """Register a graph's planned buckets (parameter names) and its split shared parameters."""

    def take_part(self, name: str, grad: torch.Tensor) -> bool:
        """Take a part's gradient (``compile.divert``); False: it stays with its parameter."""

    def record_graph(self, graph_id: int) -> None:
        """Note that the graph ran with gradients in the open step."""

    def freeze_layout(self) -> None:
        """From the next step on, one bucket layout whatever graphs ran, the same on every rank."""


class CompileObserver(Protocol):
    """What the backend tells an observer (``telemetry.sink.Telemetry``)."""

    def compiled(self, **figures: object) -> None:
        """A graph was compiled (see ``Telemetry.compiled`` for the figures)."""

    def instrument(self, compiled: Callable, graph_id: int) -> Callable:
        """``compiled``, with each segment's forward and backward timed."""


@dataclass(frozen=True, slots=True)
class CompileTarget:
    """What the backend compiles for: one wrapped model on one rank.

    Attributes:
        config: The effective options.
        params_by_id: ``id(parameter)`` -> its name in the wrapped module (trainable only).
        bucket_cap: Bytes of every bucket; ``first_bucket_cap``: of the first one.
        compression: ``None``, ``"fp16"`` or ``"bf16"``.
        costs: The measured cost model (``bucket_cap_mb="auto"``), else ``None``.
        rank: This process's global rank; ``ranks``: the group's global ranks.
        store_prefix: Prefix of this model's keys in the c10d store.
        graphs_differ: The ranks' graphs may differ by data from the start (DDP's
            ``find_unused_parameters=True``; Note [Graphs that differ by data]).
        untracked_ok: ``id``s of trainable parameters a graph may read with no bucket (DDP's ignored
            ones); any other not in ``params_by_id`` is refused (Note [Parameters that change after wrap]).
    """

    config: Config
    params_by_id: dict[int, str]
    bucket_cap: int
    first_bucket_cap: int
    compression: str | None
    costs: CostModel | None
    rank: int
    ranks: tuple[int, ...]
    store_prefix: str
    graphs_differ: bool = False
    untracked_ok: frozenset[int] = frozenset()


class GraphCompiler:
    """The TorchDynamo backend of one wrapped model (see the module docstring for the steps).

    Example:
        >>> # backend = GraphCompiler(CompileTarget(...), registry=reducer, observer=None)
        >>> # compiled = torch.compile(module, backend=backend)  # as wrap() does
    """

    def __init__(
        self,
        target: CompileTarget,
        *,
        registry: BucketRegistry,
        observer: CompileObserver | None,
        sharing: SharedCompiles | None = None,
    ) -> None:
        self.target = target
        config = target.config
        self.registry = registry
        self.observer = observer
        self.records: list[GraphRecord] = []
        # graph id -> what is known of each compiled piece's backward (retain_graph: wrappers.recording)
        self.donations: dict[int, list[compat.BackwardDonation]] = {}
        self.as_captured = AsCaptured()  # Note [First-step forward check]
        self._guard_failures: list[str] = []
        self._doing = ""
        self._calls = 0
        # Note [Sharing compiles between ranks] (``distcompile/fleet``): None compiles alone.
        self._sharing = sharing
        self._together = True
        # A part's gradient is held until its bucket launches: not from CUDA-graph memory,
        # which the next replay may overwrite (Note [Shared weights reduced by use]).
        self._splits = config.split_shared and not (
            config.cudagraphs or config.mode in ("reduce-overhead", "max-autotune")
        )
        self.lockstep = Lockstep(
            target.store_prefix,
            rank=target.rank,
            ranks=target.ranks,
            timeout_s=config.desync_timeout_s,
            differ=target.graphs_differ,
        )
        self._compiler = inner_compiler(
            config.backend,
            mode=config.mode,
            cudagraphs=config.cudagraphs,
            dynamic=config.dynamic,
            fallback_random=config.verify is True,  # Note [First-step self-check]: eager's random numbers
            on_backward_error=self._backward_error,
        )

    def _backward_error(self, exc: Exception) -> CompileError:
        """A backward Inductor failed to compile at its first run, inside the user's ``backward()``."""
        doing = "compiling the backward of a piece of this model (at its first backward)"
        return compile_failure(self.target.rank, doing, "inductor", exc)

    def guard_failed(self, reason: str) -> None:
        """TorchDynamo's ``guard_fail_fn``: one failed guard of this model's cached code."""
        self._guard_failures.append(reason)

    def forget_guard_failures(self) -> None:
        """Drop failures seen while another model compiled (called before each forward)."""
        self._guard_failures.clear()

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        graph_id = len(self.records)
        self._calls += 1  # a restarted trace calls again for the same graph_id
        self._doing = "reading the captured graph"
        try:
            t0 = time.perf_counter()
            hits_before = compat.compile_cache_hits()
            reasons = self._take_recompile_reasons()
            captured, plan, planned_by = self._plan(gm, example_inputs, bool(reasons))
            # As captured (regions inlined), before compiling can rewrite it: the forward check's run.
            as_captured = fx.GraphModule(gm, copy.deepcopy(gm.graph))
            self._doing = "checking that every rank captured the same graph"
            together = self.lockstep.agree(
                captured, plan, step=self.registry.steps, what=f"graph {graph_id}", recompile=bool(reasons)
            )
            self._together = together
            compiled, segment_s, reused = self._compile(
                gm, example_inputs, captured, plan, graph_id, planned_by, reasons, together
            )
            self._doing = "registering the graph's buckets"
            split = split_shared(plan, captured.nodes) if self._splits else SplitPlan()
            counts = lookup_indices(captured) if split.rows else {}
            split = replace(split, lookups=tuple((n, counts[n]) for n in split.rows if n in counts))
            self.registry.add_graph(graph_id, [b.params for b in plan.buckets], split, plan)
            compiled = divert_parts(compiled, split, captured.params, self.registry.take_part)
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
                pieces_reused=reused,
                split=split,
                piece_sources=dict(self._sharing.sources) if together and self._sharing else {},
            )
            compiled = self._record(record, compiled, t0)
            if self.lockstep.ended_at(
                record.graph_break, data_dependent=is_data_dependent(record.graph_break)
            ):
                self.registry.freeze_layout()
        except DistCompileError:
            self._abandon()
            raise
        except compat.dynamo_control_flow():
            self._abandon()
            self.lockstep.restarted()
            raise
        except Exception as exc:
            self._abandon()
            doing = f"{self._doing} of graph {graph_id} ({len(gm.graph.nodes)} FX nodes)"
            fallback = dynamo_fallback(exc, doing)
            if fallback is not None:  # TorchDynamo breaks the graph there and traces again
                self.lockstep.restarted()
                raise fallback from None
            explain = "distcompile.explain(model, *inputs) shows the graphs and segments"
            raise compile_failure(
                self.target.rank, doing, self.target.config.backend, exc, extra=explain
            ) from exc
        donations = self.donations.get(graph_id, [])
        return recording(
            compiled,
            self.registry,
            graph_id,
            self.target.config.backend,
            donations,
            captured=(as_captured, self.as_captured),
        )

    def _abandon(self) -> None:
        if self._sharing and self._together and self.lockstep.name:  # peers waiting for its share: stop
            self._sharing.abandon(self.lockstep.name)

    # -- the steps ---------------------------------------------------------------------
    def _take_recompile_reasons(self) -> tuple[str, ...]:
        reasons = tuple(r.splitlines()[0].strip() for r in self._guard_failures if "BACKEND_MATCH" not in r)
        self._guard_failures.clear()
        steps = self.registry.steps
        if reasons and self.target.config.recompile == "error" and steps > 0:
            raise recompile_forbidden(reasons, rank=self.target.rank, steps=steps)
        return reasons

    def _plan(self, gm: fx.GraphModule, inputs: list, again: bool) -> tuple[CapturedGraph, Plan, str]:
        t = self.target
        captured = read_graph(inline_regions(gm), inputs, t.params_by_id)
        refuse_untracked(
            gm, inputs, set(t.params_by_id) | t.untracked_ok, rank=t.rank, graph_id=len(self.records)
        )
        self._doing = "planning segments and buckets"
        param_bytes = {n: p.numel() * p.element_size() for n, p in captured.params.items()}
        owned = self.registry.claimed()  # parameters an earlier graph of this step buckets
        costs = graph_costs(
            t.costs,
            gm,
            inputs,
            captured,
            first_graph=not owned,
            compressed=t.compression is not None,
            tail_only=t.config.compression_scope == "tail",
            ranks=len(t.ranks),
            rows=self._splits,
            agree=functools.partial(
                self.lockstep.first_says,
                step=self.registry.steps,
                recompile=again,
                what=f"graph {len(self.records)}",
            ),
        )
        plan = plan_graph(
            captured.nodes,
            param_bytes,
            bucket_cap=t.bucket_cap,
            first_bucket_cap=t.first_bucket_cap,
            owned_elsewhere=owned,
            costs=costs,
            blocks=captured.blocks,
            # Sizes that follow the data: the whole graph is one piece. Inductor failed to compile
            # a piece that held them when the graph was cut before it (torch 2.13: AOTAutograd's
            # trace of the piece ended with PendingUnbackedSymbolNotFound), even with no cut
            # inside any span; uncut, the graph compiles as it does under torch.compile.
            sealed=((0, len(captured.nodes)),) if captured.sealed else (),
        )
        return captured, plan, planned_by(t.costs, costs, t.bucket_cap, t.first_bucket_cap)

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: list,
        captured: CapturedGraph,
        plan: Plan,
        graph_id: int,
        planned_by: str,
        reasons: tuple[str, ...],
        together: bool,
    ) -> tuple[Callable, list[float], int]:
        cfg = self.target.config
        pieces = len(plan.compiled_pieces)
        if torch.is_grad_enabled():
            layout = f"{len(plan.segments)} segment(s), {len(plan.buckets)} bucket(s) ({planned_by})"
            if captured.sealed:
                layout += "; one piece: sizes in it follow the data (nonzero, a boolean-mask index)"
        else:  # its segments keep the training graph's cuts, but no bucket ever runs
            layout = (
                f"{len(plan.segments)} segment(s); no gradients (inference graph), nothing to synchronize"
            )
        log.info(
            "graph %d: %d nodes -> %s; compiling %d piece(s) with %s%s",
            graph_id,
            len(captured.nodes),
            layout,
            pieces,
            cfg.backend,
            recompile_note(reasons),
        )
        segment_s: list[float] = []
        self.donations[graph_id] = donations = []
        seen: set[int] = set()

        def timed_compiler(piece: fx.GraphModule, inputs: list) -> Callable:
            self._doing = f"compiling piece {len(segment_s)} of {pieces}"
            start, hits = time.perf_counter(), compat.compile_cache_hits()
            try:
                compiled = self._compiler(piece, inputs)
                hit = compat.compile_cache_hits() > hits
                donations.append(compat.piece_donation(cache_hit=hit, seen=seen))
                return compiled
            finally:
                segment_s.append(time.perf_counter() - start)

        self._doing = "splitting the graph into segments"
        compiled, reused = split_and_compile(
            gm,
            example_inputs,
            captured=captured,
            plan=plan,
            compiler=timed_compiler,
            cacheable=cfg.backend == "inductor",
            sharing=self._sharing if together else None,  # apart: each rank compiles its own graph
            graph=self.lockstep.name,
        )
        return compiled, segment_s, reused

    def _backward_note(self, plan: Plan) -> str:
        if self.target.config.backend == "eager" or not torch.is_grad_enabled():
            return ""
        # Note [Sharing compiles between ranks], Note [Compiles shared across cache folders]
        shared = self._sharing.describe(len(plan.compiled_pieces)) if self._sharing and self._together else ""
        if shared:
            return shared
        return "; its backward compiles during the first backward"

    def _record(self, record: GraphRecord, compiled: Callable, t0: float) -> Callable:
        self._doing = "recording the compiled graph"
        self.records.append(record)
        _events.emit("compiled", graph=record.graph_id, sources=record.piece_sources)
        t = self.target
        log.info(
            "graph %d compiled in %.2f s (%d piece(s) reused from identical blocks, %d cache hit(s))%s; %s",
            record.graph_id,
            record.compile_s,
            record.pieces_reused,
            record.cache_hits,
            self._backward_note(record.plan),
            describe_counts(),
        )
        if record.split.parts or record.split.rows:
            log.info("graph %d: %s", record.graph_id, record.split.describe().replace("\n", "; "))
        reasons = record.recompile_reasons
        if reasons:
            # Every rank recompiles together (the agreement check makes sure): the first speaks.
            log.log(
                logging.WARNING if t.rank == t.ranks[0] else logging.DEBUG,
                "graph %d is a recompile (%d failed guard(s), in TorchDynamo's order):\n  %s",
                record.graph_id,
                len(reasons),
                "\n  ".join(condense_guard_failures(reasons)),
            )
        if self.observer is None:
            return compiled
        self.observer.compiled(**record.figures(step=self.registry.steps, start=t0))
        return self.observer.instrument(compiled, record.graph_id)
