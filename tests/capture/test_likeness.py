"""Regions only for blocks alike (Note [Regions only for blocks alike])."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from distcompile.capture.block_likeness import describe_difference, likeness_key
from distcompile.capture.regions import mark_repeated_blocks
from tests import workers
from tests.harness import run_ranks
from tests.runtime.test_parity import TOL, _check


class _Scale(nn.Module):
    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


class _Flag(nn.Module):
    def __init__(self, on: bool) -> None:
        super().__init__()
        self.on = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.tanh() if self.on else x


class _Block(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(x))


class _Chain(nn.Module):
    def __init__(self, acts: list[nn.Module]) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)  # the blocks' input comes from a layer: how the reuse went wrong
        self.blocks = nn.Sequential(*[_Block(a) for a in acts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.pre(x))


CASES = {
    "identity, relu": lambda: [nn.Identity(), nn.ReLU()],
    "identity, scale": lambda: [nn.Identity(), _Scale(3.0)],
    "identity, flag on": lambda: [nn.Identity(), _Flag(True)],
    "identity, relu, identity, relu": lambda: [nn.Identity(), nn.ReLU(), nn.Identity(), nn.ReLU()],
    "identity, scale, identity, scale": lambda: [nn.Identity(), _Scale(2.0), nn.Identity(), _Scale(3.0)],
    # values: left to TorchDynamo's guards (Note [Regions only for blocks alike]); checked here
    "dropout 0, 0.5": lambda: [nn.Dropout(0.0), nn.Dropout(0.5)],
    "dropout 0.5, 0": lambda: [nn.Dropout(0.5), nn.Dropout(0.0)],
    "leaky relu 0.1, 0.5": lambda: [nn.LeakyReLU(0.1), nn.LeakyReLU(0.5)],
    "scale 1, 3": lambda: [_Scale(1.0), _Scale(3.0)],
    "flag off, on": lambda: [_Flag(False), _Flag(True)],
    "flag on, off": lambda: [_Flag(True), _Flag(False)],
    "dropout eval, train": lambda: [nn.Dropout(0.5).eval(), nn.Dropout(0.5)],
    "dropout train, eval": lambda: [nn.Dropout(0.5), nn.Dropout(0.5).eval()],
}


@pytest.mark.parametrize("case", list(CASES))
def test_marked_blocks_trace_what_eager_runs(case: str) -> None:
    torch.manual_seed(0)
    model = _Chain(CASES[case]())
    x = torch.randn(8, 4)
    torch.manual_seed(1)
    want = model(x)
    marked = copy.deepcopy(model)
    unmark = mark_repeated_blocks(marked)
    torch._dynamo.reset()
    torch.manual_seed(1)  # aot_eager draws eager's random numbers: dropout masks agree too
    got = torch.compile(marked, backend="aot_eager")(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if unmark is not None:
        unmark()
    assert all(type(b) is _Block for b in marked.blocks)


def test_only_alike_blocks_share_a_region_and_the_log_says_why(caplog: pytest.LogCaptureFixture) -> None:
    model = _Chain([nn.Identity(), nn.ReLU(), nn.Identity(), nn.ReLU(), nn.Tanh()])
    with caplog.at_level(logging.INFO, logger="distcompile"):
        unmark = mark_repeated_blocks(model)
    classes = [type(b) for b in model.blocks]
    assert classes[0] is classes[2] and classes[1] is classes[3], "alike blocks share one marked class"
    assert len({classes[0], classes[1], _Block}) == 3 and classes[4] is _Block, (
        "the lone Tanh block is unmarked"
    )
    (line,) = [r.getMessage() for r in caplog.records if "regions:" in r.getMessage()]
    assert line == (
        "regions: 5 _Block blocks are not all alike (blocks.0.act is Identity where blocks.1.act is ReLU): "
        "4 traced as 2 region(s), 1 on their own"
    )
    unmark()
    assert all(type(b) is _Block for b in model.blocks)


def test_likeness_key_compares_structure_hooks_and_objects_not_numbers() -> None:
    def key(m: nn.Module) -> tuple:
        return likeness_key(m)

    base = _Block(nn.ReLU())
    assert key(base) == key(_Block(nn.ReLU()))
    assert key(_Block(_Scale(1.0))) == key(_Block(_Scale(2.0))), "numbers: TorchDynamo guards them"
    assert key(_Block(_Scale(1.0))) != key(_Block(_Scale(None))), "a number where the other has None"
    assert key(base) != key(_Block(nn.Tanh())), "classes"
    wide = _Block(nn.ReLU())
    wide.lin = nn.Linear(4, 4, bias=False)
    assert key(base) != key(wide), "a parameter missing"
    frozen = _Block(nn.ReLU())
    frozen.lin.weight.requires_grad_(False)
    assert key(base) != key(frozen), "requires_grad"
    hooked = _Block(nn.ReLU())
    hooked.act.register_forward_hook(lambda m, i, o: o * 2)
    assert key(base) != key(hooked), "a forward hook"
    shared = object()
    a, b, c = _Block(nn.ReLU()), _Block(nn.ReLU()), _Block(nn.ReLU())
    a.cfg, b.cfg, c.cfg = shared, shared, object()
    assert key(a) == key(b) != key(c), "objects by identity"
    diff = describe_difference(key(base), key(_Block(nn.Tanh())), a_name="layers.0", b_name="layers.1")
    assert diff == "layers.0.act is ReLU where layers.1.act is Tanh"
    diff = describe_difference(key(base), key(hooked), a_name="layers.0", b_name="layers.1")
    assert diff == "layers.1.act has forward_hooks where layers.0.act has none"


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_unlike_blocks_train_as_eager_ddp_under_wrap_defaults(backend: str) -> None:
    _check(run_ranks(workers.parity, 2, "unlike_blocks", backend), TOL[backend])
