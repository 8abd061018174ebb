"""Graph breaks: TorchDynamo's reason for ending a graph early, with the user's code line."""

from __future__ import annotations

import re

from torch import fx

from .. import _torch_compat as compat

__all__ = ["graph_break_reason"]


def graph_break_reason(gm: fx.GraphModule) -> str | None:
    """TorchDynamo's reason for ending ``gm`` at a graph break, with the user's code line.

    Example:
        >>> import torch
        >>> graph_break_reason(fx.symbolic_trace(torch.nn.Linear(1, 1))) is None
        True
    """
    parts = compat.graph_break_parts(gm)
    if parts is None:
        return None
    reason, stack = parts
    text = " ".join(reason.split())
    text = re.sub(r" Developer debug context:.*?(?= For more details|$)", "", text)  # internal detail
    if stack:
        frame = stack[-1]
        text += f" (at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()})"
    return text
