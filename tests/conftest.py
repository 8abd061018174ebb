"""Fixtures shared by the one-process tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def single_rank_group(tmp_path):  # noqa: ANN001, ANN201 - a pytest fixture
    """A one-rank gloo process group, destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
