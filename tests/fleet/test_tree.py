"""Compiled pieces between folders by the leaders' tree (Note [Compiles between folders by tree])."""

from __future__ import annotations

import math

import pytest

from distcompile.fleet.tree import binomial_rounds
from tests import workers
from tests.harness import run_ranks


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 100, 512])
def test_a_binomial_tree_reaches_every_position_once_in_log2_rounds(n: int) -> None:
    rounds = binomial_rounds(n)
    assert len(rounds) == (math.ceil(math.log2(n)) if n > 1 else 0)
    have, sends = {0}, [0] * n
    for pairs in rounds:
        receivers = [dst for _, dst in pairs]
        assert all(src in have for src, _ in pairs)  # only a position that has it sends
        assert not set(receivers) & have and len(set(receivers)) == len(receivers)  # each receives once
        assert len({src for src, _ in pairs}) == len(pairs)  # one send a round per position
        for src, _ in pairs:
            sends[src] += 1
        have |= set(receivers)
    assert have == set(range(n))
    assert max(sends) <= len(rounds) and sends[0] == len(rounds)  # the root sends the most


def test_a_tree_among_some_ranks_carries_each_leaders_bytes_to_the_others() -> None:
    results = run_ranks(workers.tree_broadcasts, 5, timeout=120)
    assert results[1] == results[3] == {}
    for r in (0, 2, 4):
        got = results[r]["got"]
        assert got == {root: bytes([root]) * (1000 + root) for root in (0, 2, 4)}, r
        assert results[r]["empty"] == b""
    for root in (0, 2, 4):  # 3 leaders: 2 rounds; the root sends in both, one relay once at most
        assert results[root]["sent"][root] == 2 * (1000 + root)
        assert sum(results[r]["sent"][root] for r in (0, 2, 4)) == 2 * (
            1000 + root
        )  # each leader gets it once


def test_a_leader_lost_inside_the_tree_costs_a_compile_here_not_a_hang(tmp_path) -> None:  # noqa: ANN001
    res = run_ranks(workers.tree_leader_lost, 2, str(tmp_path), timeout=120, may_die=(1,))[0]
    assert res["out"] == ["big", "small"], res  # its share, and the lost leader's compiled here
    assert any("the leaders' tree failed" in x for x in res["log"]), res["log"]
    assert res["broken"] and res["route"] == "the leaders' tree", res  # later graphs: the store
