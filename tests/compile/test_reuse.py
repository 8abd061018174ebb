"""Which pieces may share one compiled function (``compile.reuse.piece_key``), one process."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import distcompile
from distcompile.compile.reuse import backward_order, piece_key
from distcompile.models import GPT, GPTConfig


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * w).sum(-1)


def _key(*inputs: torch.Tensor, module: nn.Module | None = None) -> str | None:
    return piece_key(fx.symbolic_trace(module or _Scale()), list(inputs))


def test_same_graph_same_inputs_match() -> None:
    w1, w2 = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))
    assert _key(torch.randn(2, 4), w1) == _key(torch.randn(2, 4), w2) is not None


def test_any_difference_in_inputs_or_code_breaks_the_match() -> None:
    w = nn.Parameter(torch.ones(4))
    base = _key(torch.randn(2, 4), w)
    assert _key(torch.randn(3, 4), w) != base  # shape
    assert _key(torch.randn(4, 2).t(), w) != base  # strides
    assert _key(torch.randn(2, 4, dtype=torch.float64), w.double()) != base  # dtype
    assert _key(torch.randn(2, 4), torch.ones(4)) != base  # a plain tensor where a parameter was
    assert _key(torch.randn(2, 4, requires_grad=True), w) != base  # requires_grad
    x = torch.randn(4)
    assert _key(x.expand(2, 4), x) != _key(torch.randn(2, 4), torch.randn(4))  # aliasing

    class Other(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x * w).sum(-1)

    assert _key(torch.randn(2, 4), w, module=Other()) != base


def test_unvouched_pieces_are_never_shared() -> None:
    class WithConstant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("c", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.c

    assert _key(torch.randn(2, 4), module=WithConstant()) is None  # a tensor held by the piece

    def make(scale: float):  # noqa: ANN202
        def f(x: torch.Tensor) -> torch.Tensor:
            return x * scale

        return f

    f1, f2 = make(1.0), make(2.0)  # one name, two closures
    g1, g2 = fx.Graph(), fx.Graph()
    for g, f in ((g1, f1), (g2, f2)):
        x = g.placeholder("x")
        g.output(g.call_function(f, (x,)))
    t = torch.randn(2)
    assert piece_key(fx.GraphModule({}, g1), [t]) != piece_key(fx.GraphModule({}, g2), [t])


def test_backward_order_follows_last_forward_use() -> None:
    # Compiled in order A, B, C (C has no backward); A is used again after B.
    entries = [("A", 1, True), ("B", 2, True), ("C", 3, False), (None, 4, True)]
    order = backward_order(entries, {"A": 5, "B": 2, "C": 3})
    # Backward compiles pop from the end: A (last used at 5) first, then the piece at 4, then B;
    # C never runs backward and never pops.
    assert [entries[i][0] for i in order] == ["C", "B", None, "A"]


@pytest.mark.slow
def test_compiled_pieces_do_not_grow_with_depth(single_rank_group) -> None:  # noqa: ANN001
    """A GPT of 2 and of 6 identical blocks compiles the same number of pieces under Inductor.

    With 6 layers the pieces are cut at each layer's first linear (Note [Blocks cut where no
    fusion is lost]) and the last layer's tail joins the head's piece: 5 pieces, 4 reused.
    With 2 they stay the layers (one range would be left): 2 pieces, 1 reused."""
    compiled = []
    for layers in (2, 6):
        torch._dynamo.reset()
        model = distcompile.wrap(
            GPT(GPTConfig(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, block_size=8)),
            backend="inductor",
        )
        x = torch.randint(0, 64, (2, 8))
        GPT.loss(model(x), x).backward()
        (graph,) = model.graphs
        assert len(graph.plan.pieces) >= layers + 1 and graph.pieces_reused == {2: 1, 6: 4}[layers], graph
        compiled.append(len(graph.plan.pieces) - graph.pieces_reused)
        model.close()
    assert compiled[0] == compiled[1], compiled
