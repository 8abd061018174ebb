"""Optimizers stepped inside backward, on averaged gradients, bucket by bucket.

Two kinds meet here, at one hook point of the reducer (a bucket's gradients written):
torch's ``_apply_optimizer_in_backward`` (below), and an optimizer the user attached with
``model.attach_optimizer`` (``attached_optimizer.py``, Note [The optimizer under
communication]).

``torch.distributed.optim._apply_optimizer_in_backward`` gives each parameter its own
optimizer, stepped by a hook on the parameter's gradient accumulator, on the *local*
gradient. DDP takes those hooks off when it starts (its lazy init) and steps each
parameter's optimizers after its bucket's all-reduce instead, then sets the gradient to
``None``. distcompile does the same: at the first training forward (and at any later one
after new optimizers appeared) it takes the hooks off, and it steps a bucket's
parameters once their averaged gradients are written, at the end of ``backward()``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from .. import _torch_compat as compat
from ..errors import ConfigError
from .attached_optimizer import AttachedOptimizer

__all__ = ["OptimizersInBackward"]

log = logging.getLogger(__name__)


class OptimizersInBackward:
    """The parameters of one wrapped model that carry optimizers run in backward.

    Example:
        >>> opts = OptimizersInBackward({"w": torch.nn.Parameter(torch.ones(1))})
        >>> opts.adopt_new(); opts.ids
        set()
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        self.params = dict(params)
        self.ids: set[int] = set()
        self.attached: AttachedOptimizer | None = None

    @property
    def active(self) -> bool:
        """Whether any optimizer steps inside backward."""
        return bool(self.ids) or self.attached is not None

    def stepped_ids(self) -> set[int]:
        """Parameters some optimizer steps inside backward (their values change in it)."""
        return self.ids | (self.attached.ids if self.attached is not None else set())

    def attach(self, opt: torch.optim.Optimizer | None, *, per_parameter: bool = False) -> None:
        """Step ``opt`` bucket by bucket from the next synchronized backward on (``None``: stop)."""
        if self.attached is not None:
            self.attached.detach()
            self.attached = None
        if opt is None:
            return
        att = AttachedOptimizer(opt, self.params, per_parameter=per_parameter)
        both = att.ids & self.ids
        if both:
            att.detach()
            raise ConfigError(
                f"attach_optimizer: {len(both)} parameter(s) of this optimizer already have an optimizer in "
                "backward (_apply_optimizer_in_backward); each would step twice. Use one of the two."
            )
        self.attached = att
        log.info("attached optimizer: %s steps bucket by bucket inside backward", type(opt).__name__)

    def carry_over(self, previous: OptimizersInBackward) -> None:
        """Take over ``previous``'s optimizers for the parameters still trained (the model was
        adopted again: Note [Parameters that change after wrap]). An attached optimizer that holds
        a parameter the model no longer trains is detached, with a warning."""
        self.ids = previous.ids & {id(p) for p in self.params.values()}
        old, previous.attached = previous.attached, None
        if old is None:
            return
        old.detach()
        try:
            self.attach(old.optimizer, per_parameter=old.per_parameter)
        except ConfigError as exc:
            log.warning(
                "the attached optimizer was detached: the model changed and %s Attach the new optimizer "
                "with model.attach_optimizer(opt); until then, call opt.step() yourself.",
                str(exc).removeprefix("attach_optimizer: "),
            )

    def adopt_new(self) -> None:
        """Take torch's own step-on-local-gradient hooks off parameters that got optimizers."""
        if compat.optimizer_in_backward_count() == 0:  # none registered, or all taken off
            return
        found = [p for p in self.params.values() if compat.optimizers_in_backward(p)]
        compat.remove_optimizer_in_backward_hooks(found)  # also hooks added again to known ones
        new = {id(p) for p in found} - self.ids
        if new:
            self.ids.update(new)
            log.info(
                "optimizer in backward: %d parameter(s) step after their bucket's all-reduce", len(self.ids)
            )

    def step(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Step the optimizers of ``params`` (their averaged gradients are written)."""
        if self.attached is not None:
            self.attached.step(params)
        if not self.ids:
            return
        for p in params:
            if id(p) in self.ids and p.grad is not None:
                for opt in compat.optimizers_in_backward(p):
                    opt.step()

    def end_step(self) -> None:
        """As DDP: the gradients of parameters stepped in backward are ``None`` after it (an
        attached optimizer's are kept, as after a plain ``opt.step()``)."""
        if self.attached is not None:
            self.attached.end_step()
        if not self.ids:
            return
        for p in self.params.values():
            if id(p) in self.ids:
                p.grad = None
