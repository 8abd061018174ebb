"""How a wrapped model builds what it runs on, and builds it again.

``DistCompiledModule`` (``runtime/module.py``) builds, for the parameters and buffers the
model holds, a reducer (gradient hooks, buckets), a TorchDynamo backend, the first-step
check and the compiled module. This mixin builds them at ``wrap``; builds them again when
the model changed since (Note [Parameters that change after wrap], ``model_watch.py``);
releases them at ``close``; and makes copies (``copy.deepcopy``, ``torch.save``,
``AveragedModel``) behave as a DDP model's (Note [Copies of a wrapped model]).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from .. import _torch_compat as compat
from .._agreement import default_store, ranks_at
from .._config import Config
from ..capture.regions import mark_repeated_blocks
from ..compile.backend import CompileTarget, GraphCompiler
from ..errors import ConfigError, UnsupportedModelError
from ..fleet import sharing_for
from . import shutdown
from .collectives import agreed_token, broadcast_coalesced, group_device
from .comm_errors import Peers
from .ddp import Settings
from .forward_check import ForwardCheck
from .model_watch import ModelChange, ModelWatch, agree_on_change, meta_message, on_meta
from .reducer import BucketReducer
from .sparse import sparse_params
from .verify import StepCheck

__all__ = ["ModelBuild"]

log = logging.getLogger(__name__)

#: What a wrapped model's copy leaves out: built again at the copy's first training forward.
_RUNTIME = (
    "_observer",
    "_watch",
    "_reducer",
    "_backend",
    "_check",
    "_unmark",
    "_compiled",
    "_buffers_list",
    "_meta",
)


class ModelBuild:
    """Mixin of :class:`DistCompiledModule`: build, build again, release, copy.

    Note [Copies of a wrapped model]
        DDP drops its process group and reducer when pickled and takes the default group
        back when loaded (its process group must be the default one). A copy of a wrapped
        model does the same: ``__getstate__`` keeps the inner model, the options and the DDP
        object, and leaves out the process group, the communication hook, telemetry and
        everything built (reducer, backend, compiled code); the copy is an independent model.
        Evaluating it (no gradients) runs its module eagerly, with no collective, on any rank
        alone (an EMA model evaluated on rank 0). Its first training forward builds it on the
        default process group: a collective (every rank trains the copy, as with a copied
        DDP model), which draws its own store prefix.
    """

    #: Closed because its model was wrapped again (``distcompile.wrap``); set by ``close``.
    _replaced = False

    def _build(self, previous: BucketReducer | None = None) -> None:
        """The reducer, the backend, the first-step check and the compiled module, for the
        parameters and buffers the model holds now (``previous``: the reducer they replace,
        whose communication hook and optimizers carry over)."""
        config, settings = self.config, self._settings
        params = dict(self._watch.trainable)
        self._buffers_list = list(self._watch.buffers.values())
        self._meta = on_meta({**params, **self._watch.buffers})  # Note [Parameters that change after wrap]
        # Drawn for this wrap and this life of the group: a restarted group may share the store
        # of the last one (torchrun's agent store), whose keys must not be read as this group's.
        # A model adopted again compiles under keys of its own (the first compiles' are spent).
        self._store_prefix = settings.store_root + (f"/life{self._life}" if self._life else "")
        self._reducer = BucketReducer(
            params,
            group=settings.group,
            compression=settings.compression,
            compress_tail_only=config.compression_scope == "tail",
            grad_as_view=settings.grad_as_view,
            observer=self._observer,
            detect_nonfinite=config.detect_nonfinite,
            peers=Peers(
                self._describe_peers, lambda a: ranks_at(default_store(), self._store_prefix, a, self._rank)
            ),
            sparse=sparse_params(self.module),
            comm_hook=settings.comm_hook,
            bucket_caps=(settings.bucket_cap, settings.first_bucket_cap),
            agree_layout=self._agree_layout,
            # Note [Graphs that differ by data]: one layout from the first synchronized step on,
            # agreed by every rank, so that which graphs ran (or reran for other parameters) on a
            # rank never changes what it all-reduces.
            freeze=True,
            grads_in_graph_memory=config.cudagraphs,
        )
        if previous is not None:
            self._reducer.carry_over(previous)
        target = CompileTarget(
            config=config,
            params_by_id={id(p): n for n, p in params.items()},
            bucket_cap=settings.bucket_cap,
            first_bucket_cap=settings.first_bucket_cap,
            compression=settings.compression,
            costs=settings.costs,
            rank=self._rank,
            ranks=settings.ranks,
            store_prefix=self._store_prefix,
            graphs_differ=settings.find_unused,
            # Note [Parameters that change after wrap]: any other trainable parameter reaching a
            # graph would train without an all-reduce; the backend refuses it.
            untracked_ok=frozenset(id(p) for n, p in self.module.named_parameters() if n in settings.ignored),
        )
        sharing = sharing_for(config, store_prefix=self._store_prefix, rank=self._rank, ranks=settings.ranks)
        self._backend = GraphCompiler(
            target, registry=self._reducer, observer=self._observer, sharing=sharing
        )
        self._check = self._first_step_check(config, settings, params)
        # dynamic=True: TorchDynamo (2.13, 2.15) fails region traces with every dimension dynamic.
        self._unmark = (
            mark_repeated_blocks(self.module) if config.regions and config.dynamic is not True else None
        )
        compiled = compat.compile_module(
            self.module,
            backend=self._backend,
            fullgraph=config.fullgraph,
            dynamic=config.dynamic,
            on_guard_failure=self._backend.guard_failed,
        )
        object.__setattr__(self, "_compiled", compiled)  # not a registered submodule
        self._watch.take()  # the model as built

    def _release(self) -> None:
        """Undo ``_build``: gradient hooks off, blocks' classes back, TorchDynamo's entries dropped."""
        if self._reducer is None:  # a copy never built
            return
        self._reducer.close()
        self._drop_regions()
        released = compat.release_backend(self._backend)
        object.__setattr__(self, "_compiled", None)
        log.debug("released %d TorchDynamo cache entries of this model", released)

    def _adopt_changes(self) -> None:
        """Note [Parameters that change after wrap]: take the model as it is now, on every rank."""
        change = self._watch.compare()
        # A frozen parameter, a submodule without trainable state, buffers the forward rebinds:
        # nothing synchronized changed.
        if not change or change.only_rebound:
            self._retake()
            return
        if change.only_stand_ins:  # functional_call: gradients reach the parameters through them
            log.debug("parameters stood in for in this call (%s): nothing adopted", change.describe())
            return
        trainable = self._watch.trainable_now()
        tensors = {**trainable, **self._watch.buffers_now()}
        missing = on_meta(tensors)
        if missing:
            raise UnsupportedModelError(meta_message(missing))
        agree_on_change(
            change,
            self._watch,
            store_prefix=self._settings.store_root,
            life=self._life + 1,
            rank=self._rank,
            ranks=self._ranks,
            timeout_s=self.config.desync_timeout_s,
        )
        self._life += 1  # the next agreement's keys
        if self._toggled(change, trainable):
            log.debug(
                "trainable parameters toggled in place (%s): reducer and graphs kept", change.describe()
            )
            self._retake()
            return
        with torch.no_grad():  # as DDP's constructor: every rank starts from the first rank's values
            broadcast_coalesced(
                [tensors[n].detach() for n in change.new_tensors],
                src=self._ranks[0],
                group=self._settings.group,
            )
        log.info(
            "the model changed since wrap (%s): the ranks agree%s, and the model is compiled and "
            "bucketed again",
            change.describe(),
            ", take the first rank's values of the new tensors" if change.new_tensors else "",
        )
        previous = self._reducer
        self._release()
        self._watch.take()
        self._build(previous)

    def _toggled(self, change: ModelChange, now: dict[str, nn.Parameter]) -> bool:
        """Whether ``change`` only froze every trainable parameter, or made trainable again
        parameters the reducer holds, the same objects (a GAN's discriminator frozen for the
        generator's step): nothing to rebuild (Note [Parameters that change after wrap]).
        ``now``: the trainable parameters the model holds now."""
        if change.replaced or change.buffers or change.hooks:
            return False
        held = self._reducer.params
        if change.removed and not change.added:
            return not now
        return not change.removed and all(held.get(n) is p for n, p in now.items() if n in change.added)

    def _retake(self) -> None:
        """Note the model as it is now: nothing synchronized changed, buffers may be rebound."""
        self._watch.take()
        self._buffers_list = list(self._watch.buffers.values())

    def _take_rebound_buffers(self) -> None:
        """Before a broadcast of buffers: take those the last forward rebound (nothing else is
        adopted outside a training forward)."""
        if self._watch.buffers_moved():
            change = self._watch.compare()
            if not change or change.only_rebound:
                self._retake()

    def _take_changes(self) -> None:
        """Note [Parameters that change after wrap]: at a forward that may open a step (and at
        any forward while the model is on the meta device)."""
        if self._meta:
            still = on_meta({**self._watch.trainable_now(), **self._watch.buffers_now()})
            if still:
                raise UnsupportedModelError(meta_message(still))
        if torch.is_grad_enabled() and self._watch.changed():
            self._adopt_changes()

    def _first_step_check(
        self, config: Config, settings: Settings, params: dict[str, nn.Parameter]
    ) -> StepCheck | ForwardCheck | None:
        """``verify``'s check: the full one (True), the forward one ("forward"), or none."""
        if config.verify == "forward":
            return ForwardCheck(
                self.module,
                backend=config.backend,
                tolerance=config.verify_tolerance,
                as_captured=self._backend.as_captured,
                describe=self._describe_check,
                params=params,
                settle=self._reducer.finish_step,
                parted=self._reducer.parts.parted,
            )
        if not config.verify:
            return None
        return StepCheck(
            self.module,
            params=params,
            group=settings.group,
            settle=self._reducer.finish_step,
            where=self._where,
            tolerance=config.verify_tolerance,
            compressed=settings.compression is not None,
            stepped=self._reducer.optimizers.stepped_ids,
            hooked=lambda: self._reducer.hooks.name,
            steps=lambda: self._reducer.steps,
        )

    # -- copies: Note [Copies of a wrapped model] ----------------------------------------
    def __getstate__(self) -> dict:
        group = self._settings.group
        if group is not None and group != dist.group.WORLD:
            raise UnsupportedModelError(
                "a distcompile model on a process group other than the default one cannot be copied or "
                "pickled (DDP refuses it too: a loaded copy takes the default group). Copy or save the "
                "inner model instead: copy.deepcopy(model.module), torch.save(distcompile.unwrap(model))."
            )
        state = dict(nn.Module.__getstate__(self))  # type: ignore[arg-type]
        for name in _RUNTIME:
            state.pop(name, None)
        # The comm hook's state may hold a process group; the store prefix is drawn at the first step.
        state["_settings"] = replace(self._settings, group=None, comm_hook=None, store_root="")
        return state

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)  # type: ignore[arg-type]
        for name in _RUNTIME:
            object.__setattr__(self, name, None)
        self._meta = []

    def _forward_unbuilt(self, args: tuple, kwargs: dict) -> object:
        """A copy before its first training forward, or a closed model (``_reducer`` is ``None``
        or ``_closed``): evaluation runs the module eagerly; training builds a copy or raises."""
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        if self._closed:
            if self._replaced:
                raise UnsupportedModelError(
                    "this distcompile model was closed when its model was wrapped again "
                    "(distcompile.wrap): one wrapper at a time averages a parameter's gradients. Train "
                    "with the wrapper the later wrap() returned, or run evaluation under torch.no_grad()."
                )
            raise UnsupportedModelError(
                "this distcompile model was closed (model.close()): it no longer compiles nor averages "
                "gradients, so a training step here would leave the ranks apart. Wrap the model again "
                "(distcompile.wrap(model.module)) to train on, or run evaluation under torch.no_grad()."
            )
        self._build_copy()
        return self(*args, **kwargs)

    def _build_copy(self) -> None:
        """A copy's first training forward: take the default group, draw a store prefix, build."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "this is a copy of a distcompile model (copy.deepcopy, torch.load) and trains on the "
                "default process group, but none is initialized. Call "
                "torch.distributed.init_process_group() first, or train distcompile.unwrap(model) alone."
            )
        ranks = tuple(dist.get_process_group_ranks(dist.group.WORLD))
        device = group_device(None, list(self.module.parameters()))
        token = agreed_token(src=ranks[0], group=None, device=device)
        self._settings = replace(self._settings, ranks=ranks, store_root=f"distcompile/{token:016x}")
        self._rank, self._ranks, self._life = dist.get_rank(), list(ranks), 0
        self._watch = ModelWatch(self.module, ignored=self._settings.ignored)
        self._build()
        self.attach_to(self._source[0])
        shutdown.track(self)
        log.info("a copy of a distcompile model trains: built on the default process group")
