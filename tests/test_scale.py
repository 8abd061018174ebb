"""More ranks than the rest of the suite: 4 and 8 real gloo ranks on one machine (issue 43).

The control plane's protocols (Note [The control plane]) are unit-tested with 32 simulated
ranks in ``tests/test_store.py``; here the whole of distcompile runs with 4 and 8 real
processes: parity with eager DDP (every graph and plan agreed by digest, the layout, the
heartbeat and lockstep keys), a rank that captured another graph (4 ranks) and one that
never arrives (4 and 8: named within the timeout, on every rank), compiles shared across 4
cache folders (each piece compiled once in the job), and Join with ranks that run out of
data at different steps (4 and 8).
"""

from __future__ import annotations

import re
import tempfile

import numpy as np
import pytest

from tests import ddp_workers, workers
from tests.harness import run_ranks
from tests.runtime.test_parity import TOL, _check

pytestmark = pytest.mark.long


@pytest.mark.parametrize("world", [4, 8])
def test_parity_at_4_and_8_ranks(world: int) -> None:
    _check(run_ranks(workers.parity, world, "gpt", "aot_eager", timeout=900), TOL["aot_eager"])


def test_a_rank_with_another_graph_is_named_on_every_rank_of_4() -> None:
    for rank, msg in enumerate(run_ranks(workers.desync_structure, 4, timeout=300)):
        assert f"rank {rank}: graph 0 differs between rank {rank} and rank" in msg, (rank, msg)


@pytest.mark.parametrize("world", [4, 8])
def test_a_rank_that_never_arrives_is_named_within_the_timeout(world: int) -> None:
    for rank, msg in enumerate(run_ranks(workers.desync_missing, world, timeout=300)):
        if rank == 1:
            assert msg == "skipped"
            continue
        seconds = float(msg.split("s ", 1)[0])
        assert "rank(s) [1] did not compile graph 0 within 3 s" in msg and seconds < 10, msg


def test_compiles_shared_across_4_folders_compile_each_piece_once() -> None:
    with tempfile.TemporaryDirectory() as root:
        folders = [f"{root}/{k}" for k in range(4)]
        results = run_ranks(workers.shared_compile, 4, folders, "gpt", "plain", timeout=1500)
    _check(results, TOL["inductor"])
    compiled = [
        int(m.group(1))
        for r in results
        for line in r["log"]
        if (m := re.search(r"pieces: (\d+) compiled here", line))
    ]
    total = sum(compiled)
    distinct = results[0]["pieces"][0] - results[0]["pieces_reused"][0]
    assert total == distinct, (compiled, distinct)  # each distinct piece compiled once in the job


def test_two_folders_of_two_fetch_once_per_folder() -> None:
    """Note [Compiles shared by folder]: 4 ranks, 2 cache folders; each piece compiled once in the
    job; only each folder's leader (ranks 0 and 2) takes pieces from another folder, by the
    leaders' tree (Note [Compiles between folders by tree]), not through the store."""
    with tempfile.TemporaryDirectory() as root:
        folders = [f"{root}/{k // 2}" for k in range(4)]
        results = run_ranks(workers.shared_compile, 4, folders, "gpt", "plain", timeout=1500)
    _check(results, TOL["inductor"])
    lines = [next(x for x in r["log"] if x.startswith("graph 0 compiled in")) for r in results]
    through = [
        float(m.group(1)) if (m := re.search(r"\(([\d.]+) MB through the leaders' tree\)", x)) else 0.0
        for x in lines
    ]
    assert through[0] > 0 and through[2] > 0 and through[1] == 0 and through[3] == 0, lines
    store_kb = [
        _kb(re.search(r"control plane: \d+ store ops, ([\d.]+ [kM]?B) on this rank", x)) for x in lines
    ]
    # The pieces' bytes skipped the store: what a rank moved through it (marks, and the few
    # libraries of Inductor's CPU checks shared at a cold start) is well under what came by tree.
    assert max(store_kb) < 0.5 * through[0] * 1000, (store_kb, lines)
    # Those libraries are fetched once per folder, by its leader: the others only publish theirs.
    assert max(store_kb[1], store_kb[3]) < min(store_kb[0], store_kb[2]), (store_kb, lines)
    compiled = [int(m.group(1)) if (m := re.search(r"pieces: (\d+) compiled here", x)) else 0 for x in lines]
    assert sum(compiled) == results[0]["pieces"][0] - results[0]["pieces_reused"][0], lines


def _kb(found: re.Match | None) -> float:
    number, unit = found.group(1).split() if found else ("inf", "kB")
    return float(number) * {"B": 1e-3, "kB": 1.0, "MB": 1e3}[unit]


@pytest.mark.parametrize("world", [4, 8])
def test_join_with_ranks_out_of_data_at_different_steps(world: int) -> None:
    for res in run_ranks(ddp_workers.join_parity, world, "model", timeout=900):
        for a, b in zip(*res["losses"]):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
        for a, b in zip(res["params"], res["ref_params"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
