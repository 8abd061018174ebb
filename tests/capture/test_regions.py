"""Repeated blocks traced once as nested compile regions, inlined back (Note [Nested compile regions])."""

from __future__ import annotations

import copy
import operator
import pickle

import pytest
import torch
from torch import nn

from distcompile.capture.graph import own_forward_code
from distcompile.capture.regions import inline_regions, mark_repeated_blocks, region_failure_reason
from distcompile.models import GPT, GPTConfig
from tests.models import CheckpointAround, Repeats

_BODY = ("placeholder", "get_attr", "output")


def _calls(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)


def _shape_queries(gm: torch.fx.GraphModule) -> set:
    """`x.size()` calls and the items taken from their results: shape queries, no tensor work."""
    found: set = set()
    for n in gm.graph.nodes:
        if (n.op, n.target) == ("call_method", "size") or (
            n.target is operator.getitem and n.args and n.args[0] in found
        ):
            found.add(n)
    return found


def _capture(model: nn.Module, x: torch.Tensor, *, marked: bool, tag: str) -> dict:
    """The graph TorchDynamo captured, after inlining: each node's op, target and module paths."""
    seen: dict = {}
    unmark = mark_repeated_blocks(model) if marked else None

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen["regions"] = sum(_calls(m) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
        inline_regions(gm)
        seen["regions_left"] = sum(_calls(m) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
        shapes = _shape_queries(gm)
        seen["nodes"] = [
            (n.op, str(n.target), tuple(str(p) for p, _ in (n.meta.get("nn_module_stack") or {}).values()))
            for n in gm.graph.nodes
            if n.op not in _BODY and n not in shapes
        ]
        # The bodies of other higher-order ops (checkpoint's), by operation.
        seen["bodies"] = [
            [(n.op, str(n.target)) for n in m.graph.nodes if n.op not in _BODY]
            for m in gm.children()
            if isinstance(m, torch.fx.GraphModule)
        ]
        return gm.forward

    seen["out"] = torch.compile(own_forward_code(model, tag), backend=backend)(x)
    if unmark is not None:
        unmark()
    return seen


def test_a_transformer_traced_with_regions_is_the_graph_traced_without() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))
    x = torch.randint(0, 64, (2, 16))
    plain = _capture(model, x, marked=False, tag="regions-plain")
    marked = _capture(model, x, marked=True, tag="regions-marked")
    assert plain["regions"] == 0 and marked["regions"] == 4  # one region call per block
    # Same operations, same module paths. torch 2.15 keeps the blocks' `B, T, C = x.size()` in a
    # region's trace where the plain trace folds it into constants: shape queries, no tensor
    # work; _capture leaves them out of both.
    assert marked["nodes"] == plain["nodes"]
    assert any("blocks.3" in p for _, _, stack in marked["nodes"] for p in stack)
    torch.testing.assert_close(marked["out"], plain["out"], rtol=0, atol=0)


def test_blocks_of_two_classes_and_checkpointed_ones_come_back_in_place() -> None:
    torch.manual_seed(0)
    model = Repeats()  # A, B, A, A, then three checkpointed blocks of another width
    x = torch.randn(8, 64)
    plain = _capture(model, x, marked=False, tag="repeats-plain")
    marked = _capture(model, x, marked=True, tag="repeats-marked")
    assert marked["regions"] > 0
    assert marked["nodes"] == plain["nodes"]
    torch.testing.assert_close(marked["out"], model(x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_regions_inside_checkpoint_bodies_are_inlined_too(reentrant: bool) -> None:
    """Note [Regions under checkpoint]: blocks checkpointed from outside (Hugging Face's
    ``gradient_checkpointing_enable()``) put a region call in each checkpoint body; none may
    be left for AOTAutograd, and the bodies must be those traced without regions."""
    torch.manual_seed(0)
    model = CheckpointAround(reentrant=reentrant)
    x = torch.randn(8, 64)
    plain = _capture(model, x, marked=False, tag=f"around-plain-{reentrant}")
    marked = _capture(model, x, marked=True, tag=f"around-marked-{reentrant}")
    assert marked["regions"] > 0 and marked["regions_left"] == 0, marked["regions"]
    assert len(plain["bodies"]) == 3 and marked["bodies"] == plain["bodies"]
    assert marked["nodes"] == plain["nodes"]
    torch.testing.assert_close(marked["out"], plain["out"], rtol=0, atol=0)


def test_marking_needs_repeated_blocks_and_unmarking_restores_the_classes() -> None:
    assert mark_repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) is None
    model = Repeats()
    classes = [type(m) for m in model.modules()]
    unmark = mark_repeated_blocks(model)
    assert unmark is not None
    marked = [type(m) for m in model.modules()]
    assert marked != classes and all(issubclass(m, c) for m, c in zip(marked, classes))
    assert mark_repeated_blocks(model) is None  # marked once, whatever wraps it again
    # A whole-model pickle or copy taken meanwhile holds the blocks' own classes.
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert [type(m) for m in clone.modules()] == classes
        torch.testing.assert_close(clone(torch.ones(2, 64)), model(torch.ones(2, 64)))
    unmark()
    assert [type(m) for m in model.modules()] == classes


class _Passthrough(nn.Module):  # returns an input as it is (T5's blocks pass their position bias on)
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x) + bias, bias


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.lin(x)


class _Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = x.sum(0)
        for block in self.blocks:
            x = block(x, bias)[0] if isinstance(block, _Passthrough) else block(x)
        return x


def test_why_a_region_could_not_be_traced_is_said_in_one_line() -> None:
    reasons = {}
    for block, tag in ((_Passthrough, "passthrough"), (_Breaks, "breaks")):
        model = _Stack(block)
        unmark = mark_repeated_blocks(model)
        try:
            torch.compile(own_forward_code(model, tag), backend="eager")(torch.ones(2, 4))
        except Exception as exc:  # noqa: BLE001 - TorchDynamo's error type is what is checked
            reasons[tag] = (type(exc).__name__, region_failure_reason(exc))
        finally:
            unmark()
    assert reasons["passthrough"][0] == reasons["breaks"][0] == "UncapturedHigherOrderOpError"
    # The cause, not the preamble every higher-order op shares; one line.
    assert "aliasing" in reasons["passthrough"][1].lower(), reasons
    assert "graph_break()" in reasons["breaks"][1], reasons
    assert all("\n" not in r and "captured completely" not in r for _, r in reasons.values())
