"""``distcompile.doctor``: the eager -> aot_eager -> inductor ladder against eager DDP, on every rank."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import _torch_compat as compat
from .._agreement import default_store
from .._config import BACKENDS
from .._errors import ConfigError, UnsupportedModelError
from .._log import enable_progress
from .._wrap import wrap
from ..capture.graph import own_forward_code
from ..runtime.checkpoint import rng_state, set_rng_state

__all__ = ["doctor", "DoctorReport", "StageResult"]

log = logging.getLogger(__name__)
#: Store keys of each doctor run: a per-process counter, so every rank must call doctor the
#: same number of times, in the same order (it is a collective).
_doctor_ids = itertools.count()


@dataclass(slots=True)
class StageResult:
    """One rank's outcome of one stage.

    Attributes:
        stage: The backend tried.
        rank: Global rank.
        status: ``"ok"``, ``"diverged"`` (loss or gradients beyond tolerance), ``"crashed"``
            (raised), or ``"missing"`` (did not report in time: died or hung).
        loss: This stage's loss.
        ref_loss: Eager DDP's loss on the same inputs.
        max_abs_diff: Largest gradient difference to eager DDP.
        worst_param: The parameter with that difference.
        grad_digest: Hash of all gradients after synchronization (equal on agreeing ranks).
        error: Exception type, message and the last frames, if it crashed.
        summary: One line: the exception type and the first line of its message.
    """

    stage: str
    rank: int
    status: str
    loss: float | None = None
    ref_loss: float | None = None
    max_abs_diff: float | None = None
    worst_param: str | None = None
    grad_digest: str | None = None
    error: str | None = None
    summary: str | None = None


@dataclass(slots=True)
class DoctorReport:
    """What :func:`doctor` found; ``print()`` it.

    Attributes:
        stages: Stages run, in order (the ladder stops at the first bad one).
        results: Stage -> one :class:`StageResult` per rank.
        first_bad_stage: The first stage that crashed, diverged or disagreed, or ``None``.
        ranks_agree: Whether every stage left identical gradients on every rank.
        rtol: Relative tolerance used.
        atol: Absolute tolerance used.
        notes: What the comparison took into account (e.g. random numbers in the model).
    """

    stages: list[str]
    results: dict[str, list[StageResult]] = field(default_factory=dict)
    first_bad_stage: str | None = None
    ranks_agree: bool = True
    rtol: float = 1e-3
    atol: float = 1e-5
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.first_bad_stage is None

    def __str__(self) -> str:
        lines = [
            f"distcompile doctor: one step per stage against eager DDP (rtol {self.rtol:g}, atol {self.atol:g})"
        ]
        for stage in self.stages:
            for r in self.results.get(stage, []):
                detail = ""
                if r.status in ("ok", "diverged") and r.loss is not None:
                    detail = (
                        f"loss {r.loss:.6g} vs {r.ref_loss:.6g}, max |grad diff| {r.max_abs_diff:.2e}"
                        + (f" ({r.worst_param})" if r.worst_param else "")
                    )
                elif r.summary or r.error:
                    detail = r.summary or r.error.strip().splitlines()[-1]
                lines.append(f"  {stage:<9} rank {r.rank}: {r.status:<8} {detail}")
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append("ranks agree: " + ("yes" if self.ranks_agree else "NO: gradients differ between ranks"))
        if self.first_bad_stage:
            lines.append(f"first failing stage: {self.first_bad_stage}")
            bad = [r for r in self.results[self.first_bad_stage] if r.status != "ok"]
            if bad and bad[0].error:
                lines.append(f"rank {bad[0].rank} error:\n{bad[0].error.rstrip()}")
        else:
            lines.append("all stages match eager DDP")
        return "\n".join(lines)


def _step(
    model: nn.Module, args: Sequence[object], kwargs: dict, loss_fn: Callable, rng: dict
) -> tuple[float, dict[str, torch.Tensor]]:
    # Every stage draws the same random numbers as the reference (dropout masks).
    set_rng_state(rng)
    loss = loss_fn(model(*args, **kwargs))
    loss.backward()
    inner = model.module
    grads = {n: p.grad.detach().clone() for n, p in inner.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _digest(grads: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(grads):
        h.update(n.encode())
        h.update(grads[n].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _exchange(
    store: dist.Store, key: str, mine: StageResult, world: int, timeout_s: float
) -> list[StageResult]:
    store.set(f"{key}/{mine.rank}", json.dumps(asdict(mine)))
    out = []
    for r in range(world):
        try:
            store.wait([f"{key}/{r}"], timedelta(seconds=timeout_s))
            out.append(StageResult(**json.loads(store.get(f"{key}/{r}"))))
        except Exception:  # noqa: BLE001 - a timeout: the rank died or hangs
            msg = f"rank {r} did not report within {timeout_s:.0f} s (died or hung)"
            out.append(StageResult(stage=mine.stage, rank=r, status="missing", error=msg, summary=msg))
    return out


_RANDOM_NOTE = (
    "the model draws random numbers (dropout?): every stage starts from the reference's RNG "
    "state, and the inductor stage compiles with torch._inductor.config.fallback_random=True, "
    "because Inductor's own random numbers differ from eager's by design (training with it is "
    "fine; its losses just differ from eager DDP's by the different dropout masks)"
)


def _model_and_cap(model: nn.Module) -> tuple[nn.Module, float]:
    if not dist.is_initialized():
        raise ConfigError("distcompile.doctor runs on every rank: call init_process_group() first.")
    inner = model.module if isinstance(model, DDP) else model
    if not isinstance(inner, nn.Module):
        raise UnsupportedModelError(
            f"doctor expects a torch.nn.Module or DDP model, got {type(model).__name__}."
        )
    return inner, (model.bucket_bytes_cap / 2**20 if isinstance(model, DDP) else 25.0)


def doctor(
    model: nn.Module,
    *example_inputs: object,
    loss_fn: Callable[[object], torch.Tensor],
    stages: Sequence[str] = BACKENDS,
    rtol: float = 1e-3,
    atol: float = 1e-5,
    timeout_s: float = 120.0,
    **example_kwargs: object,
) -> DoctorReport:
    """Run one training step per backend on every rank and compare with eager DDP.

    Call it on every rank (after ``init_process_group``), with the model's inputs as
    positional and keyword arguments, as for ``explain``. Each stage trains a fresh copy
    of the model with ``distcompile.wrap(..., backend=stage)`` on those inputs (each rank
    its own) and compares loss and synchronized gradients with eager DDP (``allclose``
    with ``rtol``/``atol``). The reference and every stage start from the same random
    number state (CPU and CUDA), so dropout draws the same masks. Inductor generates its
    own random numbers, which differ from eager's by design; when the model draws random
    numbers, the inductor stage compiles with ``torch._inductor.config.fallback_random``
    (eager's generator) so the comparison says whether the compiled math is right, and
    the report says so. The ladder stops at the first stage that crashes, diverges, or
    leaves ranks with different gradients. Ranks exchange outcomes through the store
    with ``timeout_s``, and communicate through a process group with that timeout, so a
    dead rank is reported instead of hanging the others.

    Example:
        >>> # report = distcompile.doctor(DDP(model), x, loss_fn=lambda out: out.square().mean())
        >>> # report = distcompile.doctor(DDP(hf_model), **batch, loss_fn=lambda out: out.loss)
        >>> # print(report)            # on rank 0, say
    """
    inner, cap_mb = _model_and_cap(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    store = default_store()
    key = f"distcompile/doctor{next(_doctor_ids)}"
    enable_progress(rank=rank, first_rank=rank == 0)
    pristine = copy.deepcopy(inner)
    rng = rng_state()

    log.info("doctor: eager DDP reference step")
    ref_loss, ref_grads = _step(
        DDP(copy.deepcopy(pristine), process_group=group, bucket_cap_mb=cap_mb),
        example_inputs,
        example_kwargs,
        loss_fn,
        rng,
    )
    after = rng_state()  # did the step draw random numbers?
    random = any(not torch.equal(after[k], rng[k]) for k in ("torch", "cuda") if k in rng)

    report = DoctorReport(stages=[], rtol=rtol, atol=atol)
    if random:
        report.notes.append(_RANDOM_NOTE)
    ladder = _Ladder(
        pristine,
        group,
        cap_mb,
        example_inputs,
        example_kwargs,
        loss_fn,
        rng,
        ref_loss,
        ref_grads,
        random,
        rtol,
        atol,
    )
    for stage in stages:
        report.stages.append(stage)
        log.info("doctor: stage %s (compiling)", stage)
        mine = _run_stage(ladder, stage, rank=rank, timeout_s=timeout_s)
        results = _exchange(store, f"{key}/{stage}", mine, world, timeout_s)
        report.results[stage] = results
        digests = {r.grad_digest for r in results if r.status in ("ok", "diverged")}
        if len(digests) > 1:
            report.ranks_agree = False
        if any(r.status != "ok" for r in results) or len(digests) > 1:
            report.first_bad_stage = stage
            break
    return report


@dataclass
class _Ladder:
    """What every stage of the ladder shares: the model, its inputs, and the reference step."""

    pristine: nn.Module
    group: dist.ProcessGroup
    cap_mb: float
    example_inputs: tuple
    example_kwargs: dict
    loss_fn: Callable[[object], torch.Tensor]
    rng: dict
    ref_loss: float
    ref_grads: dict[str, torch.Tensor]
    random: bool
    rtol: float
    atol: float


def _run_stage(ladder: _Ladder, stage: str, *, rank: int, timeout_s: float) -> StageResult:
    """One training step of a fresh copy under ``wrap(backend=stage)``, compared with the reference."""
    lad = ladder
    try:
        # A private forward code object: the ladder's compiles must not pile cache
        # entries (and guard checks) onto the code of the user's own model.
        copy_ = own_forward_code(copy.deepcopy(lad.pristine), f"doctor_{stage}")
        ddp = DDP(copy_, process_group=lad.group, bucket_cap_mb=lad.cap_mb)
        same_random = lad.random and stage == "inductor"
        with compat.inductor_fallback_random() if same_random else contextlib.nullcontext():
            wrapped = wrap(ddp, backend=stage, desync_timeout_s=timeout_s)
            loss, grads = _step(wrapped, lad.example_inputs, lad.example_kwargs, lad.loss_fn, lad.rng)
        wrapped.close()
    except Exception as exc:  # noqa: BLE001 - the report carries it
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-4))
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return StageResult(stage, rank, "crashed", error=tb, summary=f"{type(exc).__name__}: {first_line}")
    ref = lad.ref_grads
    diffs = {n: float((grads[n] - g).abs().max()) for n, g in ref.items() if n in grads}
    worst = max(diffs, key=diffs.get, default=None)
    close = (
        set(grads) == set(ref)
        and all(torch.allclose(grads[n], g, rtol=lad.rtol, atol=lad.atol) for n, g in ref.items())
        and abs(loss - lad.ref_loss) <= lad.atol + lad.rtol * abs(lad.ref_loss)
    )
    return StageResult(
        stage,
        rank,
        "ok" if close else "diverged",
        loss,
        lad.ref_loss,
        diffs.get(worst, 0.0) if worst else 0.0,
        worst,
        _digest(grads),
    )
