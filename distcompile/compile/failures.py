"""What a failure inside torch's compilers becomes: a ``CompileError`` with the next rung of the ladder."""

from __future__ import annotations

import torch

from .._errors import CompileError

__all__ = ["compile_failure"]


def _ladder_hint(backend: str) -> str:
    lower = {"inductor": "aot_eager", "aot_eager": "eager"}.get(backend)
    if lower is None:
        return (
            "backend='eager' only captures the graph, so the failure is in TorchDynamo's capture or in "
            "splitting it: check the model under plain torch.compile(model, backend='eager')."
        )
    return (
        f"Try the next step down the debugging ladder, wrap(..., backend={lower!r}): if that works, the "
        f"problem is in the {backend} stage (distcompile.doctor walks the whole ladder)."
    )


def compile_failure(
    rank: int, doing: str, backend: str, exc: BaseException, *, extra: str = ""
) -> CompileError:
    """``exc`` (raised inside torch while ``doing``) as a ``CompileError``; raise it ``from exc``.

    Example:
        >>> str(compile_failure(0, "compiling graph 0", "eager", ValueError("boom"))).split(":")[0]
        'rank 0'
    """
    message = " ".join(str(exc).split())[:800].rstrip(".")
    return CompileError(
        f"rank {rank}: {doing} failed inside torch {torch.__version__} (backend={backend!r}): "
        f"{type(exc).__name__}: {message}. {_ladder_hint(backend)} The torch traceback is chained below"
        f"{'; ' + extra if extra else ''}."
    )
