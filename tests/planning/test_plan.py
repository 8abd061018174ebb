"""The planner in one process: pure inputs, pure outputs."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from distcompile import NodeInfo, plan_graph
from distcompile.capture.flops import node_flops
from distcompile.capture.graph import read_graph
from distcompile.planning.costs import CostModel
from distcompile.planning.plan import GraphCosts
from tests.models import gpt, mlp_seq

KB = 1024


def chain(*params: tuple[str, ...]) -> list[NodeInfo]:
    """A linear chain of nodes; node i feeds node i+1, the last feeds the output."""
    return [NodeInfo(f"n{i}", p, i + 1) for i, p in enumerate(params)]


def test_each_parameter_lands_with_its_first_use() -> None:
    nodes = chain(("w0",), ("w1",), ("w2",), ("w3",))
    plan = plan_graph(
        nodes, dict.fromkeys(["w0", "w1", "w2", "w3"], 4 * KB), bucket_cap=4 * KB, first_bucket_cap=4 * KB
    )
    assert plan.segments == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert [b.params for b in plan.buckets] == [("w3",), ("w2",), ("w1",), ("w0",)]
    for b in plan.buckets:
        for p in b.params:
            start, stop = plan.segments[b.segment]
            assert start <= plan.first_use[p] < stop


def test_tied_weight_counted_once_with_earliest_use() -> None:
    # "emb" is read by the first node and again by the last (an output head).
    nodes = chain(("emb",), ("w1",), ("w2",), ("emb",))
    sizes = {"emb": 10 * KB, "w1": 4 * KB, "w2": 4 * KB}
    plan = plan_graph(nodes, sizes, bucket_cap=4 * KB, first_bucket_cap=4 * KB)
    owners = [b for b in plan.buckets if "emb" in b.params]
    assert len(owners) == 1 and plan.segments[owners[0].segment][0] == 0
    assert plan.shared == {"emb": 2}
    assert sum(b.nbytes for b in plan.buckets) == sum(sizes.values())  # nothing counted twice


def test_small_first_bucket_then_cap() -> None:
    nodes = chain(*[(f"w{i}",) for i in range(8)])
    plan = plan_graph(nodes, {f"w{i}": 1 * KB for i in range(8)}, bucket_cap=4 * KB, first_bucket_cap=1 * KB)
    assert [b.nbytes for b in plan.buckets] == [1 * KB, 4 * KB, 3 * KB]
    assert plan.buckets[0].params == ("w7",)


def test_oversized_parameter_gets_its_own_bucket() -> None:
    nodes = chain(("small",), ("huge",), ("tail",))
    plan = plan_graph(nodes, {"small": 1, "huge": 100, "tail": 1}, bucket_cap=10, first_bucket_cap=1)
    assert [b.params for b in plan.buckets] == [("tail",), ("huge",), ("small",)]


def test_parameter_free_preamble_merges_forward() -> None:
    nodes = chain((), (), ("w0",), ("w1",))
    plan = plan_graph(nodes, {"w0": 4, "w1": 4}, bucket_cap=4, first_bucket_cap=4)
    assert plan.segments[0] == (0, 3)
    assert len(plan.buckets) == 2


#: Nodes 1-2 are only read inside their own range: cutting before node 1 would leave a
#: partition with no outputs, so the segment must grow until it has one.
INNER_ONLY = [
    NodeInfo("a", ("w0",), 3),
    NodeInfo("b", ("w1",), 2),
    NodeInfo("c", ("w2",), 3),
    NodeInfo("d", ("w3",), 4),
]


def test_no_cut_without_an_external_output() -> None:
    nodes = INNER_ONLY
    plan = plan_graph(nodes, dict.fromkeys(["w0", "w1", "w2", "w3"], 4), bucket_cap=4, first_bucket_cap=4)
    for start, stop in plan.segments:
        assert any(nodes[i].last_user >= stop for i in range(start, stop)), plan.segments


def test_unused_and_foreign_parameters() -> None:
    nodes = chain(("w0", "shared"), ("w1",))
    plan = plan_graph(nodes, {"w0": 4, "w1": 4, "shared": 4, "dead": 4}, owned_elsewhere={"shared"})
    assert plan.unused == ("dead",)
    assert plan.foreign == ("shared",)
    assert all("shared" not in b.params and "dead" not in b.params for b in plan.buckets)


def test_plan_is_deterministic() -> None:
    nodes = chain(*[(f"w{i}",) for i in range(20)])
    sizes = {f"w{i}": (i % 5 + 1) * KB for i in range(20)}
    a = plan_graph(nodes, sizes, bucket_cap=6 * KB, first_bucket_cap=2 * KB)
    b = plan_graph(
        list(nodes), dict(reversed(list(sizes.items()))), bucket_cap=6 * KB, first_bucket_cap=2 * KB
    )
    assert a == b and a.fingerprint() == b.fingerprint()


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_graph([], {}, bucket_cap=0)
    with pytest.raises(KeyError, match="missing"):
        plan_graph(chain(("ghost",)), {})


def test_empty_graph() -> None:
    plan = plan_graph([], {"w": 4})
    assert plan.buckets == () and plan.unused == ("w",)


def _trace(model: nn.Module, *inputs: torch.Tensor):
    gm = fx.symbolic_trace(model)
    names = {id(p): n for n, p in model.named_parameters()}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return read_graph(gm, list(inputs)[: len(placeholders)], names)


def test_read_graph_finds_parameters_and_tied_weight() -> None:
    model = gpt()
    captured = _trace(model, torch.zeros(2, 16, dtype=torch.long))
    assert set(captured.params) == {n for n, _ in model.named_parameters()}
    tied_reads = [n.name for n in captured.nodes if "wte.weight" in n.params]
    assert len(tied_reads) == 2, tied_reads  # the embedding lookup and the output head
    plan = plan_graph(
        captured.nodes, {n: p.numel() * 4 for n, p in captured.params.items()}, bucket_cap=64 * KB
    )
    emb_bucket = next(b for b in plan.buckets if "wte.weight" in b.params)
    assert emb_bucket.index == len(plan.buckets) - 1  # first use is the very first op: last bucket


def test_read_graph_on_sequential() -> None:
    model = mlp_seq()
    captured = _trace(model, torch.zeros(2, 64))
    plan = plan_graph(
        captured.nodes,
        {n: p.numel() * 4 for n, p in captured.params.items()},
        bucket_cap=20 * KB,
        first_bucket_cap=1 * KB,
    )
    assert len(plan.segments) > 2
    assert sorted(p for b in plan.buckets for p in b.params) == sorted(n for n, _ in model.named_parameters())


# ---- bucket_cap_mb="auto": segments chosen by simulating the schedule

MB = 1_000_000


def _check_plan(plan, nodes) -> None:  # noqa: ANN001
    """Segments tile the graph, each has an output, each bucket sits at its first uses."""
    assert plan.segments[0][0] == 0 and plan.segments[-1][1] == len(nodes)
    for (_, stop), (start, _) in zip(plan.segments, plan.segments[1:]):
        assert stop == start
    for start, stop in plan.segments:
        assert stop == len(nodes) or any(nodes[i].last_user >= stop for i in range(start, stop))
    for b in plan.buckets:
        start, stop = plan.segments[b.segment]
        assert all(start <= plan.first_use[p] < stop for p in b.params)


def _layers(n: int, *, emb_cost: float, layer_cost: float) -> tuple[list[NodeInfo], dict, list[float]]:
    """An embedding (read again by the head), n equal layers, a head: like a small GPT."""
    nodes = chain(("emb",), *[(f"w{i}",) for i in range(n)], ("emb",))
    sizes = {"emb": 8 * MB, **{f"w{i}": 2 * MB for i in range(n)}}
    return nodes, sizes, [emb_cost] + [layer_cost] * n + [layer_cost]


def test_cost_plan_overlaps_and_keeps_the_tail_to_the_first_op() -> None:
    # A link that keeps up with backward (2 MB in 16 ms, a layer's backward 30 ms): every
    # layer's bucket can go while the next layer computes, and only the embedding, whose
    # gradient is final when backward ends, is left for the tail.
    nodes, sizes, secs = _layers(8, emb_cost=0.01, layer_cost=0.03)
    plan = plan_graph(nodes, sizes, costs=GraphCosts(node_backward_s=secs, latency_s=2e-4, bytes_per_s=125e6))
    _check_plan(plan, nodes)
    assert plan.buckets[-1].params == ("emb",)
    assert len(plan.buckets) >= 3, plan.describe()


def test_cost_plan_uses_one_bucket_when_latency_dominates() -> None:
    nodes, sizes, secs = _layers(8, emb_cost=0.01, layer_cost=0.001)
    plan = plan_graph(nodes, sizes, costs=GraphCosts(node_backward_s=secs, latency_s=1.0, bytes_per_s=1e12))
    assert len(plan.segments) == 1 and len(plan.buckets) == 1


def test_cost_plan_beats_ddp_caps_in_its_own_simulation() -> None:
    nodes, sizes, secs = _layers(8, emb_cost=0.01, layer_cost=0.03)
    costs = GraphCosts(node_backward_s=secs, latency_s=2e-4, bytes_per_s=125e6)

    def simulated_end(plan) -> float:  # noqa: ANN001
        done, t_comm = 0.0, 0.0
        below = sum(secs)
        for b in plan.buckets:  # gradient order: a bucket is ready when backward passed its segment
            start, _ = plan.segments[b.segment]
            done = below - sum(secs[:start])
            t_comm = max(t_comm, done) + costs.latency_s + b.nbytes / costs.bytes_per_s
        return max(t_comm, below)

    auto = plan_graph(nodes, sizes, costs=costs)
    ddp = plan_graph(nodes, sizes)  # 25 MiB caps, 1 MiB first bucket
    assert simulated_end(auto) < 0.9 * simulated_end(ddp), (auto.describe(), ddp.describe())


def test_cost_plan_never_cuts_a_segment_without_an_output() -> None:
    nodes = INNER_ONLY
    sizes = dict.fromkeys(["w0", "w1", "w2", "w3"], 4 * MB)
    plan = plan_graph(
        nodes, sizes, costs=GraphCosts(node_backward_s=[0.05] * 4, latency_s=1e-4, bytes_per_s=1e9)
    )
    _check_plan(plan, nodes)
    assert len(plan.segments) >= 2  # it did cut, where it could


def test_cost_plan_is_deterministic_and_checks_inputs() -> None:
    nodes, sizes, secs = _layers(30, emb_cost=0.01, layer_cost=0.02)
    costs = GraphCosts(node_backward_s=secs, latency_s=3e-4, bytes_per_s=25e6)
    assert plan_graph(nodes, sizes, costs=costs) == plan_graph(list(nodes), dict(sizes), costs=costs)
    with pytest.raises(ValueError, match="node times"):
        plan_graph(nodes, sizes, costs=GraphCosts(node_backward_s=[0.1], latency_s=0, bytes_per_s=1))


def test_cost_plan_thins_candidates_on_large_graphs() -> None:
    nodes, sizes, secs = _layers(400, emb_cost=0.001, layer_cost=0.001)
    plan = plan_graph(nodes, sizes, costs=GraphCosts(node_backward_s=secs, latency_s=1e-4, bytes_per_s=1e9))
    _check_plan(plan, nodes)
    assert 1 < len(plan.segments) <= 32


def test_cost_plan_on_a_traced_gpt() -> None:
    model = gpt()
    x = torch.zeros(2, 16, dtype=torch.long)
    gm = fx.symbolic_trace(model)
    names = {id(p): n for n, p in model.named_parameters()}
    captured = read_graph(gm, [x], names)
    flops = node_flops(gm, [x], captured.body)
    assert sum(flops) > 0
    costs = CostModel(latency_s=2e-4, bytes_per_s=1e6, flops_per_s=1e8).graph_costs(flops)
    plan = plan_graph(captured.nodes, {n: p.numel() * 4 for n, p in captured.params.items()}, costs=costs)
    _check_plan(plan, captured.nodes)
    assert len(plan.buckets) > 1
    assert "wte.weight" in plan.buckets[-1].params


def test_cost_plan_accounts_for_a_compressed_tail() -> None:
    # With the tail at half the bytes, leaving the first layer in it (8 ms more at the end)
    # costs less than a bucket of its own (16 ms, with no backward left to hide under): the
    # planner merges it (and uses fewer segments). At full size the merge saves nothing,
    # and the smaller tail wins.
    nodes, sizes, secs = _layers(8, emb_cost=0.002, layer_cost=0.03)

    def plan(scale: float):  # noqa: ANN202
        costs = GraphCosts(
            node_backward_s=secs, latency_s=2e-4, bytes_per_s=125e6, first_segment_wire_scale=scale
        )
        return plan_graph(nodes, sizes, costs=costs)

    full, half = plan(1.0), plan(0.5)
    _check_plan(half, nodes)
    assert full.buckets[-1].params == ("emb",)
    assert half.buckets[-1].nbytes > full.buckets[-1].nbytes
    assert len(half.segments) < len(full.segments)


def test_no_cut_splits_a_sealed_span_and_blocks_across_one_are_not_pieces() -> None:
    # Eight nodes, one parameter each, a cap of one parameter: a cut everywhere, except where a
    # data-dependent size made at node 2 is read up to node 5 (Note [Graphs that differ by data]).
    nodes = [NodeInfo(f"n{i}", (f"w{i}",), i + 1) for i in range(8)]
    sizes = {f"w{i}": 4 for i in range(8)}
    free = plan_graph(nodes, sizes, bucket_cap=4, first_bucket_cap=4)
    assert [a for a, _ in free.segments] == list(range(8))
    sealed = plan_graph(nodes, sizes, bucket_cap=4, first_bucket_cap=4, sealed=[(2, 5)])
    assert [a for a, _ in sealed.segments] == [0, 1, 2, 6, 7]
    blocks = [[(1, 3), (3, 5)]]  # their boundaries fall inside the span: not pieces of their own
    assert plan_graph(nodes, sizes, blocks=blocks, sealed=[(2, 5)]).pieces == ((0, 8),)
    assert plan_graph(nodes, sizes, blocks=blocks).pieces == ((0, 1), (1, 3), (3, 5), (5, 8))


def test_spans_of_data_dependent_sizes_are_read_from_the_captured_graph() -> None:
    from tests.models import MaskMoE

    seen: list = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        seen.append(read_graph(gm, example_inputs, {}))
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        torch.compile(MaskMoE(check=False), backend=backend)(torch.zeros(8, 64))
    (captured,) = seen
    assert len(captured.sealed) == 4, captured.sealed  # h[m] -> expert -> out[m] = ..., per expert
    for first, last in captured.sealed:
        assert "getitem" in str(captured.body[first].target) and "setitem" in str(captured.body[last].target)
