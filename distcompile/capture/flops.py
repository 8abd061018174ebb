"""Counting each captured node's work: forward FLOPs on fake copies of the inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from .. import _torch_compat as compat

__all__ = ["fake_run", "node_flops"]


def fake_run(
    gm: fx.GraphModule, example_inputs: Sequence[object], body: Sequence[fx.Node]
) -> tuple[list[float], dict[fx.Node, object]]:
    """Run ``gm`` on fake copies of the inputs: each node of ``body``'s forward FLOPs, and
    every node's fake value (shapes, dtypes, and whether autograd would track it).

    Raises if the graph cannot run on fake tensors.

    Example:
        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
        >>> body = [n for n in gm.graph.nodes if n.op == "call_module"]
        >>> flops, values = fake_run(gm, [torch.zeros(2, 4)], body)
        >>> flops, [(tuple(values[n].shape), values[n].requires_grad) for n in body]
        ([64.0, 0.0], [((2, 4), True), ((2, 4), True)])
    """
    from torch.utils.flop_counter import FlopCounterMode

    fake_mode = compat.fake_mode_of(list(example_inputs))
    wanted = set(body)
    flops: dict[fx.Node, float] = {}
    values: dict[fx.Node, object] = {}
    counter = FlopCounterMode(display=False)

    class _Counting(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            before = counter.get_total_flops()
            out = super().run_node(n)
            values[n] = out
            if n in wanted:
                flops[n] = float(counter.get_total_flops() - before)
            return out

    with fake_mode:
        fakes = [
            fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
            for x in example_inputs
        ]
        # In the caller's grad mode (the step's): each fake value says whether backward reaches it.
        with counter:
            _Counting(gm).run(*fakes)
    return [flops.get(n, 0.0) for n in body], values


def node_flops(gm: fx.GraphModule, example_inputs: Sequence[object], body: Sequence[fx.Node]) -> list[float]:
    """Forward FLOPs of each node of ``body``, counted on fake copies of the inputs.

    Nodes without a FLOP formula (element-wise ops, views) count zero. Raises if the
    graph cannot run on fake tensors; the caller then falls back to DDP's caps.

    Example:
        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
        >>> node_flops(gm, [torch.zeros(2, 4)], [n for n in gm.graph.nodes if n.op == "call_module"])
        [64.0, 0.0]
    """
    return fake_run(gm, example_inputs, body)[0]
