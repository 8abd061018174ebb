"""Note [First-step forward check]: the check ``wrap`` runs by default (``verify="forward"``).

Background
    A compiled model can be wrong without any error. Repeated blocks that shared a region
    trace they should not have trained timm's ViT without its drop path, silently (Note
    [Regions only for blocks alike]); the same kind of fault in TorchDynamo, in the way
    distcompile inlines regions, or in the compiler would go unseen until a user compared
    loss curves. ``verify=True`` catches such faults but costs a second model and a
    second backward, so it is opt-in; this check is cheap enough to be on by default.

Algorithm
    On the first training forward, and on the first after a call that compiled a graph (a
    recompile), the wrapped module's forward runs three times on the same inputs, each
    from the same random number state, buffers and plain Python attributes (put back
    after each run, so that a BatchNorm's statistics or a step counter move once):

    1. eagerly, the module itself: the reference;
    2. as captured: TorchDynamo's code with each graph run as its FX graph, uncompiled
       (eager kernels, eager random numbers, in the graph's order), so it must match the
       reference to rounding whatever the forward draws at random. A difference means the
       capture is wrong (a region reused for a block it does not fit, a trace that does
       not do what the code does);
    3. compiled: the step's real forward, whose outputs are returned. It is compared with
       the reference unless the forward drew random numbers (seen during 1, by a dispatch
       mode) and the backend is Inductor, whose random numbers are its own; a difference
       means the compiler is wrong for these inputs.

    Outputs are compared as ``verify`` compares them: ``max|x - ref| <= tol * max|ref|``,
    ``tol`` 1e-4 for the captured forward and 1e-3 for the compiled one (both 2e-2 when the
    forward runs in 16-bit: half-precision parameters or autocast), or ``verify_tolerance``.
    A difference raises :class:`~distcompile.VerificationError` on the rank that saw it,
    naming the graphs of the call, the regions in use and the fixes; its peers, waiting in
    the step's all-reduce, name it in their error (``_agreement.mark_failed``).

Cost
    Two more forwards, without backward, in the checked steps only (the first step, and
    the first after each recompile); other steps pay one ``if``. The eager forwards'
    activations are freed at once. What cannot be put back: side effects outside the
    module (a global counter, a print) happen three times in a checked step.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable

import torch
from torch import nn

from .. import _torch_compat as compat
from .._errors import VerificationError
from .checkpoint import rng_state, set_rng_state

__all__ = ["ForwardCheck"]

log = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)
_SHALLOW = (list, dict, set)


class _State:
    """The module's buffers, Python attributes and the random number state, to put back.

    Attributes are the public entries of each submodule's ``__dict__`` (a counter, a flag, a
    ``forward`` that a trainer patched in for one call: Lightning's forward redirection puts
    the original back when called), lists, dicts and sets copied one level deep."""

    def __init__(self, module: nn.Module) -> None:
        self.rng = rng_state()
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.attrs = [
            (
                m,
                {
                    k: (copy.copy(v) if isinstance(v, _SHALLOW) else v)
                    for k, v in vars(m).items()
                    if k[:1] != "_"
                },
            )
            for m in module.modules()
        ]

    def restore(self) -> None:
        with torch.no_grad():
            for b, value in self.buffers:
                b.copy_(value)
        for m, saved in self.attrs:
            for k in [k for k in vars(m) if k[:1] != "_" and k not in saved]:
                delattr(m, k)  # set by the run: not there before
            for k, v in saved.items():
                setattr(m, k, copy.copy(v) if isinstance(v, _SHALLOW) else v)
        set_rng_state(self.rng)


def _leaves(out: object) -> list[torch.Tensor | None]:
    return [t.detach() if isinstance(t, torch.Tensor) else None for t in compat.tree_leaves(out)]


def _differences(got: list, want: list, tol: float) -> list[str]:
    if len(got) != len(want):
        return [f"the forward returned {len(got)} values, eager {len(want)}"]
    found = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None or b is None or a.shape != b.shape or not b.is_floating_point():
            continue
        diff = float((a.float() - b.float()).abs().max()) if b.numel() else 0.0
        scale = max(float(b.float().abs().max()) if b.numel() else 0.0, 1e-6)
        if not diff <= tol * scale:  # NaN fails too
            found.append(
                f"output {i} differs from eager's by {diff:.3g} (scale {scale:.3g}, tolerance {tol:.0e})"
            )
    return found


class ForwardCheck:
    """The default first-step check of one wrapped model (Note [First-step forward check]).

    Example:
        >>> # created by DistCompiledModule unless wrap(..., verify=False) or verify=True
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        backend: str,
        tolerance: float | None,
        as_captured: Callable[[], contextlib.AbstractContextManager],
        describe: Callable[[], str],
    ) -> None:
        self.module = module
        self.backend = backend
        self.tolerance = tolerance
        self.as_captured = as_captured  # the compiled module's graphs run uncompiled inside it
        self.describe = describe  # the graphs of the last call and the regions in use
        self.pending = True
        self.checked = 0

    def run(self, eager: Callable[[], object], compiled: Callable[[], object]) -> object:
        """A checked step: ``eager`` (the module on the step's inputs), ``compiled`` as captured,
        then ``compiled`` for real, whose output is returned."""
        state = _State(self.module)
        with compat.random_ops_seen() as random_ops:
            # A forward that raises eagerly raises here, its effects kept as one call's: the
            # check stays pending (a user's error on a first batch is the user's to see).
            want = _leaves(eager())
        state.restore()
        try:
            with self.as_captured():
                captured = _leaves(compiled())
        finally:
            state.restore()
        out = compiled()
        self.pending = False
        self.checked += 1
        low = any(t is not None and t.dtype in _HALF for t in want) or any(
            p.dtype in _HALF for p in self.module.parameters()
        )
        tol = self.tolerance or (2e-2 if low else None)
        findings = [f"as captured (uncompiled): {d}" for d in _differences(captured, want, tol or 1e-4)]
        compared = not (random_ops.drew and self.backend == "inductor")
        if compared:
            findings += [f"compiled: {d}" for d in _differences(_leaves(out), want, tol or 1e-3)]
        if findings:
            self._fail(findings)
        log.debug(
            "forward check %d passed (%s)",
            self.checked,
            "captured and compiled"
            if compared
            else "captured; the compiled forward draws its own random numbers",
        )
        return out

    def _fail(self, findings: list[str]) -> None:
        captured = any(f.startswith("as captured") for f in findings)
        why = (
            "TorchDynamo's capture of this model does not do what its code does eagerly (run uncompiled, "
            "the captured graphs give other values)"
            if captured
            else "the compiler's code for this model gives other values than eager for these inputs"
        )
        fix = (
            "Capture without nested compile regions: wrap(..., regions=False)"
            if captured
            else "Walk the debugging ladder (wrap(..., backend='aot_eager'), then 'eager'; distcompile.doctor runs it)"
        )
        raise VerificationError(
            f"the first-step forward check found the compiled model wrong: {why}.\n  "
            + "\n  ".join(findings[:8])
            + f"\n{self.describe()}\n{fix}. wrap(..., verify=True) checks gradients too and names the "
            "parameter; verify=False turns the check off (docs/debugging.md, 'First-step checks')."
        )
