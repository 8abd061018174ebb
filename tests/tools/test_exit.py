"""Processes that trained with distcompile exit with status 0 (issue: an abort during finalization).

``DISTCOMPILE_EXIT_RUNS=30 python -m pytest tests/tools/test_exit.py`` runs the loop longer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import child_env

ROOT = Path(__file__).resolve().parents[2]
RUNS = int(os.environ.get("DISTCOMPILE_EXIT_RUNS", "2"))


@pytest.mark.long
@pytest.mark.parametrize("run", range(RUNS))
def test_example_ranks_exit_zero_with_a_cold_cache_and_telemetry(tmp_path: Path, run: int) -> None:
    # The conditions the abort was reported under: the example trainer under torchrun,
    # Inductor with an empty compile cache (its compile workers start), telemetry on, and
    # the script ending normally (no os._exit).
    env = child_env(OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "train_gpt.py"), "--distcompile", "--steps", "3", "--n-layer", "1"]
    cmd += ["--n-embd", "32", "--logdir", str(tmp_path / "tb")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    # torchrun exits non-zero if any rank did, and names a rank killed by a signal.
    assert proc.returncode == 0, out[-4000:]
    assert "terminate called" not in out and "Signal 6" not in out, out[-4000:]
    assert out.count("final parameter digest") == 2, out[-4000:]
