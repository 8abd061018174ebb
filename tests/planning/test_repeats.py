"""Repeated blocks in the planner: segments keep identical blocks identical, each block is a piece."""

from __future__ import annotations

from distcompile import NodeInfo, plan_graph
from distcompile.planning.plan import GraphCosts
from distcompile.planning.repeats import allowed_cuts, piece_bounds

KB = 1024
#: Nodes per block: norm, two matmuls, residual add (the add feeds the next block).
BLOCK = 4


def _model(n_blocks: int, *, weight: int = 4 * KB) -> tuple[list[NodeInfo], dict[str, int], list[tuple]]:
    """An embedding node, ``n_blocks`` blocks of 4 nodes each reading a weight, a head."""
    nodes = [NodeInfo("emb", ("emb",), 1)]
    sizes = {"emb": 8 * KB}
    ranges = []
    for b in range(n_blocks):
        start = len(nodes)
        for j in range(BLOCK):
            name = f"b{b}.w{j}"
            sizes[name] = weight
            # Inside a block each node feeds the next; the last one also feeds the next block.
            nodes.append(NodeInfo(name, (name,), len(nodes) + 1))
        ranges.append((start, len(nodes)))
    nodes.append(NodeInfo("head", ("emb",), len(nodes) + 1))
    return nodes, sizes, ranges


def _relative(plan, ranges) -> set[tuple]:  # noqa: ANN001
    """Each block's pieces, relative to its start; one element when all blocks are cut alike."""
    shapes = set()
    for start, stop in ranges:
        inner = tuple((a - start, b - start) for a, b in plan.pieces if start <= a and b <= stop)
        assert sum(b - a for a, b in inner) == stop - start, (plan.pieces, start, stop)
        shapes.add(inner)
    return shapes


def test_segments_cut_at_block_starts_and_every_block_is_a_piece() -> None:
    nodes, sizes, ranges = _model(6)
    plan = plan_graph(nodes, sizes, bucket_cap=20 * KB, first_bucket_cap=4 * KB, blocks=[ranges])
    block_starts = {a for a, _ in ranges}
    assert all(s == 0 or s in block_starts or s == ranges[-1][1] for s, _ in plan.segments), plan.segments
    assert _relative(plan, ranges) == {((0, BLOCK),)}
    for b in plan.buckets:  # the plan contract is unchanged: each bucket sits at its first uses
        start, stop = plan.segments[b.segment]
        assert all(start <= plan.first_use[p] < stop for p in b.params)
    # Pieces refine segments: every segment start is a piece start.
    assert {s for s, _ in plan.segments} <= {s for s, _ in plan.pieces}


def test_without_blocks_pieces_are_the_segments() -> None:
    nodes, sizes, _ = _model(6)
    plan = plan_graph(nodes, sizes, bucket_cap=20 * KB, first_bucket_cap=4 * KB)
    assert plan.pieces == plan.segments
    assert any(s not in {1 + BLOCK * k for k in range(7)} for s, _ in plan.segments[1:])  # cuts mid-block


def test_blocks_larger_than_a_bucket_are_cut_alike() -> None:
    nodes, sizes, ranges = _model(5, weight=6 * KB)  # 24 KiB per block, cap 10 KiB
    plan = plan_graph(nodes, sizes, bucket_cap=10 * KB, first_bucket_cap=10 * KB, blocks=[ranges])
    shapes = _relative(plan, ranges)
    assert len(shapes) == 1 and len(next(iter(shapes))) > 1, plan.pieces  # cut inside, the same way
    assert len(plan.segments) > len(ranges)


def test_cost_planner_respects_blocks() -> None:
    nodes, sizes, ranges = _model(6)
    costs = GraphCosts(node_backward_s=[0.01] * len(nodes), latency_s=1e-4, bytes_per_s=1e6)
    plan = plan_graph(nodes, sizes, costs=costs, blocks=[ranges])
    allowed = allowed_cuts(len(nodes), [ranges], [[]])
    assert len(plan.segments) > 1 and all(s in allowed for s, _ in plan.segments)
    assert _relative(plan, ranges) == {((0, BLOCK),)}


def test_piece_without_outputs_joins_a_neighbour() -> None:
    # Node 1 is read only inside [1, 3): a piece [1, 2) would have no output.
    last_user = [1, 2, 3, 4]
    assert piece_bounds(4, [0], [[(1, 2), (2, 3)]], [[], []], last_user) == ((0, 1), (1, 2), (2, 3), (3, 4))
    last_user = [1, 2, 2, 4]  # node 1 feeds node 2 only; [2, 3) is read after, [1, 2) is not
    bounds = piece_bounds(4, [0], [[(1, 2), (2, 3)]], [[], []], last_user)
    for a, b in bounds:
        assert b == 4 or any(last_user[i] >= b for i in range(a, b)), bounds


def test_a_block_just_over_the_cap_stays_one_piece() -> None:
    # GPT-2 small's blocks hold 27.04 MiB against DDP's 25 MiB: the cap rule alone cut each
    # block after its first node (its LayerNorm), two pieces a block for the same buckets.
    nodes, sizes, ranges = _model(6, weight=4 * KB)
    for b in range(6):
        sizes[f"b{b}.w0"] = 64  # the norm's few parameters
    block = sum(sizes[f"b0.w{j}"] for j in range(BLOCK))
    plan = plan_graph(
        nodes, sizes, bucket_cap=int(block / 1.0816), first_bucket_cap=int(block / 1.0816), blocks=[ranges]
    )
    assert _relative(plan, ranges) == {((0, BLOCK),)}, plan.pieces
    assert len(plan.pieces) <= len(plan.buckets) + 1, (plan.pieces, plan.buckets)
