"""Timing each node's backward for bucket_cap_mb='auto' (capture/timing.py): what FLOPs miss,
priced without touching the model, and never an exception."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from distcompile import _torch_compat as compat
from distcompile.capture.flops import fake_run
from distcompile.capture.timing import backward_work, matmul_rate
from distcompile.planning.costs import CostModel

CPU = torch.device("cpu")


class _Head(nn.Module):
    """Two identical layers, then a cross-entropy over a wide vocabulary: the backward FLOPs do not see."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.out = nn.Linear(64, 4096)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.b(F.gelu(self.a(x)))
        x = self.a(x)  # the same shapes as b's node: timed once
        return F.cross_entropy(self.out(x), y)


def _captured(model: nn.Module, *inputs: torch.Tensor) -> tuple[fx.GraphModule, list]:
    graphs = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compiler.reset()
    torch.compile(model, backend=backend)(*inputs)
    return graphs[0]


def test_backward_is_timed_where_flops_see_nothing_and_the_model_is_untouched() -> None:
    model = _Head()
    x, y = torch.randn(256, 64), torch.randint(0, 4096, (256,))
    gm, inputs = _captured(model, x, y)
    body = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    flops, values = fake_run(gm, inputs, body)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    with torch.no_grad():
        work = backward_work(values, body, device=CPU)
        assert not torch.is_grad_enabled()  # grad mode put back
    assert torch.equal(torch.rand(3), expected_next), "random number state was not put back"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    by_name = {n.name: (f, w) for n, f, w in zip(body, flops, work)}
    ce = next(k for k in by_name if "cross_entropy" in k)
    assert by_name[ce][0] == 0 and by_name[ce][1] > 0, by_name[ce]  # FLOPs: nothing; timed: work
    linears = [w for n, w in zip(body, work) if "linear" in str(n.target)]
    # b and a again: the same shapes, both inputs tracked by autograd: one timing (the first
    # linear's input is not tracked: its backward is the weight's alone, timed apart).
    assert len(linears) == 4 and linears[1] == linears[2] != linears[0], linears
    # Priced at a rate: each timed node at its timing, the cross-entropy (no FLOPs) included.
    # (Not "more in all than the FLOPs say": the rate and the timings are measured apart, and a
    # busy machine (the other test worker) slows one and not the other.)
    rate = matmul_rate(CPU)
    timed = CostModel(1e-4, 1e8, rate).graph_costs(flops, timed=work)
    counted = CostModel(1e-4, 1e8, rate).graph_costs(flops)
    assert timed.timed_nodes > 0 and counted.timed_nodes == 0
    k = [n.name for n in body].index(ce)
    assert counted.node_backward_s[k] == 0 and timed.node_backward_s[k] == by_name[ce][1] / rate > 0


def test_a_node_that_fails_on_random_values_is_left_to_its_flops() -> None:
    def fn(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(p @ w, dim=-1)
        # Zero rows (what an integer input gets) are fine; a probability row of zeros is not.
        return torch.multinomial(probs * 0, 1).float().sum() + probs.sum()

    gm = fx.symbolic_trace(fn)
    w = torch.randn(8, 8, requires_grad=True)
    body = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    _, values = fake_run(gm, [torch.randn(4, 8), w], body)
    work = dict(zip([n.name for n in body], backward_work(values, body, device=CPU)))
    assert work["matmul"] and work["softmax"]
    assert work["multinomial"] is None  # no backward reaches it: not timed, and no exception


def test_the_time_budget_leaves_the_rest_to_flops() -> None:
    gm = fx.symbolic_trace(lambda x, w: torch.tanh(x @ w).exp())
    w = torch.randn(32, 32, requires_grad=True)
    body = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    _, values = fake_run(gm, [torch.randn(16, 32), w], body)
    ticks = iter(range(100))
    work = backward_work(values, body, device=CPU, budget_s=2.5, clock=lambda: float(next(ticks)))
    assert work[0] is not None and work[1] is not None and work[2] is None, work


def test_a_node_inside_the_models_autocast_block_is_timed_under_that_autocast() -> None:
    seen: list[bool] = []

    @torch.compiler.allow_in_graph
    def probe(x: torch.Tensor) -> torch.Tensor:  # records whether autocast is on where it runs
        seen.append(torch.is_autocast_enabled("cpu"))
        return x * 2

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = probe(self.lin(x))
            return probe(y.float())

    captured = []

    def grab(gm: fx.GraphModule, inputs: list) -> Callable:
        captured.append((gm, inputs))
        return gm.forward

    torch.compiler.reset()
    torch.compile(Model(), backend=grab, fullgraph=True)(torch.randn(4, 16))
    ((gm, inputs),) = captured
    body = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    _, values = fake_run(gm, inputs, body)
    seen.clear()
    work = dict(zip([n.name for n in body], backward_work(values, body, device=CPU)))
    # Each timed node runs its forward twice (the faster backward counts): inside, then outside.
    assert seen == [True, True, False, False], seen
    assert not torch.is_autocast_enabled("cpu")  # left as it was
    assert all(work[n.name] is None for n in body if compat.autocast_change(n) is not None)
    assert [work[n.name] is not None for n in body if n.target is probe] == [True, True], work
