"""What one forward's autograd graph sends each parameter (Note [Gradients by their source])."""

from __future__ import annotations

import torch
from torch import nn

from distcompile import _torch_compat as compat
from distcompile.runtime.grad_sources import GradSources


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def test_a_penalty_and_an_earlier_forward_are_not_the_forwards_gradient() -> None:
    net, x = _net(), torch.randn(3, 4)
    params = dict(net.named_parameters())
    hidden = net(x)  # an earlier forward whose output the checked one reads: its history
    mark = compat.node_order()
    out = net(torch.cat([x[:, :3], hidden], dim=1))
    sources = GradSources([out], params, since=mark)
    sources.reached()  # as the checks do when the backward reaches their taps
    (out.sum() + 0.5 * net[0].weight.square().sum()).backward()
    alone = dict(
        zip(
            params,
            torch.autograd.grad(net(torch.cat([x[:, :3], hidden.detach()], 1)).sum(), list(params.values())),
        )
    )
    for n in params:  # what this forward's nodes sent: its own gradient, nothing else
        torch.testing.assert_close(sources.sent[n], alone[n])
    outside = sources.outside()
    for n in params:  # .grad holds the earlier forward's and the penalty's parts too
        torch.testing.assert_close(sources.gained[n], params[n].grad)
        torch.testing.assert_close(outside[n] + sources.sent[n], params[n].grad)
    assert float(outside["0.weight"].abs().sum()) > 0  # the penalty, and the earlier forward's
    sources.remove()


def test_a_forward_that_gets_no_backward_is_let_go_at_the_next_backward() -> None:
    # A checked forward never backpropagated (a forward to look at outputs) leaves nothing on
    # the parameters once another backward has written .grad; an autograd.grad pass is no such.
    net, x = _net(), torch.randn(3, 4)
    params = dict(net.named_parameters())
    let_go = []
    mark = compat.node_order()
    out = net(x)
    sources = GradSources([out], params, since=mark, abandoned=lambda: let_go.append(True))
    torch.autograd.grad(out.sum(), [params["2.bias"]], retain_graph=True)
    assert not sources.wrote and sources.gained == {} and set(sources.sent) == {"2.bias"} and not let_go
    sources.clear()  # the checks' answer to a pass that wrote no .grad
    sources.reached()  # then the backward that writes .grad reaches the outputs: kept
    out.sum().backward(retain_graph=True)
    assert sources.wrote and set(sources.gained) == set(params) and not let_go
    sources.clear()
    net(x).sum().backward()  # another forward's backward
    assert let_go == [True]
    before = {n: p.grad.clone() for n, p in params.items()}
    sources.gained.clear()
    net(x).sum().backward()
    assert sources.gained == {} and sources.sent == {}, "still hooked"
    assert all(not torch.equal(before[n], p.grad) for n, p in params.items())
