"""The module users train: the compiled model, with DDP's behaviour and gradient sync."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from .. import _events
from .. import _torch_compat as compat
from .._agreement import default_store, failed_ranks, layouts_agree, mark_failed
from .._config import Config
from ..capture.breaks import tidy_reason
from ..capture.regions import RegionNotInlined, region_failure_reason
from ..compile.backend import CompileObserver
from ..compile.record import GraphRecord
from ..errors import DistCompileError, UnsupportedModelError
from . import shutdown
from .collectives import broadcast_coalesced
from .ddp import Settings
from .ddp_api import DDPSurface
from .forward_check import ForwardCheck
from .join import join_enabled, notify_join, sync_flag, take_last_joiner_state
from .model_build import ModelBuild
from .model_watch import ModelWatch
from .nesting import WRAPPERS, outer_data_parallel
from .reducer import StepObserver, StepStats
from .verify import StepCheck

__all__ = ["DistCompiledModule", "Observer"]

log = logging.getLogger(__name__)
_NO_REASONS = contextlib.nullcontext(())  # steps after the first: nothing to watch (reusable)


class Observer(StepObserver, CompileObserver, Protocol):
    """Both observer interfaces, and ``close`` (``wrap`` passes the telemetry object)."""

    def close(self) -> None:
        """Flush and release what the observer holds; called by ``DistCompiledModule.close``."""


def _region_failure(exc: BaseException) -> bool:
    """Whether a failed capture may be the regions' doing: TorchDynamo's own error, or ours
    for a region that cannot be inlined; not our planning errors (desync, recompile, ...)."""
    inner = compat.backend_failure_cause(exc)
    if not isinstance(inner, DistCompileError):
        return True
    cause: BaseException | None = inner
    while cause is not None and not isinstance(cause, RegionNotInlined):
        cause = cause.__cause__
    return cause is not None


def _region_only(exc: BaseException) -> bool:
    """Whether a failed capture is a region's own: a graph break inside a repeated block
    (TorchDynamo's ``UncapturedHigherOrderOpError``) or a region we could not inline."""
    cause: BaseException | None = compat.backend_failure_cause(exc)
    while cause is not None:
        if isinstance(cause, RegionNotInlined) or compat.is_region_capture_break(cause):
            return True
        cause = cause.__cause__
    return compat.is_region_capture_break(exc)


class DistCompiledModule(ModelBuild, DDPSurface, nn.Module, Joinable):
    """A model compiled by :func:`distcompile.wrap`; use it as you would the DDP model.

    ``state_dict()`` keys carry the ``module.`` prefix, as DDP's do. DDP's own API works on it
    (``no_sync``, ``register_comm_hook``, ``join`` and ``Join([model])``: ``runtime/ddp_api.py``).

    Attributes:
        module: The wrapped (inner) model.
        config: The effective options.
        graphs: One :class:`GraphRecord` per captured graph, in capture order.

    Example:
        >>> # model = distcompile.wrap(DDP(MyModel()))   # a DistCompiledModule
        >>> # model.graphs[0].plan.describe()            # after the first step
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        config: Config,
        settings: Settings,
        source: nn.Module,
        observer: Observer | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        self._divide_by_initial = True
        self.module = module
        self.config = config
        self._settings = settings
        self._source = [source]  # keep the DDP object (and its inert reducer) alive, unregistered
        self._observer = observer
        self._sync = True
        self._outer_checked = False
        self._require_forward_param_sync = True
        self._closed = False
        self._rank = dist.get_rank()
        self._ranks = list(settings.ranks)
        # Note [Parameters that change after wrap]: what the reducer and the graphs are built for.
        self._watch = ModelWatch(module, ignored=settings.ignored)
        self._life = 0  # how many times the model was adopted again since wrap
        self._build()
        self.attach_to(source)  # ddp.register_comm_hook(...) and Join([ddp]) reach this module
        shutdown.track(self)  # closed at interpreter exit if the script does not

    @property
    def graphs(self) -> list[GraphRecord]:
        """One :class:`GraphRecord` per captured graph, in capture order."""
        return self._backend.records if self._backend is not None else []

    # -- running -----------------------------------------------------------------------
    def forward(self, *args: object, **kwargs: object) -> object:
        """Run the compiled model; a later ``backward()`` averages gradients across ranks."""
        if compat.inside_dynamo():
            raise self._inside_compile()
        if self._closed or self._reducer is None:
            return self._forward_unbuilt(args, kwargs)
        if not self._outer_checked:
            self._check_not_wrapped()
        if self._meta or (torch.is_grad_enabled() and not self._reducer.step_open):
            try:
                self._take_changes()
            except Exception as exc:
                self._failed(exc)
                raise
        s = self._settings
        ddp = self._source[0]
        sync = torch.is_grad_enabled() and self._sync and getattr(ddp, "require_backward_grad_sync", True)
        joinables = (self, ddp)
        join_work = notify_join(joinables)  # runtime/join.py: the order of a step's collectives
        self._sync_buffers()
        if join_enabled(joinables):
            sync_flag(sync, device=self.join_device, group=s.group, joined=False)
        self._require_forward_param_sync = sync
        if sync:
            self._reducer.begin_forward(join_work, self._divide_by_initial)
        elif torch.is_grad_enabled():
            self._reducer.forward_unsynced()
        if s.device is not None:
            args, kwargs = compat.tree_map_only(
                torch.Tensor, lambda t: t.to(s.device, non_blocking=True), (args, kwargs)
            )
        self._backend.forget_guard_failures()  # stale: failures seen while another model compiled
        self._backend.lockstep.new_call()
        if not self.graphs and self._reducer.steps == 0:
            log.info(
                "capturing %s with TorchDynamo: the first step captures, plans and compiles (backend %s)",
                type(self.module).__name__,
                self.config.backend,
            )
        check = self._check if self._check is not None and self._check.pending else None
        if isinstance(check, StepCheck) and torch.is_grad_enabled():
            check.arm(args, kwargs, sync=sync)  # Note [First-step self-check]
        elif not torch.is_grad_enabled():
            check = None
        graphs = len(self.graphs)
        # The first step captures: when it captured no graph at all (TorchDynamo skipped the
        # forward: a TorchScript submodule called in it), TorchDynamo's reasons are said once.
        watch = compat.untraced_reasons() if self._reducer.steps == 0 else _NO_REASONS
        try:
            with watch as untraced:
                if isinstance(check, ForwardCheck):  # Note [First-step forward check]
                    out = check.run(lambda a, k: self.module(*a, **k), self._call_compiled, args, kwargs)
                else:
                    out = self._call_compiled(args, kwargs)
        except Exception as exc:
            self._failed(exc)
            # Our own errors raised while planning inside the backend arrive wrapped by
            # TorchDynamo; show the user the distcompile error itself (with its traceback).
            inner = compat.backend_failure_cause(exc)
            if isinstance(inner, DistCompileError):
                raise inner from inner.__cause__
            raise
        for reason in dict.fromkeys(untraced) if untraced and not self.graphs else ():
            log.info("TorchDynamo did not trace the forward (it runs eagerly): %s", tidy_reason(reason))
        if isinstance(check, StepCheck):
            out = check.attach(out)
        elif check is None and self._check is not None and len(self.graphs) > graphs:
            self._check.pending = True  # a recompile: check the next training step
        return out

    def _inside_compile(self) -> UnsupportedModelError:
        return UnsupportedModelError(
            "the distcompile model was called inside a torch.compile'd function (or a module compiled "
            "around it). distcompile compiles the model itself; a compile around it would trace "
            "distcompile's own gradient synchronization (its hooks run inside the backward of that "
            "function), which TorchDynamo cannot compile. Call the model outside torch.compile: compile "
            "the loss or the optimizer step on their own (torch.compile(loss_fn), torch.compile(opt.step)), "
            "or leave distcompile out and torch.compile the DDP model."
        )

    def _failed(self, exc: BaseException) -> None:
        """Record this rank's error: peers blocked in an all-reduce with this rank can then name it."""
        mark_failed(default_store(), self._store_prefix, self._rank, f"{type(exc).__name__}: {exc}")
        _events.emit("error", error=type(exc).__name__, message=" ".join(str(exc).split())[:1000])

    def _call_compiled(self, args: tuple, kwargs: dict) -> object:
        ran = self._reducer.graphs_run
        versions = compat.tensor_versions(self._buffers_list) if self._unmark is not None else []
        try:
            return self._compiled(*args, **kwargs)
        except Exception as exc:  # Note [Nested compile regions]: TorchDynamo raises, we retry without
            if self._unmark is None or not _region_failure(exc):
                raise
            # After a graph of this call ran, only a region's own failure, and only if no buffer
            # changed: running again must not repeat effects (BatchNorm statistics) nor a user's error.
            if self._reducer.graphs_run != ran and (
                not _region_only(exc) or versions != compat.tensor_versions(self._buffers_list)
            ):
                raise
            log.info(
                "capturing again with every block traced (TorchDynamo could not trace a repeated block "
                "as a nested compile region: %s)",
                region_failure_reason(exc),
            )
            self._drop_regions()
            return self._compiled(*args, **kwargs)

    def _describe_check(self) -> str:
        """The graphs and regions a failed forward check is about."""
        graphs = ", ".join(f"graph {r.graph_id} ({r.num_nodes} nodes)" for r in self.graphs) or "no graph"
        regions = getattr(self._unmark, "regions", "")
        used = f"nested compile regions in use: {regions}" if regions else "no nested compile regions in use"
        return f"Captured so far: {graphs}; {used}."

    def _where(self, name: str) -> str:
        """The graph and segment whose backward produces parameter ``name``'s gradient."""
        for record in self.graphs:
            for bucket in record.plan.buckets:
                if name in bucket.params:
                    start, stop = record.plan.segments[bucket.segment]
                    return f"graph {record.graph_id}, segment {bucket.segment} (nodes {start}-{stop - 1})"
        return "no captured graph: eager code"

    def _drop_regions(self) -> None:
        """Give the repeated blocks their own classes back, once (Note [Nested compile regions])."""
        unmark, self._unmark = self._unmark, None
        if unmark is not None:
            unmark()

    def _agree_layout(self, groups: list[list[str]]) -> list[list[str]] | None:
        """``groups`` if every rank's graphs gave the same bucket layout, else ``None`` (reducer.freeze_layout)."""
        return layouts_agree(
            default_store(),
            f"{self._store_prefix}/layout",
            groups,
            rank=self._rank,
            ranks=self._ranks,
            timeout_s=self.config.desync_timeout_s,
        )

    def _sync_buffers(self) -> None:
        s = self._settings
        if s.broadcast_buffers and self._require_forward_param_sync and self._buffers_list:
            self._take_rebound_buffers()
            with torch.no_grad():
                broadcast_coalesced(self._buffers_list, src=self._ranks[0], group=s.group)

    def _shadow_step(self) -> None:
        """A joined rank's part of the others' step (runtime/join.py)."""
        self._sync_buffers()
        syncs = sync_flag(False, device=self.join_device, group=self._settings.group, joined=True)
        self._require_forward_param_sync = syncs
        if syncs:
            self._reducer.shadow_step()

    def _take_last_joiner_state(self, is_last_joiner: bool) -> None:
        states = [p.detach() for n, p in self.module.named_parameters() if n not in self._settings.ignored]
        if self._settings.broadcast_buffers:
            states += self._buffers_list
        with torch.no_grad():
            take_last_joiner_state(states, is_last_joiner=is_last_joiner, group=self._settings.group)

    def _check_not_wrapped(self) -> None:
        # Until the first training forward: a DDP put around this module (Accelerate's prepare
        # after wrap, Lightning's strategy) runs its forward right above this one.
        outer = outer_data_parallel(self)
        if outer is not None:
            raise UnsupportedModelError(
                f"this distcompile model is called from inside a {outer}'s forward. That wrapper "
                "all-reduces every gradient again after backward, so gradients are reduced twice and "
                "none of it overlaps backward. Wrap once, outermost: build DDP(model), then "
                "distcompile.wrap it, and hand the result to no other data-parallel wrapper (with "
                "Accelerate, Lightning or the Hugging Face Trainer use distcompile.integrations, "
                "docs/integrations.md)."
            )
        self._outer_checked = torch.is_grad_enabled()

    def _describe_peers(self) -> str:
        others = [r for r in self._ranks if r != self._rank]
        failed = failed_ranks(default_store(), self._store_prefix, others)
        if failed:
            return "; ".join(
                f"rank {r} raised first: {' '.join(what.split())[:1000]}" for r, what in failed.items()
            )
        return (
            "No other rank recorded an error in its forward. Either a peer ran out of data (uneven inputs: "
            "ranks with fewer batches stop calling the model while the others wait in the all-reduce; "
            "train inside `with model.join():` or `Join([model])`, or give every rank as many batches), "
            "or a peer process was killed, raised in backward, or lost its network; its own log (or the "
            "launcher's) says why. Waiting is bounded by the process group's timeout "
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

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer | None, *, per_parameter: bool = False
    ) -> None:
        """Step ``optimizer`` inside each synchronized backward, bucket by bucket, under communication.

        Each bucket's parameters are stepped as soon as its averaged gradients are written, while
        later buckets are still on the wire, so only the last bucket's step is exposed. Your loop
        stops calling ``optimizer.step()`` (a call after such a backward does nothing, and raises
        ``ConfigError`` if the gradients were changed since, e.g. clipped). Gradients stay in place:
        keep ``zero_grad()``. For SGD, Adam, AdamW and the other per-parameter ``torch.optim``
        optimizers; ``per_parameter=True`` vouches for another whose step treats each parameter on
        its own. ``None`` detaches. Backwards under ``no_sync()`` do not step (as a plain loop that
        steps after the synchronized one). See docs/getting-started.md, "The optimizer under
        communication".

        Example:
            >>> # opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            >>> # model.attach_optimizer(opt)
            >>> # for x, y in data:
            >>> #     loss_fn(model(x), y).backward()   # steps opt bucket by bucket
            >>> #     opt.zero_grad()
        """
        self._reducer.optimizers.attach(optimizer, per_parameter=per_parameter)

    def close(self, *, replaced: bool = False) -> None:
        """Flush TensorBoard files and traces, remove gradient hooks, release the compiled code.

        Repeated blocks get their own classes back (Note [Nested compile regions]), and
        TorchDynamo forgets this model's compiles (``_torch_compat.release_backend``), so a
        closed and deleted model frees its memory. A closed model still evaluates (eagerly,
        under ``torch.no_grad()``); a training forward raises.

        Safe to call twice. A model still open at interpreter exit is closed then (an
        ``atexit`` handler), so a script that never calls it loses no telemetry. Wrapping its
        model again closes it too (``replaced=True``: its error then says so).

        Example:
            >>> # model.close()  # at the end of training
        """
        if shutdown.untrack(self):  # the first close
            _events.emit("close", steps=self._reducer.steps if self._reducer is not None else 0)
        if self._closed:
            return
        self._closed, self._replaced = True, replaced
        self.detach_from(self._source[0])
        self._release()
        if self._observer is not None:
            self._observer.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed model evaluates eagerly and no longer trains)."""
        return self._closed

    @property
    def last_step(self) -> StepStats:
        """Communication statistics of the last synchronized step on this rank."""
        return self._reducer.last_step if self._reducer is not None else StepStats()


WRAPPERS[DistCompiledModule] = "distcompile.DistCompiledModule"
