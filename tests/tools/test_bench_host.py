"""``distcompile bench --host-overhead`` runs end to end: the CPU proxy's table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.long  # a benchmark run end to end (~20 s), as the other modes' tests
def test_host_overhead_mode_writes_each_variants_figures(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "distcompile.tools.cli", "bench", "--host-overhead", "--rounds", "2",
         "--block", "2", "--warmup", "2", "--variants", "ddp,ddpopt,distcompile_telemetry,distcompile_unsplit", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (path,) = tmp_path.glob("*-host-overhead.json")
    rows = json.loads(path.read_text())["variants"]
    assert set(rows) == {"ddp", "ddpopt", "distcompile_telemetry", "distcompile_unsplit"}
    for row in rows.values():
        assert row["median_ms"] > 0 and row["no_sync_median_ms"] > 0 and row["python_calls"] > 0, row
    dc = rows["distcompile_telemetry"]
    assert dc["pieces"] <= dc["buckets"] + 1, dc  # one piece per bucket (issue 55)
    # split_shared=False: no row bucket (the head's part travels in its segment's bucket anyway).
    assert rows["distcompile_unsplit"]["buckets"] == dc["buckets"] - 1, rows
    # Layers cut at their first matmul (Note [Blocks cut where no fusion is lost]): about the
    # compiled kernels a step of DDPOptimizer's pieces (112 against 110: the last layer's tail
    # and the head fuse a little differently in one piece), not 160 as when cut at the LayerNorm.
    assert rows["ddp"]["compiled_kernels"] == 0, rows["ddp"]
    assert 0 < dc["compiled_kernels"] < 1.1 * rows["ddpopt"]["compiled_kernels"], rows
    # Time inside Inductor's generated code: none for eager DDP, some for compiled variants,
    # and the host's own work outside it always.
    assert rows["ddp"]["in_graphs_ms"] == 0 and rows["ddp"]["outside_graphs_ms"] > 0, rows["ddp"]
    for name in ("ddpopt", "distcompile_telemetry"):
        assert 0 < rows[name]["in_graphs_ms"] < rows[name]["median_ms"], rows[name]
    assert "sync ms" in out.stdout and "distcompile_telemetry" in out.stdout, out.stdout


@pytest.mark.long  # six variants compiled and stepped (~15 s warm, ~60 s cold)
def test_gpu_host_profile_dry_runs_on_cpu(tmp_path: Path) -> None:
    """``benchmarks/gpu_host_profile.py``, the first step of a GPU session (``gpu_session.sh``),
    runs on CPU with a tiny model and writes its JSON into a folder it makes: a GPU session is
    too rare to find out there that it broke."""
    root = Path(__file__).resolve().parents[2]
    out_dir = tmp_path / "not-yet"
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_host_profile.py"), "--device", "cpu", "--small",
         "--steps", "4", "--out-dir", str(out_dir)],
        capture_output=True, text=True, timeout=900, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((out_dir / "host-profile.json").read_text())["variants"]
    assert {"ddp", "compile_ddpopt", "dc_inductor"} <= set(rows), rows.keys()
    for name, row in rows.items():
        assert row["host_ms"] > 0 and row["wall_ms"] > 0, (name, row)


def test_gpu_session_names_only_variants_the_benchmark_has() -> None:
    """``benchmarks/gpu_session.sh`` runs unattended on a rare GPU: a variant renamed here would
    cost that session its benchmark."""
    from distcompile.tools.bench.variants import VARIANTS

    script = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_session.sh").read_text()
    named = [
        n
        for line in script.splitlines()
        if "--variants" in line
        for n in line.split("--variants")[1].split()[0].split(",")
    ]
    assert named, "gpu_session.sh names no variants"
    assert set(named) <= set(VARIANTS), sorted(set(named) - set(VARIANTS))
