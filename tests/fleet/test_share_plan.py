"""Who compiles, publishes and fetches what (Note [Compiles shared by folder]): the pure plan."""

from __future__ import annotations

import pytest

from distcompile.fleet.share_plan import plan_sharing

COSTS, SHAREABLE = [8, 5, 3, 2], [True] * 4


def _plans(ranks: list[int], folders: dict[int, int], warm: tuple[int, ...] = ()) -> dict:
    return {
        r: plan_sharing(COSTS, SHAREABLE, rank=r, sharers=ranks, folders=folders, warm=warm) for r in ranks
    }


def test_one_folder_per_rank_cold_splits_the_work_and_each_rank_leads_its_folder() -> None:
    plans = _plans([0, 1], {0: 0, 1: 1})
    assert plans[0].owner == (0, 1, 1, 0) and plans[0].mine == (0, 3) and plans[0].from_other == (1, 2)
    assert all(p.publishes and p.is_leader for p in plans.values())
    assert plans[0].fetches == (1,) and plans[1].fetches == (0,) and plans[0].fetchers == 2


def test_two_folders_of_two_one_publication_and_one_fetch_per_folder() -> None:
    folders = {0: 0, 1: 0, 2: 2, 3: 2}
    plans = _plans([0, 1, 2, 3], folders)
    owners = plans[0].owner
    assert len(set(owners)) == 4  # four pieces, four ranks: one each, largest first
    for r, p in plans.items():
        assert p.leader == folders[r] and p.is_leader == (r in (0, 2))
        assert p.publishes == p.is_leader  # one publication per folder
        assert p.fetches == ((2,) if r == 0 else (0,) if r == 2 else ())  # only leaders fetch
        mine_or_folder = set(p.mine) | set(p.from_folder)
        assert mine_or_folder | set(p.from_other) == {0, 1, 2, 3} and not mine_or_folder & set(p.from_other)
        assert all(folders[owners[j]] == folders[r] for j in p.from_folder)
    assert plans[0].publishers == (0, 2) and plans[0].fetchers == 2


def test_many_folders_only_the_folders_that_own_pieces_publish() -> None:
    ranks = list(range(16))
    folders = {r: r - r % 2 for r in ranks}  # 8 folders of 2, 4 pieces
    plans = _plans(ranks, folders)
    owning = sorted({folders[o] for o in plans[0].owner})
    assert len(owning) <= 4 and all(p.publishers == tuple(owning) for p in plans.values())
    assert [r for r, p in plans.items() if p.publishes] == owning
    assert plans[0].fetchers == 8  # every folder lacks some piece
    assert all(set(p.fetches) <= set(owning) for p in plans.values())
    restart = _plans(ranks, folders, warm=(0, 1, 2, 3))  # 2 warm folders, 6 cold
    assert {p.publishers for p in restart.values()} == {(0, 2)}


@pytest.mark.parametrize(
    ("nranks", "per_folder", "warm"),
    [(2, 1, ()), (6, 2, ()), (16, 4, ()), (16, 2, (0, 1, 2, 3)), (12, 3, (6, 7, 8)), (8, 1, (5,))],
)
def test_what_leaders_fetch_agrees_with_what_they_lack(nranks: int, per_folder: int, warm: tuple) -> None:
    ranks = list(range(nranks))
    folders = {r: r - r % per_folder for r in ranks}
    plans = _plans(ranks, folders, warm)
    lacks = {r: {folders[p.owner[j]] for j in p.from_other} for r, p in plans.items() if p.is_leader}
    assert all(set(plans[r].fetches) == lacks[r] for r in lacks), (lacks, plans)
    assert all(p.publishers == tuple(sorted(set().union(*lacks.values()))) for p in plans.values())
    assert all(p.fetchers == sum(1 for x in lacks.values() if x) for p in plans.values())
    assert all(not p.fetches for p in plans.values() if not p.is_leader)


def test_a_warm_restart_sends_cold_folders_to_warm_leaders_and_nothing_between_warm_ones() -> None:
    plans = _plans([0, 1], {0: 0, 1: 1}, warm=(1,))
    assert plans[1].owner == (1, 1, 1, 1) and plans[1].mine == (0, 1, 2, 3) and plans[1].publishes
    assert plans[0].owner == (1, 1, 1, 1) and plans[0].from_other == (0, 1, 2, 3) and plans[0].fetches == (1,)
    assert plans[0].fetchers == 1 and plans[0].publishers == (1,)
    every = _plans([0, 1], {0: 0, 1: 1}, warm=(0, 1))
    assert not any(p.publishes or p.fetches or p.from_other for p in every.values())  # all warm: no traffic
    four = _plans([0, 1, 2, 3], {r: r for r in range(4)}, warm=(0, 2))
    assert four[1].owner[0] == 0 and four[3].owner[0] == 2  # cold folders spread over the warm ones


def test_pieces_no_peer_can_load_are_compiled_by_every_rank() -> None:
    plans = {
        r: plan_sharing(COSTS, [True, False, True, True], rank=r, sharers=[0, 1], folders={0: 0, 1: 1})
        for r in (0, 1)
    }
    assert all(1 in p.mine and 1 not in p.from_other for p in plans.values())
