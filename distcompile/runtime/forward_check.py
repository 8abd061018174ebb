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

    1. eagerly, the module itself, on copies of its buffers: the reference, whose autograd
       graph is kept for the gradients;
    2. as captured: TorchDynamo's code with each graph run as its FX graph, uncompiled
       (eager kernels, eager random numbers, in the graph's order), so it must match the
       reference to rounding whatever the forward draws at random. A difference means the
       capture is wrong (a region reused for a block it does not fit, a trace that does
       not do what the code does);
    3. compiled: the step's real forward, whose outputs are returned. It is compared with
       the reference unless the forward drew random numbers (during 1, the random number
       generators moved: ``ops_seen.py``) and the backend is Inductor, whose random numbers
       are its own; a difference means the compiler is wrong for these inputs.

    Outputs are compared as ``verify`` compares them: ``max|x - ref| <= tol * max|ref|``,
    ``tol`` 1e-4 for the captured forward and 1e-3 for the compiled one (both 2e-2 when any
    of the forward runs in float16, 1e-1 in bfloat16: half-precision parameters, autocast
    around the model or inside its forward, as ``OpsSeen`` sees during 1;
    ``compare.ROUNDED_TOLERANCE``), or ``verify_tolerance``.
    A difference raises :class:`~distcompile.VerificationError` on the rank that saw it,
    naming the graphs of the call, the regions in use and the fixes; its peers, waiting in
    the step's all-reduce, name it in their error (``_agreement.mark_failed``).

    Gradients: each output of the compiled forward gets a tap that records the gradient
    reaching it; each trainable parameter a post-accumulate hook that records what its
    ``.grad`` gained in the backward, and the forward's autograd nodes hooks that record
    what they alone sent it (Note [Gradients by their source]: a penalty on a weight in the
    loop, a temperature read in the loss or a second forward adds to ``.grad`` too). When
    the ``backward()`` that writes ``.grad`` ends (an ``autograd.grad`` call before it is
    let pass), the reducer finishes the step (every rank completes its all-reduces), then
    eager's gradients for the same output gradients (``torch.autograd.grad`` on the
    reference) are compared with both, within the output tolerance of each parameter's
    largest eager gradient (at least 1% of the median of those): a parameter is wrong when
    neither matches. Not compared: Inductor with random numbers, parameters whose gradient
    travels in parts (Note [Shared weights reduced by use]), sparse gradients.

    Put back between runs (``module_state.py``): each module's buffer entries by identity and
    value (a buffer the forward resized, assigned anew or registered included), plain
    attributes (a tensor among them in place) and the random number state. Runs 1 and 2 get
    copies of the input tensors (``fresh_inputs``): a forward may update its input in place.
    A state that cannot be copied makes the check step aside (one log line).

Cost
    Two more forwards and one eager backward in the checked steps only (the first step,
    and the first after each recompile), and the eager forward's activations held until
    the compiled backward ends; other steps pay one ``if``. Measured: 3.3% of a cold first
    step on the benchmark GPT (``benchmarks/results/2026-11-27-forward-check-cost.md``).
    What cannot be put back: side effects outside the module (a global counter, a print)
    happen three times in a checked step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
from collections.abc import Callable, Mapping

import torch
from torch import nn

from .. import _torch_compat as compat
from ..errors import VerificationError
from .bucket import as_real
from .compare import HIGHER_ORDER, inexact, max_abs, max_diff, rounded_tolerance, saved_hooks_note
from .grad_sources import GradSources
from .module_state import ModuleState, fresh_inputs
from .ops_seen import OpsSeen
from .verify import GradTap

__all__ = ["ForwardCheck"]

log = logging.getLogger(__name__)


def _leaves(out: object) -> list[torch.Tensor | None]:
    return [t.detach() if isinstance(t, torch.Tensor) else None for t in compat.tree_leaves(out)]


def _differences(got: list, want: list, tol: float) -> list[str]:
    if len(got) != len(want):
        return [f"the forward returned {len(got)} values, eager {len(want)}"]
    found = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None or b is None or a.shape != b.shape or not inexact(b):
            continue
        diff, scale = max_diff(a, b), max(max_abs(b), 1e-6)
        if not diff <= tol * scale:  # NaN fails too
            found.append(
                f"output {i} differs from eager's by {diff:.3g} (scale {scale:.3g}, tolerance {tol:.0e})"
            )
    return found


class _Seen:
    """One checked step's gradients: the eager outputs, what reached the compiled outputs in the
    running backward, and what each parameter got (``sources``: known only in a backward that
    accumulates; ``autograd.grad`` calls before it are let pass)."""

    def __init__(self, leaves: list, tol: float) -> None:
        self.leaves = leaves
        self.tol = tol
        self.out_grads: dict[int, torch.Tensor] = {}
        self.sources: GradSources | None = None
        self.queued = False
        self.higher = False  # a backward with create_graph=True reached the outputs


def _differentiable(t: object, grad: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.shape == grad.shape


def _gradient_differences(
    names: list[str], want: tuple, got: Mapping[str, torch.Tensor], tol: float
) -> dict[str, str]:
    """Parameters whose compiled gradient is not eager's within ``tol`` of its scale (the
    largest eager gradient, at least 1% of the median of those over the model), each with
    what differs. A complex gradient is compared by its real and imaginary parts.

    Example:
        >>> want = (torch.tensor([1 + 1j]),)
        >>> _gradient_differences(["w"], want, {"w": torch.tensor([1 - 1j])}, 1e-3)
        {'w': "gradient of w differs from eager's by 2 (scale 1.41; 0x eager's)"}
    """
    pairs = [(n, w) for n, w in zip(names, want) if w is None or not w.is_sparse]  # sparse: reduced apart
    maxima = [float(w.abs().max()) for _, w in pairs if w is not None and w.numel()]
    floor = 0.01 * statistics.median([m for m in maxima if m > 0] or [0.0]) or 1e-12
    found = {}
    for n, w in pairs:
        g = got.get(n)
        if w is None or g is None:
            if (w is None) != (g is None) and (w if w is not None else g).abs().max() > 0:
                found[n] = f"{n}: {'eager' if g is None else 'the compiled step'} alone has a gradient"
            continue
        diff, scale = max_diff(g, w), max(max_abs(w), floor)
        if not diff <= tol * scale:
            g, w = as_real(g).float().flatten(), as_real(w).float().flatten()
            ratio = float(g @ w / max(float(w.square().sum()), 1e-30))
            found[n] = (
                f"gradient of {n} differs from eager's by {diff:.3g} (scale {scale:.3g}; {ratio:.3g}x eager's)"
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
        params: Mapping[str, nn.Parameter] | None = None,
        settle: Callable[[], None] = lambda: None,
        parted: Callable[[], set[int]] = set,
    ) -> None:
        self.module = module
        self.params = dict(params or {})  # the trainable parameters whose gradients are compared
        self.settle = settle  # the reducer's end of step, before a mismatch raises
        self.parted = parted  # ids of parameters whose uses' gradients travel apart (not compared)
        self.backend = backend
        self.tolerance = tolerance
        self.as_captured = as_captured  # the compiled module's graphs run uncompiled inside it
        self.describe = describe  # the graphs of the last call and the regions in use
        self.pending = True
        self.checked = 0
        self.note = ""  # what a failure adds (compare.saved_hooks_note), as of the checked forward

    def run(
        self, eager: Callable[..., object], compiled: Callable[..., object], args: tuple, kwargs: dict
    ) -> object:
        """A checked step: ``eager(args, kwargs)`` (the module on the step's inputs), ``compiled``
        as captured, then ``compiled`` for real, whose output is returned. The first two run on
        copies of the input tensors (``fresh_inputs``), the real one on the caller's."""
        try:
            state = ModuleState(self.module, (args, kwargs))
        except Exception as exc:  # noqa: BLE001 - a state that cannot be copied: no check, no harm
            log.info(
                "forward check: skipped, the model's state cannot be copied to run it three times (%s: %s)",
                type(exc).__name__,
                exc,
            )
            self.pending = False
            return compiled(args, kwargs)
        with OpsSeen(watch=state.watched()) as ops, state.copies():
            # A forward that raises eagerly raises here, its effects kept as one call's: the
            # check stays pending (a user's error on a first batch is the user's to see).
            reference = eager(*fresh_inputs((args, kwargs)))
        state.written = ops.written  # parameters the forward writes in place: put back too
        state.restore()
        unreplayable = ops.unreplayable()
        if unreplayable:
            log.info("forward check: skipped, %s", unreplayable)
            self.pending = False
            return compiled(args, kwargs)
        want = _leaves(reference)
        try:
            with self.as_captured():
                captured = _leaves(compiled(*fresh_inputs((args, kwargs))))
        finally:
            state.restore()
        mark = compat.node_order()  # the compiled forward's autograd nodes come after it
        self.note = saved_hooks_note()
        out = compiled(args, kwargs)
        self.pending = False
        self.checked += 1
        # 16 bits anywhere (an autocast region inside, half parameters or outputs): their rounding.
        dtypes = {*ops.sixteen_bit, *(t.dtype for t in want if t is not None)}
        tol = self.tolerance or rounded_tolerance(dtypes | {p.dtype for p in self.module.parameters()})
        findings = [f"as captured (uncompiled): {d}" for d in _differences(captured, want, tol or 1e-4)]
        compared = not (ops.drew and self.backend == "inductor")
        if compared:
            findings += [f"compiled: {d}" for d in _differences(_leaves(out), want, tol or 1e-3)]
        if findings:
            self._fail(findings)
        if compared and torch.is_grad_enabled() and self.params:
            out = self._watch_gradients(reference, out, tol or 1e-3, mark)
        log.debug(
            "forward check %d passed (%s)",
            self.checked,
            "captured and compiled"
            if compared
            else "captured; the compiled forward draws its own random numbers",
        )
        return out

    def _watch_gradients(self, reference: object, out: object, tol: float, mark: int) -> object:
        """``out`` with a tap on each output; when ``backward()`` ends, the gradients it gave
        each parameter are compared with the eager forward's for the same output gradients
        (``mark``: ``compat.node_order`` before the compiled forward)."""
        leaves = compat.tree_leaves(reference)
        if len(leaves) != len(compat.tree_leaves(out)):
            return out
        seen = _Seen(leaves, tol)
        seen.sources = GradSources(
            compat.tree_leaves(out),
            self.params,
            since=mark,
            abandoned=lambda: log.info(
                "forward check: gradients not compared, the checked forward got no backward"
            ),
        )
        index = iter(range(len(leaves)))

        def tap(t: object) -> object:
            i = next(index)
            if not (isinstance(t, torch.Tensor) and t.requires_grad):
                return t
            return GradTap.apply(t, functools.partial(self._output_grad, seen, i))

        return compat.tree_map_only(object, tap, out)

    def _output_grad(self, seen: _Seen, index: int, grad: torch.Tensor | None) -> None:
        seen.higher = seen.higher or torch.is_grad_enabled()  # grad mode on in backward: create_graph
        if grad is not None:
            seen.out_grads[index] = grad.detach()
        if not seen.queued:
            seen.queued = True
            assert seen.sources is not None
            seen.sources.reached()
            compat.queue_engine_callback(functools.partial(self._compare_gradients, seen))

    def _compare_gradients(self, seen: _Seen) -> None:
        sources = seen.sources
        assert sources is not None
        if not sources.wrote:  # autograd.grad (no .grad written): wait for the backward that writes
            seen.queued = False
            seen.out_grads.clear()
            sources.clear()
            return
        sources.remove()
        if seen.higher:
            log.info("forward check: gradients not compared, %s", HIGHER_ORDER)
            return
        self.settle()  # the step's all-reduces complete on every rank before this one raises
        parted = self.parted()
        names = [n for n, p in self.params.items() if id(p) not in parted]
        pairs = [(seen.leaves[i], g) for i, g in seen.out_grads.items() if _differentiable(seen.leaves[i], g)]
        if not pairs or not names:
            return
        try:
            want = torch.autograd.grad(
                [t for t, _ in pairs],
                [self.params[n] for n in names],
                [g for _, g in pairs],
                allow_unused=True,
            )
        except RuntimeError as exc:  # the eager graph cannot be differentiated again here
            log.info("forward check: gradients not compared (%s)", " ".join(str(exc).split())[:200])
            return
        # Wrong when neither what .grad gained nor what the forward's nodes sent is eager's
        # (Note [Gradients by their source]).
        gained = _gradient_differences(names, want, sources.gained, seen.tol)
        sent = _gradient_differences(names, want, sources.sent, seen.tol) if gained else {}
        findings = [f for n, f in gained.items() if n in sent]
        if findings:
            self._fail([f"compiled backward: {f}" for f in findings])
        log.debug("forward check %d: gradients of %d parameters match eager's", self.checked, len(names))

    def _fail(self, findings: list[str]) -> None:
        captured = any(f.startswith("as captured") for f in findings)
        if captured:
            why = (
                "TorchDynamo's capture of this model does not do what its code does eagerly (run "
                "uncompiled, the captured graphs give other values)"
            )
        elif findings[0].startswith("compiled backward"):
            why = (
                "the compiled backward gives other gradients than eager's for the same output gradients "
                "(one known cause, a torch bug: a buffer written in forward and read after the write gets "
                "twice its gradient, AOTAutograd recomputing the read in backward after the write-back)"
            )
        else:
            why = "the compiler's code for this model gives other values than eager for these inputs"
        fix = (
            "Capture without nested compile regions: wrap(..., regions=False)"
            if captured
            else "Walk the debugging ladder (wrap(..., backend='aot_eager'), then 'eager'; distcompile.doctor runs it)"
        )
        raise VerificationError(
            f"the first-step forward check found the compiled model wrong: {why}.\n  "
            + "\n  ".join(findings[:8])
            + f"\n{self.describe()}\n{fix}. wrap(..., verify=True) checks gradients too and names the "
            f"parameter; verify=False turns the check off (docs/debugging.md, 'First-step checks').{self.note}"
        )
