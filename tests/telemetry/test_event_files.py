"""Event records written with a C checksum into an open file (Note [Event records]): the same
bytes as TensorBoard's own writer, read back by TensorBoard's reader."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from torch.utils.tensorboard import SummaryWriter

from distcompile import _torch_compat as compat

# In the test extra; a virtualenv made before it was (.ci/torch-matrix keeps its venvs) lacks it.
pytest.importorskip("google_crc32c", reason="google-crc32c (the telemetry extra) is not installed")


def _write(run_dir: Path, *, fast: bool) -> bytes:
    writer = SummaryWriter(str(run_dir))
    if fast:
        assert compat.fast_records(writer)
    rng = np.random.default_rng(0)
    for step in range(5):
        writer.add_scalar("loss", 1.0 / (step + 1), step, walltime=100.0 + step)
    writer.add_text("plan", "| bucket | size |\n|---|---|\n| 0 | 4 MB |", 0, walltime=200.0)
    # A picture: a record of tens of kilobytes, the size a Gantt figure is.
    writer.add_image("timeline/step", rng.integers(0, 255, (3, 96, 128), dtype=np.uint8), 1, walltime=300.0)
    writer.close()
    (path,) = run_dir.glob("events.out.tfevents.*")
    return path.read_bytes()


def _records(data: bytes) -> list[bytes]:
    """Each record's data, its two checksums checked with TensorBoard's own function."""
    out, at = [], 0
    while at < len(data):
        header = data[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8 : at + 12])[0] == masked_crc32c(header)
        body = data[at + 12 : at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length : at + 16 + length])[0] == masked_crc32c(body)
        out.append(body)
        at += 16 + length
    return out


def test_fast_records_write_tensorboards_bytes_and_read_back(tmp_path: Path) -> None:
    fast = _write(tmp_path / "fast", fast=True)
    plain = _write(tmp_path / "plain", fast=False)
    fast_records, plain_records = _records(fast), _records(plain)
    # The first record is the file's version, stamped with the time it was made.
    assert len(fast_records) == len(plain_records) == 8
    assert fast_records[1:] == plain_records[1:]
    assert max(len(r) for r in fast_records) > 10_000  # the picture went through too
    acc = EventAccumulator(str(tmp_path / "fast"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("loss")] == [
        (s, round(1.0 / (s + 1), 4)) for s in range(5)
    ]
    assert [i.step for i in acc.Images("timeline/step")] == [1]
