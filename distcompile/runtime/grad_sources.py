"""What one forward's autograd graph sends each parameter in a backward, apart from other uses.

Note [Gradients by their source]
    A parameter's ``.grad`` gains, in one backward, the sum of every use of it: the model's
    forward, and also a penalty on it written in the training loop, a temperature read in
    the loss, a second forward in the same step. The autograd engine adds them up before
    ``AccumulateGrad`` runs, so a hook on ``.grad`` sees only the sum. To compare the
    gradients of one forward with eager's (Note [First-step forward check], Note
    [First-step self-check]), the nodes that forward created are hooked: every node
    reachable from its outputs and created after it began (``compat.node_order``; older
    nodes are the inputs' history), on each edge that leads to a parameter's
    ``AccumulateGrad``; each hook adds what the node sends down that edge. A parameter
    reached another way (a reentrant checkpoint's nested backward) gets nothing here, so
    the checks accept a gradient that matches eager's either way: what the forward's nodes
    sent, or what ``.grad`` gained (a post-accumulate hook: the sum). A backward that
    writes ``.grad`` without reaching the forward's outputs (the forward was never
    backpropagated: a forward to look at outputs) ends the watch: every hook is removed, and
    the check is told. ``verify=True``,
    which compares reduced gradients, adds the difference of the two (the uses outside the
    forward) to eager's side for the first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch

from .. import _torch_compat as compat

__all__ = ["GradSources"]


class GradSources:
    """For each of ``params`` (by name): what the autograd graph behind ``outputs`` sends it
    (``sent``, summed over the backward passes until :meth:`clear`) and what its ``.grad``
    gains from every use in the backward that writes it (``gained``). The checks call
    :meth:`reached` when that backward reaches ``outputs``.

    Example:
        >>> lin = torch.nn.Linear(2, 1)
        >>> mark = compat.node_order()
        >>> out = lin(torch.ones(1, 2))
        >>> sources = GradSources([out], {"weight": lin.weight}, since=mark)
        >>> (out.sum() + lin.weight.sum()).backward()  # the penalty's gradient is not the forward's
        >>> sources.sent["weight"].tolist(), sources.gained["weight"].tolist()
        ([[1.0, 1.0]], [[2.0, 2.0]])
        >>> sources.remove()
    """

    def __init__(
        self,
        outputs: list,
        params: Mapping[str, torch.Tensor],
        *,
        since: int,
        abandoned: Callable[[], None] = lambda: None,
    ) -> None:
        self.sent: dict[str, torch.Tensor] = {}
        self.gained: dict[str, torch.Tensor] = {}
        self.wrote = False  # the running backward wrote some parameter's .grad (not autograd.grad)
        self._before = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        self._abandoned = abandoned
        self._reached = False  # the running backward got to the outputs
        self._ending = False  # a callback at the end of the running backward is queued
        by_id = {id(p): n for n, p in params.items()}
        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        visited: set = set()  # a node's Python object stays the same while the graph lives
        edges: dict[object, list[tuple[int, str]]] = {}
        while stack:
            node = stack.pop()
            if node in visited or compat.node_order(node) <= since:
                continue
            visited.add(node)
            for k, (child, _) in enumerate(node.next_functions):
                name = by_id.get(id(getattr(child, "variable", None)))
                if name is not None:
                    edges.setdefault(node, []).append((k, name))
                elif child is not None:
                    stack.append(child)
        self._handles = [
            node.register_hook(functools.partial(self._add, pairs)) for node, pairs in edges.items()
        ]
        self._handles += [
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, n))
            for n, p in params.items()
        ]

    def reached(self) -> None:
        """The running backward got to the forward's outputs."""
        self._reached = True

    def _add(self, pairs: list[tuple[int, str]], grad_inputs: tuple, grad_outputs: tuple) -> None:
        for k, name in pairs:
            g = grad_inputs[k]
            if g is None or g.is_sparse:  # sparse gradients are reduced apart: not compared
                continue
            before = self.sent.get(name)
            self.sent[name] = g.detach().clone() if before is None else before + g.detach()

    def _accumulated(self, name: str, param: torch.Tensor) -> None:
        self.wrote = True
        if not self._ending:
            self._ending = True
            compat.queue_engine_callback(self._backward_ended)
        grad = param.grad
        if grad is None or grad.is_sparse:  # stepped by an optimizer in backward; sparse: apart
            return
        before = self._before.get(name)
        self.gained[name] = grad.detach() - before if before is not None else grad.detach().clone()

    def outside(self) -> dict[str, torch.Tensor]:
        """What each parameter's ``.grad`` gained from uses outside the forward (``gained - sent``)."""
        sent = self.sent
        return {n: g - sent[n] if n in sent else g for n, g in self.gained.items()}

    def _backward_ended(self) -> None:
        self._ending = False
        if not self._reached:  # .grad written by another forward's backward: this one was let go
            self.remove()
            self._abandoned()

    def clear(self) -> None:
        """Forget what was sent (a backward that wrote no ``.grad``: ``autograd.grad``)."""
        self.sent = {}
        self._reached = self.wrote = False

    def remove(self) -> None:
        """Remove every hook."""
        for h in self._handles:
            h.remove()
        self._handles = []
