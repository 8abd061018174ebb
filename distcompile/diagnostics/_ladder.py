"""The doctor's training runs: eager DDP for reference, then one run per stage, compared.

Every run starts from the same copy of the model, trains ``steps`` optimizer steps on the
same inputs, and draws the same random numbers at each step (the reference's RNG states,
replayed). A stage runs under ``wrap(..., backend=stage, verify=True)``, so its first step
is also checked from the inside (Note [First-step self-check]); what it ends with
(losses, each step's gradients, parameters, buffers) is compared with the reference's.
"""

from __future__ import annotations

import copy
import hashlib
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .._wrap import wrap
from ..capture.graph import own_forward_code
from ..errors import VerificationError
from ..runtime.bucket import as_real
from ..runtime.checkpoint import rng_state, set_rng_state
from ..runtime.compare import inexact, max_diff

__all__ = ["Ladder", "Run", "StageResult", "compare"]


@dataclass(slots=True)
class StageResult:
    """One rank's outcome of one stage.

    Attributes:
        stage: The backend tried (``"inductor, regions=False"`` for a retry without regions).
        rank: Global rank.
        status: ``"ok"``, ``"diverged"`` (a loss, gradient, parameter or buffer beyond
            tolerance, or the first-step self-check failed), ``"crashed"`` (raised), or
            ``"missing"`` (did not report in time: died or hung).
        loss: The stage's loss at the last step it ran.
        ref_loss: Eager DDP's loss at that step.
        max_abs_diff: Largest gradient difference to eager DDP over the steps.
        worst_param: The parameter with that difference.
        max_param_diff: Largest parameter difference to eager DDP after the last step.
        worst_weight: The parameter with that difference.
        bad_buffers: Buffers beyond tolerance after the last step.
        steps_run: Optimizer steps completed.
        grad_digest: Hash of the last step's synchronized gradients (equal on agreeing ranks).
        param_digest: Hash of the parameters after the last step (equal on agreeing ranks).
        error: Exception type, message and the last frames, if it crashed or failed the check.
        summary: One line: what went wrong.
    """

    stage: str
    rank: int
    status: str
    loss: float | None = None
    ref_loss: float | None = None
    max_abs_diff: float | None = None
    worst_param: str | None = None
    max_param_diff: float | None = None
    worst_weight: str | None = None
    bad_buffers: list[str] = field(default_factory=list)
    steps_run: int = 0
    grad_digest: str | None = None
    param_digest: str | None = None
    error: str | None = None
    summary: str | None = None


@dataclass
class Run:
    """What one training run left: per-step losses and gradients, final parameters and buffers."""

    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    rngs: list[dict] = field(default_factory=list)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(tensors):
        h.update(n.encode())
        h.update(as_real(tensors[n].detach()).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class Ladder:
    """What every run shares: the pristine model, its inputs, the loss and the optimizer."""

    pristine: nn.Module
    cap_mb: float
    example_inputs: tuple
    example_kwargs: dict
    loss_fn: Callable[[object], torch.Tensor]
    optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]
    steps: int
    timeout_s: float

    def train(self, model: nn.Module, inner: nn.Module, rngs: list[dict] | None, run: Run) -> None:
        """``steps`` steps of ``model``; replays ``rngs`` (else records them); fills ``run``."""
        opt = self.optimizer(list(model.parameters()))
        for step in range(self.steps):
            if rngs is None:
                run.rngs.append(rng_state())
            else:
                set_rng_state(rngs[step])
            loss = self.loss_fn(model(*self.example_inputs, **self.example_kwargs))
            loss.backward()
            run.losses.append(float(loss.detach()))
            run.grads.append(
                {n: p.grad.detach().clone() for n, p in inner.named_parameters() if p.grad is not None}
            )
            opt.step()
            opt.zero_grad()
        run.params = {n: p.detach().clone() for n, p in inner.named_parameters()}
        run.buffers = {n: b.detach().clone() for n, b in inner.named_buffers()}

    def reference(self, group: dist.ProcessGroup) -> Run:
        """Eager DDP's run (the RNG states of each step recorded)."""
        run = Run()
        inner = copy.deepcopy(self.pristine)
        self.train(DDP(inner, process_group=group, bucket_cap_mb=self.cap_mb), inner, None, run)
        return run

    def stage(
        self, stage: str, group: dist.ProcessGroup, ref: Run, *, regions: bool
    ) -> tuple[Run, Exception | None]:
        """The run under ``wrap(backend=stage, verify=True)``, and what it raised, if anything."""
        run = Run()
        # A private forward code object: the ladder's compiles must not pile cache entries
        # (and guard checks) onto the code of the user's own model.
        inner = own_forward_code(copy.deepcopy(self.pristine), f"doctor_{stage}_{regions}")
        wrapped = None
        try:
            ddp = DDP(inner, process_group=group, bucket_cap_mb=self.cap_mb)
            wrapped = wrap(ddp, backend=stage, verify=True, regions=regions, desync_timeout_s=self.timeout_s)
            self.train(wrapped, inner, ref.rngs, run)
        except Exception as exc:  # noqa: BLE001 - the report carries it
            return run, exc
        finally:
            if wrapped is not None:
                wrapped.close()
        return run, None


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    if not inexact(a):
        return torch.equal(a, b)
    return torch.allclose(as_real(a).float(), as_real(b).float(), rtol=rtol, atol=atol)


def _worst(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str | None]:
    diffs = {n: max_diff(ours[n], g) for n, g in ref.items() if n in ours and ours[n].shape == g.shape}
    worst = max(diffs, key=diffs.get, default=None)
    return (diffs[worst] if worst else 0.0), worst


def compare(
    stage: str, rank: int, run: Run, ref: Run, error: Exception | None, rtol: float, atol: float
) -> StageResult:
    """``run`` against the reference ``ref``: one :class:`StageResult`."""
    steps = len(run.losses)
    result = StageResult(stage, rank, "ok", steps_run=steps)
    if steps:
        result.loss, result.ref_loss = run.losses[-1], ref.losses[steps - 1]
        grad_diffs = [_worst(g, r) for g, r in zip(run.grads, ref.grads)]
        result.max_abs_diff, result.worst_param = max(grad_diffs, key=lambda d: d[0])
        result.grad_digest = _digest(run.grads[-1])
    if error is not None:
        tb = traceback.format_exception(type(error), error, error.__traceback__, limit=-4)
        result.error = "".join(tb)
        message = str(error).strip()
        if isinstance(error, VerificationError):  # the self-check at the first step
            found = message.partition("This rank found:")[2].strip().splitlines()
            result.status = "diverged"
            result.summary = "the first-step self-check failed: " + (found[0].strip() if found else message)
        else:
            result.status = "crashed"
            result.summary = f"{type(error).__name__}: {(message.splitlines() or [''])[0][:300]}"
        return result
    result.max_param_diff, result.worst_weight = _worst(run.params, ref.params)
    result.param_digest = _digest(run.params)
    result.bad_buffers = [
        n for n, b in ref.buffers.items() if n in run.buffers and not _close(run.buffers[n], b, rtol, atol)
    ]
    losses_ok = all(abs(a - b) <= atol + rtol * abs(b) for a, b in zip(run.losses, ref.losses))
    grads_ok = all(
        set(g) == set(r) and all(_close(g[n], r[n], rtol, atol) for n in r)
        for g, r in zip(run.grads, ref.grads)
    )
    params_ok = all(_close(run.params[n], p, rtol, atol) for n, p in ref.params.items() if n in run.params)
    if not (losses_ok and grads_ok and params_ok and not result.bad_buffers):
        result.status = "diverged"
        what = [
            w
            for w, ok in (("losses", losses_ok), ("gradients", grads_ok), ("parameters", params_ok))
            if not ok
        ]
        result.summary = (
            f"{', '.join(what + (['buffers'] if result.bad_buffers else []))} differ from eager DDP's"
        )
    return result
