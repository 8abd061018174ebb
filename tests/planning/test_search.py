"""The schedule search with shared parameters reduced by use (``planning/search.py``).

A brute force over every segmentation, priced by a simulator written here from the Note's
words (not from the search's code), is the reference.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from distcompile import NodeInfo, plan_graph
from distcompile.capture.graph import lookup_indices, read_graph
from distcompile.models import GPT, GPTConfig
from distcompile.planning.search import GraphCosts, SharedUse, segment_bytes
from distcompile.planning.split import split_shared


def _tied(layers: int, *, preamble: bool = False) -> tuple[list[NodeInfo], dict[str, int]]:
    """A chain: lookup in table ``w``, ``layers`` layers, an output head reading ``w`` again
    (``preamble``: after a node that reads no parameter, like ``arange`` for positions)."""
    o = int(preamble)
    nodes = [NodeInfo("arange", (), 1)] if preamble else []
    nodes.append(NodeInfo("emb", ("w",), o + 1, ("w",)))
    nodes += [NodeInfo(f"b{i}", (f"v{i}",), o + i + 2) for i in range(layers)]
    nodes.append(NodeInfo("head", ("w",), o + layers + 2))
    return nodes, {"w": 8_000_000, **{f"v{i}": 3_000_000 for i in range(layers)}}


def _simulate(starts: list[int], nodes: list[NodeInfo], sizes: dict, costs: GraphCosts) -> float:
    """Step time of a segmentation: buckets in gradient order, one link, as the Note says."""
    n = len(nodes)
    bounds = list(zip(starts, [*starts[1:], n]))
    k = len(bounds)
    first = {}
    for i, x in enumerate(nodes):
        for p in x.params:
            first.setdefault(p, i)
    t_link = 0.0
    for j, (s, e) in reversed(list(enumerate(bounds))):
        ready = sum(costs.node_backward_s[s:]) + (k - j) * costs.segment_backward_s
        own = parts = 0
        for p, f in first.items():
            readers = [i for i, x in enumerate(nodes) if p in x.params]
            here = [i for i in readers if s <= i < e]
            if s <= f < e:
                lookups_only = costs.split_shared and all(p in nodes[i].lookups for i in here)
                own += (costs.rows_nbytes or {}).get(p, sizes[p]) if lookups_only else sizes[p]
            elif costs.split_shared and f < s and here:
                parts += sizes[p]
            scale = costs.first_segment_wire_scale if j == 0 else costs.wire_scale
        if own + parts:  # the parts travel in the segment's bucket
            t_link = max(t_link, ready) + costs.latency_s + (own + parts) * scale / costs.bytes_per_s
    backward = sum(costs.node_backward_s) + k * costs.segment_backward_s
    return max(backward, t_link) + k * costs.segment_forward_s


def _best_by_brute_force(nodes: list[NodeInfo], sizes: dict, costs: GraphCosts) -> float:
    inner = range(1, len(nodes))
    return min(
        _simulate([0, *cuts], nodes, sizes, costs)
        for r in range(len(nodes))
        for cuts in itertools.combinations(inner, r)
        if all(nodes[c].params for c in cuts)  # the search starts segments where parameters are read
    )


def test_segment_prices_follow_the_split() -> None:
    use = SharedUse(first=0, readers=(0, 4, 6), lookups=(0,), nbytes=800, rows_nbytes=100)
    assert segment_bytes([use], 0, 2) == (-700, 0)  # home reads rows only: rows, not the table
    assert segment_bytes([use], 0, 5) == (0, 0)  # home also reads it densely: the table
    assert segment_bytes([use], 2, 5) == (0, 800)  # a later use: a part, the whole table
    assert segment_bytes([use], 2, 4) == (0, 0)  # no use here


def test_search_with_split_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for trial in range(12):
        nodes, sizes = _tied(rng.randint(2, 5))
        secs = [0.001] + [rng.uniform(0.02, 0.12) for _ in nodes[1:-1]] + [rng.uniform(0.02, 0.1)]
        for split in (False, True):
            costs = GraphCosts(
                node_backward_s=secs,
                latency_s=rng.choice([1e-4, 5e-3]),
                bytes_per_s=rng.choice([50e6, 125e6, 1e9]),
                split_shared=split,
                rows_nbytes={"w": rng.choice([100_000, 2_000_000])},
            )
            plan = plan_graph(nodes, sizes, costs=costs)
            got = _simulate([s for s, _ in plan.segments], nodes, sizes, costs)
            best = _best_by_brute_force(nodes, sizes, costs)
            assert got <= best * 1.01 + 1e-9, (trial, split, plan.segments, got, best)


def test_pricing_the_split_gives_a_faster_plan_when_the_table_is_big() -> None:
    # The unpriced search believes the 8 MB table goes after backward whatever it does and
    # packs the rest with it; priced, the head's use goes early and the layers get their own
    # buckets. Judged by the split's real costs, the priced plan is faster.
    nodes, sizes = _tied(4)
    secs = [0.001, 0.1, 0.1, 0.1, 0.1, 0.08]
    real = GraphCosts(secs, 1e-4, 125e6, split_shared=True, rows_nbytes={"w": 500_000})
    unpriced = GraphCosts(secs, 1e-4, 125e6)
    priced_plan = plan_graph(nodes, sizes, costs=real)
    unpriced_plan = plan_graph(nodes, sizes, costs=unpriced)
    assert priced_plan.segments != unpriced_plan.segments
    t_priced = _simulate([s for s, _ in priced_plan.segments], nodes, sizes, real)
    t_unpriced = _simulate([s for s, _ in unpriced_plan.segments], nodes, sizes, real)
    assert t_priced < t_unpriced * 0.97, (t_priced, t_unpriced)
    # And the split the runtime makes from the priced plan is the one priced: the head's use
    # is a part, the table's own bucket reduces rows.
    split = split_shared(priced_plan, nodes)
    assert [p.param for p in split.parts] == ["w"] and "w" in split.rows


def _lookups_seen(batch: int) -> dict[str, int]:
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    seen = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        names = {id(p): n for n, p in model.named_parameters()}
        seen.update(lookup_indices(read_graph(gm, example_inputs, names)))
        return gm.forward

    torch.compile(model, backend=backend)(torch.randint(0, 64, (batch, 16)))
    return seen


def test_lookups_are_counted_from_the_traced_graph() -> None:
    # TorchDynamo remembers the sizes each code object was compiled with, process-wide: a GPT
    # compiled earlier in this process (another test) with another batch would make the batch
    # symbolic here. Forgotten first, so the sizes are this test's.
    torch._dynamo.reset()
    assert _lookups_seen(3) == {"wte.weight": 48, "wpe.weight": 16}
    # A second batch size makes the batch dimension symbolic (automatic dynamic shapes): the
    # token table's count is then unknown and left out (its bucket goes whole); the positions'
    # (16, static) is still counted.
    assert _lookups_seen(2) == {"wpe.weight": 16}
    torch._dynamo.reset()


@pytest.mark.parametrize("preamble", [False, True])
def test_among_plans_the_model_cannot_tell_apart_the_smallest_tail_wins(preamble: bool) -> None:
    # The link is the bottleneck (27 MB at 50 MB/s against 0.25 s of backward): in the
    # simulation every plan ends when the queue drains, so a block could ride in the last
    # bucket for free. A real link faster than measured would then wait for it after
    # backward: the plan keeps the first segment to the lookup alone (with a parameter-free
    # preamble, which joins it).
    nodes, sizes = _tied(4, preamble=preamble)
    secs = [0.0] * preamble + [0.001, 0.05, 0.05, 0.05, 0.05, 0.04]
    costs = GraphCosts(secs, 1e-4, 50e6, split_shared=True, rows_nbytes={"w": 500_000})
    plan = plan_graph(nodes, sizes, costs=costs)
    assert plan.segments[0] == (0, 1 + preamble), plan.segments
    if preamble:
        return
    assert _simulate([0, 2, 5], nodes, sizes, costs) <= _simulate(
        [s for s, _ in plan.segments], nodes, sizes, costs
    )
    assert (
        _simulate([s for s, _ in plan.segments], nodes, sizes, costs)
        <= _best_by_brute_force(nodes, sizes, costs) * 1.01
    )


def test_compute_lost_to_communication_delays_backward_and_can_keep_bytes_for_the_end() -> None:
    """``cpu_s_per_byte``: bytes all-reduced while backward runs take compute from it (ranks
    sharing cores with the communication's threads)."""
    from distcompile.planning.search import starts_by_cost

    nodes = [NodeInfo(f"n{i}", (f"p{i}",), i + 1) for i in range(4)]
    sizes = [4_000_000] * 4
    free = GraphCosts([0.1] * 4, latency_s=1e-3, bytes_per_s=1e8)
    starts, predicted = starts_by_cost(nodes, sizes, free)
    assert len(starts) > 1  # a free link overlaps backward: several buckets
    # The same plan priced with a loss: backward ends later by the bytes sent while it ran.
    lossy = GraphCosts([0.1] * 4, latency_s=1e-3, bytes_per_s=1e8, cpu_s_per_byte=1e-9)
    _, lossy_predicted = starts_by_cost(nodes, sizes, lossy)
    assert lossy_predicted > predicted
    # Losing more compute per byte than the link takes to send it: keep every byte for the end.
    dear = GraphCosts([0.1] * 4, latency_s=1e-3, bytes_per_s=1e8, cpu_s_per_byte=1e-7)
    assert starts_by_cost(nodes, sizes, dear)[0] == [0]
