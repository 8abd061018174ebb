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
    (bucket,) = reducer.layout.schedules[(0,)][0]
    assert [p for p, _ in bucket._flag_cache] == [(True, True, True, True)], "one pattern, made once"
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
    (bucket,) = reducer.layout.schedules[(0,)][0]
    assert {p for p, _ in bucket._flag_cache} == {(False, False, True, True)}
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


class _Launches:
    """A StepObserver that keeps what the reducer reports (the real protocol, no telemetry)."""

    def __init__(self) -> None:
        self.launched: list[tuple[int, int]] = []
        self.ended: list[int] = []

    def begin_step(self) -> None:
        self.launched.clear()

    def bucket_launched(self, index: int, nbytes: int, nparams: int, future: object) -> None:
        self.launched.append((index, nparams))

    def waited(self, index: int, start: float, end: float) -> None:
        pass

    def end_step(self, stats: object) -> dict[str, float]:
        self.ended.append(stats.step)
        return {"comm_ms": 1.5}


def _names(buckets: list) -> list[list[str]]:
    return [b.names for b in buckets]


def test_schedule_launches_graphs_in_reverse_first_use_wins_then_the_rest(single_rank_group) -> None:
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "c": nn.Linear(2, 2)})
    r = BucketReducer(dict(model.named_parameters()), group=None, compression=None, grad_as_view=False)
    r.add_graph(0, [["a.weight", "a.bias"]])
    r.add_graph(1, [["b.weight"], ["b.bias", "a.weight"]])  # a.weight: graph 0 used it first
    order, _ = r.layout.schedule((0, 1), r._form())
    assert _names(order) == [["b.weight"], ["b.bias"], ["a.weight", "a.bias"], ["c.bias", "c.weight"]]
    assert [b.index for b in order] == [0, 1, 2, 3]
    again, _ = r.layout.schedule((0, 1), r._form())
    assert again is order  # one schedule per set of graphs, reused
    other, _ = r.layout.schedule((1, 0), r._form())  # graph 1 ran first: it owns a.weight now
    assert _names(other) == [["a.bias"], ["b.weight"], ["b.bias", "a.weight"], ["c.bias", "c.weight"]]


def test_tail_only_compression_compresses_the_last_graph_bucket_and_the_rest(single_rank_group) -> None:
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "c": nn.Linear(2, 2)})
    r = BucketReducer(
        dict(model.named_parameters()),
        group=None,
        compression="bf16",
        grad_as_view=False,
        compress_tail_only=True,
    )
    r.add_graph(0, [["b.weight", "b.bias"], ["a.weight", "a.bias"]])
    order, _ = r.layout.schedule((0,), r._form())
    # b: final early, full precision; a (first forward segment) and the trailing c: bf16.
    assert [b.wire.dtype for b in order] == [torch.float32, torch.bfloat16, torch.bfloat16]
    everywhere = BucketReducer(
        dict(model.named_parameters()), group=None, compression="bf16", grad_as_view=False
    )
    everywhere.add_graph(0, [["b.weight", "b.bias"], ["a.weight", "a.bias"]])
    assert {b.wire.dtype for b in everywhere.layout.schedule((0,), everywhere._form())[0]} == {torch.bfloat16}


def test_used_flags_and_the_observer_see_every_bucket(single_rank_group) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    seen = _Launches()
    r = BucketReducer(
        dict(model.named_parameters()), group=None, compression=None, grad_as_view=False, observer=seen
    )
    r.add_graph(0, [["1.weight", "1.bias"], ["0.weight", "0.bias"]])
    _step(model, r, torch.randn(3, 4))
    assert seen.launched == [(0, 2), (1, 2)] and seen.ended == [0]
    assert r.last_step.comm_ms == 1.5  # the observer's derived figures land in StepStats
    order, _ = r.layout.schedule((0,), r._form())
    assert [b.wire[b.numel :].tolist() for b in order] == [[1.0, 1.0], [1.0, 1.0]]
    _step(model, r, torch.randn(3, 4), use_b=False)  # layer 1 unused: its flags are 0
    assert [b.wire[b.numel :].tolist() for b in order] == [[0.0, 0.0], [1.0, 1.0]]
    assert seen.ended == [0, 1]


def test_ddp_bucket_cap_list_sizes_the_first_bucket_and_the_rest(single_rank_group) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distcompile.runtime.ddp import bucket_caps

    ddp = DDP(nn.Linear(4, 4), bucket_cap_mb_list=[1, 4, 8])
    assert bucket_caps(ddp, bucket_cap_mb=None, first_bucket_cap_mb=None) == (8 * 2**20, 2**20)
    assert bucket_caps(ddp, bucket_cap_mb=2, first_bucket_cap_mb=None) == (
        2 * 2**20,
        2 * 2**20,
    )  # wrap's wins


def test_zero_step_hooks_are_refused_not_left_to_never_step() -> None:
    import distcompile
    from distcompile.runtime.hooks import adopt_hook

    def hook_with_zero_fn(state, bucket):  # noqa: ANN001, ANN202 - the name torch's factory gives
        return None

    hook_with_zero_fn.__qualname__ = "hook_with_zero_step.<locals>.hook_with_zero_fn"
    with pytest.raises(distcompile.UnsupportedModelError, match="without overlap_with_ddp"):
        adopt_hook(hook_with_zero_fn, None, None)


class _ReusedMemory(torch.autograd.Function):
    """``x @ w.T`` whose backward hands out ``w``'s gradient in one buffer it overwrites on every
    call, as a CUDA graph's replay does with its outputs (Note [Gradients in CUDA-graph memory])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        ctx.pool = pool
        return x @ w.T

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        ctx.pool.copy_(g.T @ x)
        return None, ctx.pool.view_as(ctx.pool), None  # a new tensor over the same memory


@pytest.mark.parametrize("in_graph_memory", [False, True])
def test_gradients_in_reused_backward_memory_survive_accumulation(
    single_rank_group, in_graph_memory: bool
) -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(2, 3))
    pool = torch.zeros(2, 3)
    reducer = BucketReducer(
        {"w": w}, group=None, compression=None, grad_as_view=False, grads_in_graph_memory=in_graph_memory
    )
    reducer.add_graph(0, [["w"]])
    xs = [torch.randn(4, 3) for _ in range(4)]
    expected = sum(x.sum(0, keepdim=True).expand(2, 3) for x in xs)  # d/dw of sum(x @ w.T)
    _ReusedMemory.apply(xs[0], w, pool).sum().backward()  # no_sync: no step open
    _ReusedMemory.apply(xs[1], w, pool).sum().backward()
    for x in xs[2:]:  # synchronized, accumulating (as zero_grad(set_to_none=False) between steps)
        reducer.begin_forward()
        reducer.record_graph(0)
        _ReusedMemory.apply(x, w, pool).sum().backward()
    if in_graph_memory:
        torch.testing.assert_close(w.grad, expected)
        assert w.grad.data_ptr() != pool.data_ptr()
    else:  # what happens without the copies: each backward overwrote the .grad it added to
        assert not torch.allclose(w.grad, expected)
    reducer.close()
