"""Counting each captured node's work: forward FLOPs on fake copies of the inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from .. import _torch_compat as compat

__all__ = ["node_flops"]


def node_flops(gm: fx.GraphModule, example_inputs: Sequence[object], body: Sequence[fx.Node]) -> list[float]:
    """Forward FLOPs of each node of ``body``, counted on fake copies of the inputs.

    Nodes without a FLOP formula (element-wise ops, views) count zero. Raises if the
    graph cannot run on fake tensors; the caller then falls back to DDP's caps.

    Example:
        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
        >>> node_flops(gm, [torch.zeros(2, 4)], [n for n in gm.graph.nodes if n.op == "call_module"])
        [64.0, 0.0]
    """
    from torch.utils.flop_counter import FlopCounterMode

    fake_mode = compat.fake_mode_of(list(example_inputs))
    wanted = set(body)
    flops: dict[fx.Node, float] = {}
    counter = FlopCounterMode(display=False)

    class _Counting(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            before = counter.get_total_flops()
            out = super().run_node(n)
            if n in wanted:
                flops[n] = float(counter.get_total_flops() - before)
            return out

    with fake_mode:
        fakes = [
            fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
            for x in example_inputs
        ]
        with counter, torch.no_grad():
            _Counting(gm).run(*fakes)
    return [flops.get(n, 0.0) for n in body]
