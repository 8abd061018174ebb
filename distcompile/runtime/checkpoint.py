"""Atomic training checkpoints: a crash mid-write never costs the previous checkpoint.

One file per checkpoint, ``step-{step:08d}.pt``, written by rank 0 to a temporary name,
flushed to disk (``fsync``), then renamed into place (atomic on POSIX), and the directory
synced. Every rank's RNG state travels in the same file, so a resumed run draws the same
random numbers as an uninterrupted one.

With ``compile_artifacts=True`` rank 0 also writes ``step-{step:08d}.compile``, the same
way: its process's compile-cache entries and C++ kernel libraries (Note [Compiles shared
across cache folders]) under a hash and a build fingerprint. ``load_checkpoint`` installs
them into each rank's cache folder when they fit this machine, so a job resumed on fresh
nodes finds its compiled pieces in the cache.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import random
import re
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from .. import _events
from .. import _torch_compat as compat
from ..fleet import transfer

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state", "set_rng_state"]

log = logging.getLogger(__name__)
_NAME = re.compile(r"step-(\d{8})\.pt$")


def rng_state() -> dict:
    """This process's RNG states: torch CPU, Python's, NumPy's global one (when NumPy is
    installed: Hugging Face's speech models draw their SpecAugment masks from it in forward),
    and the current CUDA device once initialized.

    Example:
        >>> import numpy as np
        >>> state = rng_state(); a = np.random.rand(); set_rng_state(state); a == np.random.rand()
        True
    """
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (a checkpoint written before NumPy's state was
    kept restores the others)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np = _numpy()
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _numpy() -> ModuleType | None:
    try:
        import numpy
    except ImportError:  # an optional dependency
        return None
    return numpy


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(directory: str) -> str | None:
    """Path of the newest complete checkpoint in ``directory`` (temporary files are ignored).

    Example:
        >>> latest_checkpoint("/nonexistent") is None
        True
    """
    found = [p for p in glob.glob(os.path.join(directory, "step-*.pt")) if _NAME.search(p)]
    return max(found, key=lambda p: int(_NAME.search(p).group(1)), default=None)


def save_checkpoint(
    directory: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict | None = None,
    keep: int = 3,
    compile_artifacts: bool = False,
) -> str | None:
    """Save model, optimizer, step, every rank's RNG state and ``extra``; keep the last ``keep``.

    Call it on every rank at the same step (it gathers the RNG states); rank 0 writes.
    Returns the path on rank 0, ``None`` elsewhere. ``compile_artifacts=True`` also writes
    rank 0's compiled pieces beside it (``step-*.compile``), which ``load_checkpoint``
    installs: a job resumed on nodes with empty compile caches starts warm.

    Example:
        >>> # save_checkpoint("ckpt", model=model, optimizer=opt, step=step, extra={"epoch": 3})
        >>> # save_checkpoint("ckpt", model=model, optimizer=opt, step=step, compile_artifacts=True)
    """
    if keep < 1:
        raise ValueError(f"keep={keep!r} must be >= 1: the newest checkpoint is never deleted.")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = [rng_state()]
    if dist.is_initialized():
        rng = [None] * dist.get_world_size()
        dist.all_gather_object(rng, rng_state())
    if rank != 0:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step-{step:08d}.pt")
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": step,
        "rng": rng,
        "world_size": len(rng),
        "extra": extra or {},
    }
    _write_atomically(path, lambda f: torch.save(payload, f))
    if compile_artifacts:
        pieces = transfer.collect()
        sealed = transfer.seal(pieces, compat.build_fingerprint())
        _write_atomically(_artifacts_path(path), lambda f: f.write(sealed))
        log.info("compiled pieces written beside it: %.1f MB", len(sealed) / 1e6)
    _fsync_dir(directory)
    older = sorted(
        (p for p in glob.glob(os.path.join(directory, "step-*.pt")) if _NAME.search(p)),
        key=lambda p: int(_NAME.search(p).group(1)),
    )
    for old in older[:-keep]:
        os.remove(old)
        if os.path.exists(_artifacts_path(old)):
            os.remove(_artifacts_path(old))
    # A writer killed mid-write left its temporary file; only rank 0 writes, one checkpoint
    # at a time, so any temporary file left now is such a one.
    for stale in glob.glob(os.path.join(directory, "step-*.tmp-*")):
        with contextlib.suppress(OSError):
            os.remove(stale)
    log.info("checkpoint written: %s", path)
    _events.emit("checkpoint", step=step, path=path)
    return path


def _artifacts_path(checkpoint: str) -> str:
    return checkpoint[: -len(".pt")] + ".compile"


def _write_atomically(path: str, write: object) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)  # type: ignore[operator]
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _install_artifacts(checkpoint: str) -> None:
    """Install the compiled pieces saved beside ``checkpoint``, if any and if they fit here."""
    path = _artifacts_path(checkpoint)
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        payload, unusable = transfer.unseal(f.read(), compat.build_fingerprint())
    why: object = unusable
    try:
        if payload is not None:
            n = transfer.install(payload) if payload else 0
            log.info("compiled pieces from %s installed in the compile cache (%d entries)", path, n)
            return
    except Exception as exc:  # noqa: BLE001 - the pieces are compiled instead, never wrong
        why = f"{type(exc).__name__}: {exc}"
    log.warning("compiled pieces in %s not installed: %s; the first step compiles them", path, why)


def _match_prefix(state: dict, model: nn.Module) -> dict:
    # Checkpoints of a wrapped (or DDP) model carry "module." on every key; a plain model
    # for inference has none, and the other way round. Adapt when that is the only difference.
    wanted = set(model.state_dict())
    if set(state) == wanted:
        return state
    stripped = {k.removeprefix("module."): v for k, v in state.items()}
    if all(k.startswith("module.") for k in state) and set(stripped) == wanted:
        return stripped
    prefixed = {f"module.{k}": v for k, v in state.items()}
    if set(prefixed) == wanted:
        return prefixed
    return state  # let load_state_dict name the missing and unexpected keys


def load_checkpoint(
    path_or_directory: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = False,
) -> dict | None:
    """Restore the newest checkpoint (or the given file) into ``model``/``optimizer`` and this rank's RNG.

    ``model`` may be the wrapped model it was saved from or the plain model (keys carry
    DDP's ``module.`` prefix in the file; it is removed or added to match ``model``), e.g.
    to load trained weights for inference in one process.

    Returns ``{"step": ..., "extra": ..., "path": ...}``, or ``None`` when there is no
    checkpoint yet (a fresh start; logged, with a warning if the directory does not exist).
    ``strict=True`` raises ``FileNotFoundError`` instead of starting fresh.

    Example:
        >>> # state = load_checkpoint("ckpt", model=model, optimizer=opt)
        >>> # start = state["step"] + 1 if state else 0
        >>> # load_checkpoint("ckpt", model=MyModel())  # plain model, for inference
    """
    path = path_or_directory
    if os.path.isdir(path_or_directory) or not os.path.exists(path_or_directory):
        path = latest_checkpoint(path_or_directory)
        if path is None:
            exists = os.path.isdir(path_or_directory)
            what = "holds no checkpoint (step-*.pt)" if exists else "does not exist"
            if strict:
                raise FileNotFoundError(
                    f"checkpoint directory {path_or_directory!r} {what}; pass the directory save_checkpoint "
                    "wrote to, or strict=False to start fresh."
                )
            log.log(
                logging.INFO if exists else logging.WARNING,
                "checkpoint directory %r %s: starting fresh",
                path_or_directory,
                what,
            )
            return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(_match_prefix(payload["model"], model))
    if optimizer is not None and payload["optimizer"] is not None:
        optimizer.load_state_dict(payload["optimizer"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if payload["world_size"] == world:
        set_rng_state(payload["rng"][rank])
    else:
        log.warning(
            "checkpoint %s was written by %d ranks, now %d: RNG states not restored",
            path,
            payload["world_size"],
            world,
        )
    _install_artifacts(path)
    log.info("resumed from %s (step %d)", path, payload["step"])
    _events.emit("resumed", step=payload["step"], path=path)
    return {"step": payload["step"], "extra": payload["extra"], "path": path}
