"""What a failure inside torch's compilers becomes: a ``CompileError`` with the next rung of the ladder."""

from __future__ import annotations

import logging

import torch

from .. import _torch_compat as compat
from ..errors import CompileError

log = logging.getLogger(__name__)

__all__ = ["compile_failure", "dynamo_fallback"]


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


def dynamo_fallback(exc: BaseException, doing: str) -> BaseException | None:
    """The exception to hand back to TorchDynamo as is, when ``exc`` (raised while ``doing``) is
    one on which it breaks the graph instead of failing (``compat.dynamo_fallback_cause``: a
    data-dependent size met while tracing a piece, as ``torch.compile`` meets it), else ``None``.

    Example:
        >>> dynamo_fallback(ValueError("boom"), "compiling graph 0") is None
        True
    """
    fallback = compat.dynamo_fallback_cause(exc)
    if fallback is not None:
        log.info("%s: %s; TorchDynamo breaks the graph there, as torch.compile does", doing, fallback)
    return fallback


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
