"""The bucket reducer's schedule on one real gloo rank: what it writes, what it keeps, what it reuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distcompile.runtime.reducer import BucketReducer


def _reducer(model: nn.Module, **kw: object) -> BucketReducer:
    r = BucketReducer(
        dict(model.named_parameters()),
        group=None,
        compression=kw.pop("compression", None),
        grad_as_view=kw.pop("grad_as_view", False),
    )
    r.add_graph(0, [[n for n, _ in reversed(list(model.named_parameters()))]])
    return r


def _step(model: nn.Module, reducer: BucketReducer, x: torch.Tensor, *, use_b: bool = True) -> None:
    reducer.begin_forward()
    reducer.record_graph(0)
    out = model[0](x) if not use_b else model[1](model[0](x))
    out.sum().backward()


@pytest.mark.parametrize("grad_as_view", [False, True])
def test_steady_state_makes_one_flag_tensor_and_keeps_grads(single_rank_group, grad_as_view: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reducer = _reducer(model, grad_as_view=grad_as_view)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref.load_state_dict(model.state_dict())
    for _ in range(3):  # accumulating across steps, as without zero_grad
        x = torch.randn(3, 4)
        _step(model, reducer, x)
        ref(x).sum().backward()
    expected = dict(ref.named_parameters())
    (bucket,) = reducer._schedules[(0,)][0]
    assert list(bucket._flag_cache) == [(True, True, True, True)], "one pattern, made once"
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n].grad)  # a world of one: the average is the sum
        if grad_as_view:
            assert p.grad.data_ptr() == bucket.views[bucket.names.index(n)].data_ptr()
    reducer.close()


def test_parameter_without_gradient_keeps_its_grad(single_rank_group) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reducer = _reducer(model)
    _step(model, reducer, torch.randn(3, 4), use_b=False)  # model[1] gets no gradient
    assert model[1].weight.grad is None, "no rank produced one: .grad stays None, as in DDP"
    kept = torch.full_like(model[1].weight, 7.0)
    model[1].weight.grad = kept.clone()
    _step(model, reducer, torch.randn(3, 4), use_b=False)
    assert torch.equal(model[1].weight.grad, kept), "no rank produced one: .grad stays as it was"
    (bucket,) = reducer._schedules[(0,)][0]
    assert set(bucket._flag_cache) == {(False, False, True, True)}
    reducer.close()


def test_bf16_compression_scales_after_the_cast(single_rank_group) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reducer = _reducer(model, compression="bf16")
    _step(model, reducer, torch.randn(3, 4))
    for p in model.parameters():  # world of one: the gradient rounded to bf16 and back
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, p.grad.to(torch.bfloat16).float())
    reducer.close()
