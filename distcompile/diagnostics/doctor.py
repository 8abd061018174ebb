"""``distcompile.doctor``: the eager -> aot_eager -> inductor ladder against eager DDP, on every rank."""

from __future__ import annotations

import copy
import json
import logging
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
from .._log import enable_progress
from .._store import counted, gather
from ..capture.regions import has_repeated_blocks
from ..errors import ConfigError, UnsupportedModelError
from ..runtime.checkpoint import rng_state
from ..runtime.collectives import agreed_token, group_device
from ..runtime.ops_seen import numpy_drew
from ._ladder import Ladder, StageResult, compare

__all__ = ["doctor", "DoctorReport", "StageResult"]

log = logging.getLogger(__name__)
#: Where the first failing stage points, and what to train with meanwhile.
_MEANING = {
    "eager": (
        "TorchDynamo's capture or distcompile's split of it: check the model under plain "
        "torch.compile(model, backend='eager'); distcompile.explain(model, *inputs) shows the graphs"
    ),
    "aot_eager": (
        "AOTAutograd (the traced backward, functionalization): train with backend='eager' meanwhile"
    ),
    "inductor": "Inductor's generated code: train with backend='aot_eager' meanwhile",
}

_RANDOM_NOTE = (
    "the model draws random numbers (dropout?): every stage replays the reference's RNG state at "
    "each step, and Inductor draws from eager's generator under verify (fallback_random), because "
    "its own random numbers differ from eager's by design (training with them is fine)"
)
_NUMPY_NOTE = (
    "the model draws from NumPy's global generator: where TorchDynamo traces those calls into a graph "
    "it draws from torch's generator instead (torch._dynamo.config.use_numpy_random_stream=False, its "
    "default), so a stage can differ from eager DDP by its draws alone; set it to True to compare them"
)


@dataclass(slots=True)
class DoctorReport:
    """What :func:`doctor` found; ``print()`` it.

    Attributes:
        stages: Stages run, in order (every stage runs, whatever an earlier one did).
        results: Stage -> one :class:`StageResult` per rank; a failing stage retried
            without regions appears as ``"<stage>, regions=False"`` too.
        first_bad_stage: The first stage that crashed, diverged or disagreed, or ``None``.
        ranks_agree: Whether every stage left identical parameters and gradients on every rank.
        steps: Optimizer steps each run trained.
        rtol: Relative tolerance used.
        atol: Absolute tolerance used.
        notes: What the comparison took into account (e.g. random numbers in the model).
    """

    stages: list[str]
    results: dict[str, list[StageResult]] = field(default_factory=dict)
    first_bad_stage: str | None = None
    ranks_agree: bool = True
    steps: int = 3
    rtol: float = 1e-3
    atol: float = 1e-5
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.first_bad_stage is None

    def __str__(self) -> str:
        lines = [
            f"distcompile doctor: {self.steps} optimizer step(s) per stage against eager DDP "
            f"(losses, gradients, parameters, buffers; rtol {self.rtol:g}, atol {self.atol:g})"
        ]
        for stage, results in self.results.items():
            lines.extend(f"  {stage:<9} rank {r.rank}: {r.status:<8} {_detail(r)}" for r in results)
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append(
            "ranks agree: "
            + ("yes" if self.ranks_agree else "NO: parameters or gradients differ between ranks")
        )
        bad = self.first_bad_stage
        if bad is None:
            lines.append("all stages match eager DDP")
            return "\n".join(lines)
        lines.append(f"first failing stage: {bad} ({_MEANING.get(bad, '')})")
        good = [s for s in self.stages if s != bad and _fine(self.results.get(s, []))]
        if good:
            lines.append(f"stages that match eager DDP: {', '.join(good)}")
        retry = self.results.get(f"{bad}, regions=False")
        if retry is not None:
            verdict = (
                "matches eager DDP: train with wrap(..., regions=False)" if _fine(retry) else "fails too"
            )
            lines.append(f"{bad} without regions (repeated blocks traced one by one) {verdict}")
        first = next((r for r in self.results[bad] if r.status != "ok" and r.error), None)
        if first is not None:
            lines.append(f"rank {first.rank} error:\n{first.error.rstrip()}")
        return "\n".join(lines)


def _fine(results: Sequence[StageResult]) -> bool:
    digests = {r.param_digest for r in results}
    return bool(results) and all(r.status == "ok" for r in results) and len(digests) == 1


def _detail(r: StageResult) -> str:
    if r.status in ("crashed", "missing") or r.loss is None:
        return (r.summary or "") + (f" (after {r.steps_run} step(s))" if r.steps_run else "")
    text = f"loss {r.loss:.6g} vs {r.ref_loss:.6g}, max |grad diff| {r.max_abs_diff:.2e}"
    text += f" ({r.worst_param})" if r.worst_param else ""
    if r.max_param_diff is not None:
        text += f", max |param diff| {r.max_param_diff:.2e}" + (
            f" ({r.worst_weight})" if r.worst_weight else ""
        )
    if r.bad_buffers:
        text += f", buffers differ: {', '.join(r.bad_buffers[:3])}"
    return text + (f"; {r.summary}" if r.summary else "")


def _exchange(
    store: dist.Store, key: str, mine: StageResult, world: int, timeout_s: float
) -> list[StageResult]:
    found = gather(
        counted(store, "doctor"),
        key,
        json.dumps(asdict(mine)),
        rank=mine.rank,
        ranks=range(world),
        timeout_s=timeout_s,
    )
    out = []
    for r, text in found.items():
        if text is None:
            msg = f"rank {r} did not report within {timeout_s:.0f} s (died or hung)"
            out.append(StageResult(stage=mine.stage, rank=r, status="missing", error=msg, summary=msg))
        else:
            out.append(StageResult(**json.loads(text)))
    return out


def _model_and_cap(model: nn.Module) -> tuple[nn.Module, float]:
    if not dist.is_initialized():
        raise ConfigError("distcompile.doctor runs on every rank: call init_process_group() first.")
    inner = model.module if isinstance(model, DDP) else model
    if not isinstance(inner, nn.Module):
        raise UnsupportedModelError(
            f"doctor expects a torch.nn.Module or DDP model, got {type(model).__name__}."
        )
    return inner, (model.bucket_bytes_cap / 2**20 if isinstance(model, DDP) else 25.0)


def _sgd(params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2)


def doctor(
    model: nn.Module,
    *example_inputs: object,
    loss_fn: Callable[[object], torch.Tensor],
    stages: Sequence[str] = BACKENDS,
    steps: int = 3,
    optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer] | None = None,
    rtol: float = 1e-3,
    atol: float = 1e-5,
    timeout_s: float = 120.0,
    **example_kwargs: object,
) -> DoctorReport:
    """Train a few steps per backend on every rank and compare with eager DDP.

    Call it on every rank (after ``init_process_group``), with the model's inputs as
    positional and keyword arguments, as for ``explain``. Eager DDP trains a copy of the
    model ``steps`` optimizer steps on those inputs (each rank its own), then each stage
    trains another copy under ``distcompile.wrap(..., backend=stage, verify=True)`` the same
    way, drawing the same random numbers at each step. A stage matches when its losses,
    every step's synchronized gradients, and the parameters and buffers after the last
    step are ``allclose`` (``rtol``/``atol``) to the reference's, its first step passes the
    self-check (Note [First-step self-check]), and every rank ends with the same
    parameters. Every stage runs even when an earlier one crashed; a stage that fails on a
    model with repeated blocks is tried again with ``regions=False``, and the report says
    whether that fixes it. Ranks exchange outcomes through the store with ``timeout_s`` and
    communicate through a process group with that timeout, so a dead rank is reported
    instead of hanging the others.

    ``optimizer`` builds the optimizer from a parameter list (default SGD, lr 1e-2; with
    Adam a one-ulp difference in a near-zero gradient becomes a visible step, so compare
    with a looser ``rtol`` there).

    Example:
        >>> # report = distcompile.doctor(DDP(model), x, loss_fn=lambda out: out.square().mean())
        >>> # report = distcompile.doctor(DDP(hf_model), **batch, loss_fn=lambda out: out.loss)
        >>> # print(report)            # on rank 0, say
    """
    inner, cap_mb = _model_and_cap(model)
    if steps < 1:
        raise ConfigError(f"doctor(steps={steps!r}) must train at least 1 step.")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = default_store()
    # Keys drawn for this run (a collective), not counted per process: ranks cannot drift apart.
    token = agreed_token(src=0, group=None, device=group_device(None, list(inner.parameters())))
    key = f"distcompile/doctor/{token:016x}"
    enable_progress(rank=rank, first_rank=rank == 0)
    lad = Ladder(
        copy.deepcopy(inner),
        cap_mb,
        example_inputs,
        example_kwargs,
        loss_fn,
        optimizer or _sgd,
        steps,
        timeout_s,
    )

    def group() -> dist.ProcessGroup:  # each run its own: a crash mid-collective spoils only its own
        return dist.new_group(timeout=timedelta(seconds=timeout_s))

    log.info("doctor: eager DDP reference, %d step(s)", steps)
    ref = lad.reference(group())
    report = DoctorReport(stages=list(stages), steps=steps, rtol=rtol, atol=atol)
    report.notes += _notes([*ref.rngs, rng_state()])  # before each step, and after the last
    retry = has_repeated_blocks(inner)
    for stage in stages:
        for regions in (True, False) if retry else (True,):
            name = stage if regions else f"{stage}, regions=False"
            log.info("doctor: stage %s (compiling)", name)
            run, error = lad.stage(stage, group(), ref, regions=regions)
            mine = compare(name, rank, run, ref, error, rtol, atol)
            report.results[name] = _exchange(store, f"{key}/{name}", mine, world, timeout_s)
            if _fine(report.results[name]):
                break
    for stage in stages:
        results = report.results[stage]
        if len({(r.param_digest, r.grad_digest) for r in results if r.status in ("ok", "diverged")}) > 1:
            report.ranks_agree = False
        if report.first_bad_stage is None and not _fine(results):
            report.first_bad_stage = stage
    return report


def _notes(states: list[dict]) -> list[str]:
    """What the comparison took into account, from the reference's RNG states (``rng_state``)."""
    pairs = list(zip(states, states[1:]))
    notes = []
    if any(not torch.equal(a[k], b[k]) for a, b in pairs for k in ("torch", "cuda") if k in a):
        notes.append(_RANDOM_NOTE)
    if any(numpy_drew(a, b) for a, b in pairs) and compat.numpy_random_from_torch():
        notes.append(_NUMPY_NOTE)
    return notes
