"""What runs around a compiled graph: the reducer told that it ran, a double backward
refused with the fix, and parts of shared parameters handed over.

The pieces that read a shared parameter in a later segment hand their contribution to its
gradient to the reducer (Note [Shared weights reduced by use], ``planning/split.py``).
A compiled piece's backward is one autograd node (AOTAutograd's); the parameter reaches
it through an edge to the parameter's gradient accumulator. A hook on that node, run
after it computed its input gradients, takes the one for that edge and returns ``None``
in its place, so the accumulator receives only the other uses' contributions. The
reducer decides: outside a synchronized step, or with no bucket for the part, it declines
and the gradient flows on as usual.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import fx

from .. import _torch_compat as compat
from ..errors import ConfigError, UnsupportedModelError
from ..planning.split import Part, SplitPlan

__all__ = ["AsCaptured", "PartTaker", "divert_parts", "recording"]

log = logging.getLogger(__name__)

#: ``take(part_name, gradient) -> bool``: whether the reducer took the gradient.
PartTaker = Callable[[str, torch.Tensor], bool]


def _edge_slots(node: object, parts: list[tuple[Part, torch.nn.Parameter]]) -> list[tuple[int, str]]:
    """Where each part's parameter enters ``node``: (input-gradient index, part name)."""
    slots = []
    for i, (fn, _) in enumerate(node.next_functions):  # type: ignore[attr-defined]
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node's parameter
        for part, p in parts:
            if variable is p:
                slots.append((i, part.name))
    return slots


def _still_slots(node: object, slots: list[tuple[int, str]], params: dict[str, torch.nn.Parameter]) -> bool:
    """Whether ``slots`` (found on an earlier step's node of the same piece) hold here too: each
    index still leads to its part's parameter (a step's node is new; its edges are the same)."""
    edges = node.next_functions  # type: ignore[attr-defined]
    return all(i < len(edges) and getattr(edges[i][0], "variable", None) is params[name] for i, name in slots)


class _DivertingPiece(torch.nn.Module):
    def __init__(
        self, piece: Callable, parts: list[tuple[Part, torch.nn.Parameter]], take: PartTaker
    ) -> None:
        super().__init__()
        self.piece = piece
        self.parts = parts
        object.__setattr__(self, "take", take)
        self._warned = False
        self._by_name = {part.name: p for part, p in parts}
        self._slots: list[tuple[int, str]] = []  # the last step's, checked before reuse

    def forward(self, *args: object) -> object:
        out = self.piece(*args)
        if not torch.is_grad_enabled():
            return out
        node = compat.first_grad_node(out)
        slots = self._slots
        if node is None:
            slots = []
        elif not (slots and _still_slots(node, slots, self._by_name)):
            slots = self._slots = _edge_slots(node, self.parts)
        if not slots:
            if not self._warned:
                self._warned = True
                log.debug("parts %s: no edge to the parameter on the piece's node; reduced whole", self.parts)
            return out
        take = self.take

        def hand_over(grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
            new = list(grad_inputs)
            for i, name in slots:
                if new[i] is not None and take(name, new[i]):
                    new[i] = None
            return tuple(new)

        node.register_hook(hand_over)
        return out


def divert_parts(
    compiled: Callable, split: SplitPlan, params: Mapping[str, torch.nn.Parameter], take: PartTaker
) -> Callable:
    """``compiled`` with each piece that holds a part handing its contribution to ``take``.

    Example:
        >>> # used by distcompile's backend after compiling a graph whose plan has parts
    """
    if not split.parts or not isinstance(compiled, fx.GraphModule):
        return compiled
    by_piece: dict[int, list[tuple[Part, torch.nn.Parameter]]] = {}
    for part in split.parts:
        by_piece.setdefault(part.piece, []).append((part, params[part.param]))
    for k, parts in by_piece.items():
        name = f"compiled_submod_{k}"
        piece = getattr(compiled, name, None)
        if piece is None:
            log.debug("piece %d not found among the compiled pieces; its parts are reduced whole", k)
            continue
        setattr(compiled, name, _DivertingPiece(piece, parts, take))
    return compiled


def _checks(
    backend: str, graph_id: int, donations: list[compat.BackwardDonation]
) -> Callable[[object], None]:
    """A pre-hook for the graph's last backward node: what AOTAutograd's compiled backward
    would refuse with torch's internals for a message, refused with the fix."""
    ran = [False]  # whether a backward of this graph ran before (a lazy backward compiles at the first)

    def check(grad_outputs: object) -> None:
        first, ran[0] = not ran[0], True
        if torch.is_grad_enabled():  # the engine enables it for backward(create_graph=True) only
            raise UnsupportedModelError(
                "a backward with create_graph=True (a gradient penalty: autograd.grad(..., "
                f"create_graph=True)) reached a graph compiled with backend={backend!r}: AOTAutograd's "
                "compiled backward cannot be differentiated again (torch.compile fails here too). Use "
                "wrap(..., backend='eager') for this model (TorchDynamo's graphs run eager kernels, whose "
                "backward can be differentiated; buckets and overlap are the same), or compute the "
                "penalty outside the wrapped model."
            )
        if donations and compat.backward_keeps_graph():
            bad = [(k, d) for k, d in enumerate(donations) if d.donates(first_backward=first)]
            if bad:
                k, d = bad[0]
                raise ConfigError(
                    f"backward(retain_graph=True) reached graph {graph_id}, whose compiled backward "
                    f"(piece {k}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}) writes its results into "
                    f"the memory of saved activations (AOTAutograd's donated buffers): it was {d.how}, for "
                    "a backward that frees the graph, and a second backward would read overwritten values "
                    "(torch refuses it too). Set torch._functorch.config.donated_buffer = False before the "
                    "first step (the cost: such backwards allocate their results instead of reusing "
                    "freed activations, a little more peak memory in backward), or retain the graph from "
                    "the first backward on with an empty compile cache and wrap(..., share_compiles=False)."
                )

    return check


class AsCaptured:
    """While active (``with as_captured():``), each compiled graph of a model runs as the FX graph
    TorchDynamo captured, uncompiled, and the reducer is not told (Note [First-step forward check]).

    Example:
        >>> switch = AsCaptured()
        >>> with switch():
        ...     switch.active
        True
    """

    def __init__(self) -> None:
        self.active = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


def recording(
    compiled: Callable,
    registry: object,
    graph_id: int,
    backend: str,
    donations: list[compat.BackwardDonation] | None = None,
    captured: tuple[fx.GraphModule, AsCaptured] | None = None,
) -> Callable:
    """``compiled``, telling ``registry`` (the reducer) each time it runs with gradients, and
    refusing, with the fix, a double backward through AOTAutograd's compiled backward and a
    ``retain_graph=True`` backward through one that reuses its saved buffers (``donations``:
    one entry per compiled piece; ``_torch_compat/donation.py``). ``captured``: the graph as
    TorchDynamo captured it, run instead while its switch is active.

    Example:
        >>> # the backend returns recording(compiled, reducer, graph_id, "inductor", donations) to TorchDynamo
    """
    check = _checks(backend, graph_id, donations or []) if backend != "eager" else None

    # TorchDynamo calls a backend's result with positional tensors (never boxed).
    def run(*args: object) -> object:
        if captured is not None and captured[1].active:
            return captured[0](*args)
        if not torch.is_grad_enabled():
            return compiled(*args)
        registry.record_graph(graph_id)  # type: ignore[attr-defined]
        out = compiled(*args)
        if check is not None:  # before the compiled backward runs: the user sees why, not torch's internals
            node = next(
                (t.grad_fn for t in compat.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn),
                None,
            )
            if node is not None:
                node.register_prehook(check)
        return out

    return run
