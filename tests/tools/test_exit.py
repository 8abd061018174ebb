"""Processes that trained with distcompile exit with status 0 (issue: an abort during finalization).

``DISTCOMPILE_EXIT_RUNS=30 python -m pytest tests/tools/test_exit.py`` runs the loop longer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = int(os.environ.get("DISTCOMPILE_EXIT_RUNS", "3"))


@pytest.mark.parametrize("run", range(RUNS))
def test_example_ranks_exit_zero_with_a_cold_cache_and_telemetry(tmp_path: Path, run: int) -> None:
    # The conditions the abort was reported under: the example trainer under torchrun,
    # Inductor with an empty compile cache (its compile workers start), telemetry on, and
    # the script ending normally (no os._exit).
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        OMP_NUM_THREADS="1",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "train_gpt.py"), "--distcompile", "--steps", "3", "--n-layer", "1"]
    cmd += ["--n-embd", "32", "--logdir", str(tmp_path / "tb")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    # torchrun exits non-zero if any rank did, and names a rank killed by a signal.
    assert proc.returncode == 0, out[-4000:]
    assert "terminate called" not in out and "Signal 6" not in out, out[-4000:]
    assert out.count("final parameter digest") == 2, out[-4000:]


_LEFT_OPEN = """
import atexit, sys

# Registered before distcompile is imported, so it runs after distcompile's exit handler
# (atexit runs handlers last in, first out).
atexit.register(lambda: print("gradient hooks left at exit:", len(model._reducer._handles), flush=True))

import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import distcompile

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = distcompile.wrap(DDP(torch.nn.Linear(8, 8)), backend="eager")
for _ in range(2):
    model(torch.randn(4, 8)).sum().backward()
print("gradient hooks while training:", len(model._reducer._handles), flush=True)
from distcompile.runtime.shutdown import communication_threads
dist.destroy_process_group()
# The DDP model still references the group: its threads live on, as in most scripts.
print("communication threads after destroy_process_group:", communication_threads()[0], flush=True)
# No model.close(): the script just ends.
"""


def test_a_model_left_open_is_closed_at_exit(tmp_path: Path) -> None:
    # distcompile's exit handler closes a model the script left open, while Python is
    # still whole (telemetry flushed; on CUDA the last queued steps written).
    proc = subprocess.run(
        [sys.executable, "-c", _LEFT_OPEN, str(tmp_path / "pg")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gradient hooks while training: 2" in proc.stdout, proc.stdout  # weight and bias
    assert "gradient hooks left at exit: 0" in proc.stdout, proc.stdout
    # What the exit handler looks for before it leaves the GIL to those threads (Linux).
    line = proc.stdout.split("communication threads after destroy_process_group:")[1].splitlines()[0]
    assert int(line) >= 3, proc.stdout  # gloo: two work loops and the transport loop
