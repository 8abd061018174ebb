"""The overlap benchmark runs end to end on loopback (tiny model, 2 steps a variant); no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distcompile.tools.bench.variants import VARIANTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(2400)  # every variant also starts twice alone (cold and warm cache): minutes
def test_benchmark_end_to_end_on_loopback(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "overlap.py"),
            "--small",
            "--rounds",
            "1",
            "--block",
            "2",
            "--warmup",
            "1",
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=2300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*-overlap-loopback-small.json")
    res = json.loads(js.read_text())
    assert set(res["variants"]) == set(VARIANTS)
    for name, r in res["variants"].items():
        assert "error" not in r, (name, r)
        assert r["steps"] == 2 and r["median_ms"] > 0 and r["warm_first_step_s"] > 0, (name, r)
        assert r["peak_rss_mb"] > 100, (name, r)  # torch alone is more: a real measurement
        assert r["cold_first_step_s"] > 0, (name, r)
    assert res["floor"]["floor_ms"] > 0 and res["meta"]["link"] == "loopback"
    assert res["floor"]["cpu_floor_ms"] >= res["floor"]["floor_ms"]
    assert all(p.startswith("measured costs") for p in res["variants"]["dc_auto"]["plan"]["planned_by"])
    md = js.with_suffix(".md").read_text()
    assert "floor" in md and "torch" in md and "dc_inductor_bf16" in md and "- dc_auto: [" in md
    assert "vs floor" in proc.stdout
