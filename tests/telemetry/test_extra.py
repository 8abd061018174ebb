"""TensorBoard and matplotlib are the ``telemetry`` extra: without them, logdir= says what to install."""

from __future__ import annotations

import sys

import pytest
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distcompile
from distcompile.telemetry.report import summarize


@pytest.mark.parametrize("missing", ["tensorboard", "matplotlib"])
def test_logdir_without_the_extra_names_it(single_rank_group, tmp_path, monkeypatch, missing) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now raises ImportError
    with pytest.raises(
        distcompile.ConfigError, match=rf"{missing} is not installed.*distcompile\[telemetry\]"
    ):
        distcompile.wrap(DDP(nn.Linear(2, 2)), backend="eager", logdir=str(tmp_path))


def test_report_without_the_extra_names_it(tmp_path, monkeypatch) -> None:
    (tmp_path / "events.out.tfevents.1").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(distcompile.ConfigError, match=r"distcompile report reads TensorBoard.*\[telemetry\]"):
        summarize(str(tmp_path))
