"""Note [Bucketed all-reduce]

Background
    The planner gives each captured graph buckets aligned with its segments. At run time
    a training step may execute several graphs (graph breaks) and eager code between
    them; this module turns the graphs a step actually ran into an ordered list of flat
    buckets, and all-reduces each one as soon as its last gradient is final.

Algorithm
    * A parameter is *ready* when its post-accumulate-grad hook fires. The autograd
      engine runs a leaf's ``AccumulateGrad`` once per ``backward()``, after every use's
      gradient has arrived, so the hook fires exactly once, when the gradient is final.
    * The launch order comes from what ran in forward: graphs in reverse first-execution
      order, each graph's buckets in plan order, then one trailing bucket for every other
      trainable parameter (those only read by eager code, or owned by a graph that did not
      run). A parameter goes with its first use. A wrapped model freezes that layout at its
      first synchronized step (``freeze_layout``): the ranks compare theirs and keep it if
      it is the same everywhere, else take DDP's; from then on it is the same on every rank
      whatever graphs ran (Note [Graphs that differ by data]). Joined ranks shadow it.
    * Buckets launch strictly in that order (bucket *k+1* waits for bucket *k*), so
      collectives match across ranks. Launching copies each gradient into the bucket
      already multiplied by ``1/world_size`` (and cast, under compression), then starts
      ``all_reduce(async_op=True)``.
    * A callback queued on the autograd engine runs when ``backward()`` finishes: it
      launches what is left, waits for every bucket in order, and writes ``param.grad``
      (an attached optimizer steps each bucket after its write; its buckets already done
      are written during backward: Note [The optimizer under communication]).

    The flat buffers, their used flags and how they avoid host synchronization: Note
    [Flat buckets] in ``bucket.py``.

Note [A backward after the step]
    A step's gradients are averaged when its first ``backward()`` ends. A second backward of
    the same forward (``retain_graph=True`` and a second loss; or two forwards, then two
    backwards) adds gradients after that: eager DDP leaves them local, silently, and so
    does distcompile (DDP's semantics), but it says so once, naming the parameter. The
    backward of a forward that went around the wrapper (``model.module(x)``) is the same. Told
    apart from ``no_sync()`` accumulation by the forward: a gradient that arrives after a
    step ended and before any other forward under gradients ran. A penalty backpropagated
    apart from the loss gets the message too, though its gradient, the same on every rank,
    keeps them in sync: no communication can tell the two apart. ``verify=True`` leaves
    such gradients out of its comparison with eager DDP (it compares averaged ones).

Debugging
    ``BucketReducer.last_step`` holds the last ``StepStats``; DEBUG logging for ``distcompile`` shows launches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from .. import _events
from .. import _torch_compat as compat
from ..errors import DistCompileError, UnsupportedModelError
from ..planning.plan import Plan
from ..planning.split import SplitPlan
from .comm_errors import NO_PEERS, Peers, comm_error
from .graph_memory import take_ownership
from .hooks import CommHook, HookChain
from .join import JoinState
from .layout import BucketForm, Layouts
from .optim_in_backward import OptimizersInBackward
from .schedule import OpenStep, ReduceBucket, report_uncompiled
from .stats import StepObserver, StepStats
from .writeback import WriteBack

__all__ = ["BucketReducer", "StepObserver", "StepStats"]

log = logging.getLogger(__name__)


class BucketReducer:
    """Owns gradient synchronization for the trainable parameters of one wrapped model.

    Example:
        >>> # created by distcompile.wrap; a training step then looks like eager DDP:
        >>> # loss = model(x).sum(); loss.backward()  # grads are averaged across ranks
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        *,
        group: dist.ProcessGroup | None,
        compression: str | None,
        grad_as_view: bool,
        compress_tail_only: bool = False,
        observer: StepObserver | None = None,
        detect_nonfinite: bool = False,
        peers: Peers = NO_PEERS,
        sparse: set[int] = frozenset(),  # type: ignore[assignment]
        comm_hook: CommHook | None = None,
        bucket_caps: tuple[int, int] = (25 << 20, 1 << 20),
        agree_layout: Callable[[list[list[str]]], list[list[str]] | None] = lambda groups: groups,
        freeze: bool = False,
        grads_in_graph_memory: bool = False,
    ) -> None:
        self.params = dict(params)
        self.grads_in_graph_memory = grads_in_graph_memory  # Note [Gradients in CUDA-graph memory]
        self.layout = Layouts(
            self.params, sparse=set(sparse), bucket_caps=bucket_caps, agree=agree_layout, freeze=freeze
        )
        self.parts = self.layout.parts  # Note [Shared weights reduced by use]
        self.hooks = HookChain(comm_hook, compression)
        self.join = JoinState(dist.get_world_size(group))
        self.optimizers = OptimizersInBackward(self.params)
        self.observer = observer
        self.peers = peers
        self.writeback = WriteBack(
            parts=self.parts, optimizers=self.optimizers, hooks=self.hooks, group=group, observer=observer,
            detect_nonfinite=detect_nonfinite, peers=peers,
        )  # fmt: skip
        self.steps = 0
        self._step_events = _events.enabled(first_of_node=True)
        self.group = group
        self.compress_tail_only = compress_tail_only
        self.grad_as_view = grad_as_view
        self._step: OpenStep | None = None
        self._warned_unsynced = False
        # Note [A backward after the step]: the last synchronized forward's step has ended and
        # no forward ran since; a gradient now comes from a second backward of that forward.
        self._synced = False
        self._warned_late = False
        self.last_step = StepStats()
        self._name_of = {id(p): n for n, p in self.params.items()}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params.values()]

    def carry_over(self, previous: BucketReducer) -> None:
        """Send as ``previous`` did (its communication hook) and step its optimizers: this reducer
        replaces it for the model as it is now (Note [Parameters that change after wrap])."""
        self.hooks.set(*previous.hooks.current())
        self.optimizers.carry_over(previous.optimizers)

    # -- forward side ------------------------------------------------------------
    def add_graph(
        self,
        graph_id: int,
        buckets: Sequence[Sequence[str]],
        split: SplitPlan | None = None,
        plan: Plan | None = None,
    ) -> None:
        """Register the planned buckets (parameter names, gradient order) of a graph, and its parts."""
        self.layout.add_graph(graph_id, buckets, split, plan)

    def begin_forward(self, join_work: dist.Work | None = None, divide_by_initial: bool = True) -> None:
        """Open a step (if none is open): the next backward synchronizes gradients.

        ``join_work``: under ``Join``, the all-reduce that counts the ranks still training.
        """
        if self._step is None:
            if self.hooks.adopt_pending():
                self.layout.clear()  # buckets are rebuilt for the new hook
            self.optimizers.adopt_new()
            self._step = OpenStep(join_work, divide_by_initial)
            self._synced = False
            self.layout.begin_step()
            self.writeback.new_step()
            self.parts.clear()
            if self.observer is not None:
                self.observer.begin_step()

    def forward_unsynced(self) -> None:
        """A forward under gradients that synchronizes nothing (``no_sync()``) ran: its backward
        accumulates locally, as asked (Note [A backward after the step])."""
        self._synced = False

    def set_comm_hook(self, hook: CommHook | None, compression: str | None) -> None:
        """Reduce with ``hook`` (or the fused path with ``compression``) from the next step on."""
        self.hooks.set(hook, compression)

    def record_graph(self, graph_id: int) -> None:
        """Note that a captured graph ran with gradients in the open step."""
        step = self._step
        if step is not None and step.order is None and graph_id not in step.graphs:
            step.graphs.append(graph_id)

    def claimed(self) -> set[str]:
        """Parameters bucketed by graphs that already ran in the open step."""
        return set() if self._step is None else self.layout.claimed_by(self._step.graphs)

    @property
    def step_open(self) -> bool:
        return self._step is not None

    @property
    def graphs_run(self) -> int:
        """Captured graphs that ran with gradients in the open step (0 when none is open)."""
        return 0 if self._step is None else len(self._step.graphs)

    # -- backward side -------------------------------------------------------------
    def freeze_layout(self) -> None:
        """From the next step on, one bucket layout whatever graphs ran (``Layouts.freeze``)."""
        self.layout.freeze()

    def _form(self) -> BucketForm:
        return BucketForm(
            compression=self.hooks.compression if self.hooks.fused else None,
            compress_tail_only=self.compress_tail_only,
            grad_as_view=self.grad_as_view,
            fresh_grads=self.grads_in_graph_memory,
            splits=self.hooks.fused,
        )

    def take_part(self, name: str, grad: torch.Tensor) -> bool:
        """A piece's contribution to a shared parameter (``compile.wrappers``): True if taken."""
        step = self._step
        if step is None or not self.hooks.fused:
            return False
        holder = self.parts.accept(name, grad, self._located(step), step.cursor)
        if holder is not None:
            self._on_grad(holder)
        return holder is not None

    def _located(self, step: OpenStep) -> dict:
        if step.order is None:  # the step's first gradient: its buckets
            if compat.inside_dynamo():  # TorchDynamo would trace the launches below, and fail
                raise UnsupportedModelError(
                    "backward() of a distcompile model ran inside a torch.compile'd function: TorchDynamo "
                    "would trace distcompile's gradient synchronization (its hooks run in that backward), "
                    "which it cannot compile. Call backward() outside torch.compile; compile the loss or the "
                    "optimizer step on their own (torch.compile(loss_fn), torch.compile(opt.step))."
                )
            step.order, self._locate = self.layout.schedule(tuple(step.graphs), self._form())
            self.hooks.new_step()
            step.started = time.perf_counter()
            step.streaming = self.optimizers.active and self.writeback.streaming()
            compat.queue_engine_callback(self._finish_step)
        return self._locate

    def _on_grad(self, param: torch.Tensor) -> None:
        step = self._step
        if step is None:
            if self.grads_in_graph_memory:
                take_ownership(param)
            if self._synced and not self._warned_late:
                self._warn_late(param)
            if not self._warned_unsynced:
                self._warned_unsynced = True
                log.debug(
                    "gradient of %s accumulated outside a synchronized step (no_sync?)",
                    self._name_of.get(id(param)),
                )
            return
        # Once per parameter and step, so kept short: a bucket is looked at when it fills (a
        # bucket held back by its predecessor's hook launches when the next one fills, or at
        # the end of backward).
        bucket, i = (self._locate if step.order is not None else self._located(step))[id(param)]
        if not bucket.ready[i]:
            bucket.ready[i] = True
            bucket.n_ready += 1
            if bucket.n_ready == len(bucket.params):
                self._launch_ready(step)
        if step.streaming:
            self.writeback.write_finished(step, self.steps)

    def _warn_late(self, param: torch.Tensor) -> None:
        self._warned_late = True
        log.warning(
            "the gradient of %s arrived after this step's gradients were averaged across ranks: a second "
            "backward() of a forward whose step already ended (retain_graph=True and a second loss, or two "
            "forwards and then two backwards), or the backward of a forward that went around the wrapped "
            "model (model.module(x)). It is not averaged (eager DDP does the same), so where it differs "
            "between ranks the ranks drift apart. Add the losses and call backward() once, run each "
            "forward's backward before the next forward (no_sync() around all but the last), and call the "
            "wrapped model itself. Harmless if that gradient is the same on every rank (a penalty on the "
            "weights alone). Said once.",
            self._name_of.get(id(param), "a parameter"),
        )

    def _scale(self, step: OpenStep) -> float:
        if step.scale is None:
            step.scale = self.join.scale(step.join_work)
        return step.scale

    def _launch_ready(self, step: OpenStep, *, all_remaining: bool = False) -> None:
        order = step.order
        assert order is not None
        while step.cursor < len(order):
            bucket = order[step.cursor]
            if not all_remaining and bucket.n_ready < len(bucket.params):
                return
            if not self._previous_hook_done(bucket, wait=all_remaining):
                return
            self._launch(bucket, self._scale(step), is_last=step.cursor == len(order) - 1)
            step.cursor += 1

    def _previous_hook_done(self, bucket: ReduceBucket, *, wait: bool) -> bool:
        blocked = (lambda w: self.writeback.blocked(bucket.index - 1, w)) if wait else None
        return self.hooks.previous_done(bucket, wait=blocked)

    def _launch(self, bucket: ReduceBucket, scale: float, *, is_last: bool) -> None:
        try:
            hook = self.hooks.for_bucket(bucket)
            bucket.launch(self.group, scale, hook=hook, is_last=is_last)
            if hook is not None:
                self.hooks.launched(bucket.completion())
            if self.observer is not None:
                self.observer.bucket_launched(
                    bucket.index, bucket.nbytes, len(bucket.params), bucket.completion()
                )
        except DistCompileError:
            raise
        except Exception as exc:
            raise comm_error(bucket, self.steps, self.peers, "launching", exc) from exc

    def shadow_step(self) -> None:
        """The collectives of one synchronized step with zero gradients, for a rank that joined
        (its buckets: the last step's). Its own gradients are left alone."""
        order = self.join.to_shadow()
        self.hooks.new_step()
        for i, bucket in enumerate(order):
            bucket.reset()
            self._previous_hook_done(bucket, wait=True)
            self._launch(bucket, self.join.scale(None), is_last=i == len(order) - 1)
        self.writeback.wait_and_write(order, self.steps, write=False)

    def finish_step(self) -> None:
        """End the open step now, inside ``backward()``: launch and wait for every bucket (idempotent)."""
        self._finish_step()

    def _finish_step(self) -> None:
        step = self._step
        self._step = None
        if step is None or step.order is None:
            return
        self._launch_ready(step, all_remaining=True)
        self.writeback.wait_and_write(step.order[step.written :], self.steps)
        self.optimizers.end_step()
        if self.parts.settle(step.order, joining=step.joining):
            self.layout.clear()  # a dense table's parts leave the layout, or come back
        self.join.remember(step.order)
        stats = step.stats(self.steps, self.writeback.waited_s)
        if self.observer is not None:
            stats = replace(stats, **self.observer.end_step(stats))
        if self.steps == 0 and dist.get_rank(self.group) == 0:  # once, after the first step
            claimed = self.layout.claimed_by(step.graphs) | set(
                self.parts.holders
            )  # parts: from the graphs too
            report_uncompiled(step.order or (), claimed, self.params, log)
        self.last_step = stats
        self.steps += 1
        self._synced = True
        if self._step_events:  # the first rank of each node: one line a step and node
            _events.emit("step", n=self.steps)

    def abandon_step(self) -> None:
        """Forget an open step whose backward never ran (e.g. forward under grad, no backward)."""
        self._step = None

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
