"""Fixtures shared by the one-process tests, and the order the suite runs in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

#: Measured worker-seconds of the costlier tests (how to remeasure: the file's header).
COSTS = Path(__file__).with_name("costs.tsv")


def measured_costs() -> dict[str, float]:
    """``nodeid -> seconds`` from ``costs.tsv`` (comment lines start with ``#``)."""
    costs = {}
    for line in COSTS.read_text().splitlines():
        if line and not line.startswith("#"):
            seconds, nodeid = line.split("\t", 1)
            costs[nodeid] = float(seconds)
    return costs


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The costliest tests first, the rest in collection order after them.

    Two xdist workers handed tests one at a time (``--maxschedchunk 1`` in pyproject.toml)
    then end within a short test of each other; in collection order, a test of minutes
    collected last kept one worker busy alone (about 100 s of the README's command and of
    the long set, measured 2026-11-28). Every worker sorts alike, as xdist requires.
    """
    costs = measured_costs()
    items.sort(key=lambda item: -costs.get(item.nodeid, 0.0))


@pytest.fixture
def single_rank_group(tmp_path):  # noqa: ANN001, ANN201 - a pytest fixture
    """A one-rank gloo process group, destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
