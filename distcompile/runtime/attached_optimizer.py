"""The optimizer under communication: a user's optimizer stepped bucket by bucket.

Note [The optimizer under communication]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``model.attach_optimizer(opt)`` hands the optimizer to the reducer. Each synchronized
backward then steps it on each bucket's parameters as soon as that bucket's averaged
gradients are written: during backward when the all-reduce finished early, else at its end
bucket after bucket, so the step of bucket k runs while buckets k+1... are still on the
wire and only the last bucket's step is exposed.

Correct only for an optimizer whose step treats each parameter on its own (the torch.optim
list below): stepping a subset of its parameters then equals that part of a full step. The
subset step swaps each group's ``params`` for the subset, calls the optimizer's own step,
and puts them back; state, ``state_dict`` and ``param_groups`` are untouched. Whatever
the optimizer holds that no bucket carries (parameters DDP ignores, or that no bucket
reached) is stepped at the end of backward.

The user's own ``opt.step()`` after such a backward does nothing, so loops (and trainers)
that still call it stay correct, unless the gradients changed in between (gradient
clipping, a loss scaler's unscale): the step already ran on the gradients before the
change, so that raises ``ConfigError`` instead of training silently on other numbers. A
change is seen in the gradients' version counters, which every in-place write bumps.
"""

from __future__ import annotations

import logging
import types
import weakref
from collections.abc import Iterable, Mapping

import torch

from .. import _torch_compat as compat
from ..errors import ConfigError

__all__ = ["AttachedOptimizer", "PER_PARAMETER"]

log = logging.getLogger(__name__)

#: Each attached optimizer's stepper (what its replaced ``step`` calls).
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: torch.optim optimizers whose step updates each parameter from its own gradient and state only.
PER_PARAMETER = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
)


def _check_kind(opt: object, per_parameter: bool) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"attach_optimizer takes a torch.optim.Optimizer, got {type(opt).__name__}. Pass the "
            "optimizer whose step() your loop calls."
        )
    known = type(opt).__module__.startswith("torch.optim") and type(opt).__name__ in PER_PARAMETER
    if not known and not per_parameter:
        raise ConfigError(
            f"attach_optimizer: {type(opt).__module__}.{type(opt).__name__} is not one of the optimizers "
            f"known to step each parameter on its own ({', '.join(PER_PARAMETER)} from torch.optim). "
            "Stepping it bucket by bucket is correct only if its step treats each parameter "
            "independently: no global gradient norm or clipping inside it, no closure, no sharded "
            "state (ZeroRedundancyOptimizer), no line search (LBFGS). If yours does, pass "
            "per_parameter=True; otherwise keep calling opt.step() after backward."
        )


class AttachedOptimizer:
    """A user's optimizer, stepped by the reducer on each bucket's parameters.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> att = AttachedOptimizer(torch.optim.SGD([w], lr=0.5), {"w": w})
        >>> w.grad = torch.ones(2); att.step([w]); att.end_step(); w.tolist()
        [0.5, 0.5]
        >>> att.optimizer.step()  # after a step in backward: nothing more to do
        >>> att.detach()
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        params: Mapping[str, torch.nn.Parameter],
        *,
        per_parameter: bool = False,
    ) -> None:
        _check_kind(opt, per_parameter)
        owned = {id(p) for p in params.values()}
        outside = [tuple(p.shape) for g in opt.param_groups for p in g["params"] if id(p) not in owned]
        if outside:
            raise ConfigError(
                f"attach_optimizer: the optimizer holds {len(outside)} parameter(s) the wrapped model does "
                f"not train (shapes {outside[:4]}{' ...' if len(outside) > 4 else ''}). Attach an optimizer "
                "over this model's parameters only (build it from model.parameters())."
            )
        self.optimizer = opt
        self.per_parameter = per_parameter
        self.ids = {id(p) for g in opt.param_groups for p in g["params"]}
        self._stepped: set[int] = set()
        self._versions: list[tuple[torch.Tensor, int]] | None = None  # set once a backward stepped
        self._original = opt.__dict__.get("step")  # an instance attribute (an LR scheduler's wrapper)
        self._step = opt.step
        opt.step = types.MethodType(_guarded_step, opt)  # a method, as LR schedulers expect
        _ATTACHED[opt] = self

    def _step_subset(self, ids: set[int]) -> None:
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if id(p) in ids]
            self._step()
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    def step(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Step the attached optimizer on ``params`` (their averaged gradients are written)."""
        ids = {id(p) for p in params if id(p) in self.ids and p.grad is not None} - self._stepped
        if ids:
            self._step_subset(ids)
            self._stepped |= ids

    def end_step(self) -> None:
        """Step what no bucket stepped, then remember the gradients' versions for ``opt.step()``."""
        rest = self.ids - self._stepped
        if rest:
            self._step_subset(rest)
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        self._versions = list(zip(grads, compat.tensor_versions(grads)))
        self._stepped = set()

    def user_step(self, closure: object) -> object:
        """What ``opt.step()`` does while attached (see the Note)."""
        if closure is not None:
            raise ConfigError(
                "opt.step(closure) on an optimizer attached with attach_optimizer: the step runs inside "
                "backward, where no closure can be called. Detach it (model.attach_optimizer(None))."
            )
        versions, self._versions = self._versions, None
        if versions is None:  # no synchronized backward since the last step: a plain step
            return self._step()
        now = compat.tensor_versions([grad for grad, _ in versions])
        changed = sum(1 for (_, v), w in zip(versions, now) if v != w)
        if changed:
            raise ConfigError(
                f"opt.step(): {changed} gradient(s) were changed after backward (gradient clipping? a "
                "GradScaler's unscale_?), but the attached optimizer already stepped in backward, on the "
                "gradients before the change. Clip or unscale cannot run between backward and an "
                "optimizer stepped under communication: detach it (model.attach_optimizer(None)) and "
                "call opt.step() after the change."
            )
        return None

    def detach(self) -> None:
        """Give the optimizer its own ``step`` back."""
        opt = self.optimizer
        if self._original is not None:
            opt.step = self._original
        else:
            opt.__dict__.pop("step", None)
        _ATTACHED.pop(opt, None)


def _guarded_step(opt: torch.optim.Optimizer, closure: object = None) -> object:
    return _ATTACHED[opt].user_step(closure)
