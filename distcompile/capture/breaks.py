"""Graph breaks: TorchDynamo's reason for ending a graph early, with the user's code line."""

from __future__ import annotations

import re

from torch import fx

from .. import _torch_compat as compat

__all__ = ["graph_break_reason", "is_data_dependent", "tidy_reason"]

#: TorchDynamo's words for a break whose cause is a tensor's values: what runs after it
#: (which experts a token goes to, how many times a loop turns) may differ between ranks.
_DATA_DEPENDENT = re.compile(
    r"data[- ]dependent|depends on input tensor data|dynamic shape operator|\.item\(\)|tensor\.item|"
    r"tolist|nonzero|masked_select|aten\.unique|boolean mask",
    re.IGNORECASE,
)


def is_data_dependent(reason: str | None) -> bool:
    """Whether a graph break's ``reason`` is a tensor's values (the code after it may differ per rank).

    Example:
        >>> is_data_dependent("Dynamic shape operator (Operator `aten.nonzero.default`'s output shape ...)")
        True
        >>> is_data_dependent("Call to `torch._dynamo.graph_break()`")
        False
    """
    return bool(reason) and bool(_DATA_DEPENDENT.search(reason))


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
    text = tidy_reason(reason)
    if stack:
        frame = stack[-1]
        text += f" (at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()})"
    return text


def tidy_reason(reason: str) -> str:
    """TorchDynamo's ``reason`` on one line, without its developer debug context.

    Example:
        >>> tidy_reason("Unsupported call\\n  Explanation: no.\\n  Developer debug context: <x>\\n")
        'Unsupported call Explanation: no.'
    """
    text = " ".join(reason.split())
    return re.sub(r" Developer debug context:.*?(?= For more details|$)", "", text)  # internal detail
