"""The main job and the example, run the way a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.harness import child_env

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python *args`` with the checkout importable and one thread per process."""
    env = child_env(OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


def _demo(tmp_path: Path, *extra: str) -> str:
    """``distcompile demo`` for 4 steps (aot_eager) with TensorBoard logs; its output, checked
    for what every run prints: the table, the loss check, distcompile's telemetry line and logs."""
    logdir = tmp_path / "runs"
    proc = run(
        "-m", "distcompile.tools.cli", "demo", "--steps", "4", "--backend", "aot_eager", "--logdir", str(logdir),
        *extra, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for variant in ("eager DDP", "distcompile"):
        assert any(line.startswith(variant) and " s " in line for line in out.splitlines()), out
    assert "losses of distcompile vs eager DDP" in out and "-> OK" in out, out
    # distcompile's own telemetry, and one line on what this machine can gain.
    (line,) = [x for x in out.splitlines() if x.startswith("distcompile:") and "all-reduce" in x]
    comm, over, exposed = (
        float(v)
        for v in re.search(
            r"all-reduce ([\d.]+) ms = overlapped ([\d.]+) \+ exposed ([\d.]+) ms", line
        ).groups()
    )
    assert comm > 0 and abs(over + exposed - comm) <= 0.1 + 1e-9, line  # each rounded to 0.1 ms
    assert "Little to gain on this machine" in out or "of its" in out, out
    acc = EventAccumulator(str(logdir / "distcompile"))
    acc.Reload()
    assert len(acc.Scalars("train/loss")) == 4
    engine = EventAccumulator(str(logdir / "distcompile" / "engine"))
    engine.Reload()
    steps = engine.Scalars("step/time_ms")
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert all(s.value > 0 for s in steps)
    assert "plan/graph_0/text_summary" in engine.Tags()["tensors"]
    return out


def test_demo_prints_table_and_writes_tensorboard(tmp_path: Path) -> None:
    """The demo without flags beyond its length and backend (the README's first command runs 20
    steps on Inductor): eager DDP and distcompile only."""
    out = _demo(tmp_path)
    assert "DDPOptimizer" not in out, out


@pytest.mark.long  # four variants of two fresh ranks each (about a minute on 2 loaded cores)
def test_demo_compare_adds_ddpoptimizer_and_regional_compilation(tmp_path: Path) -> None:
    out = _demo(tmp_path, "--compare")
    for variant in ("torch.compile, DDPOptimizer", "regional compile"):
        assert f"losses of {variant} vs eager DDP" in out, out
        assert any(line.startswith(variant) and " s " in line for line in out.splitlines()), out


@pytest.mark.long  # torchrun and the example script on two fresh ranks; test_local_launcher runs torchrun too
def test_example_trainer_under_torchrun(tmp_path: Path) -> None:
    proc = run(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "train_gpt.py"),
        "--distcompile",
        "--backend",
        "eager",
        "--steps",
        "3",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step    2  loss" in proc.stdout, proc.stdout


def test_cli_rejects_bad_arguments(tmp_path: Path) -> None:
    proc = run("-m", "distcompile.tools.cli", "demo", "--steps", "1", timeout=60)
    assert proc.returncode == 2 and "--steps" in proc.stderr
    # A cap that is not positive: said before any capture (it was a ValueError from the planner).
    proc = run("-m", "distcompile.tools.cli", "explain", "--bucket-cap-mb", "-1", timeout=60)
    assert proc.returncode == 2 and "--bucket-cap-mb: -1 is not a positive number" in proc.stderr, proc.stderr
    # An event log that is not there: said, not "no events recorded" with success.
    proc = run("-m", "distcompile.tools.cli", "events", str(tmp_path / "missing.jsonl"), timeout=60)
    assert proc.returncode == 1 and "no such file" in proc.stderr, (proc.returncode, proc.stderr)


def test_explain_refuses_a_cap_that_is_not_positive() -> None:
    import torch

    import distcompile

    with pytest.raises(distcompile.ConfigError, match="bucket_cap_mb=-1 must be a positive number"):
        distcompile.explain(torch.nn.Linear(2, 2), torch.zeros(1, 2), bucket_cap_mb=-1)


def test_explain_cli() -> None:
    proc = run(
        "-m", "distcompile.tools.cli", "explain", "--n-layer", "2", "--bucket-cap-mb", "0.2", timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "1 graph(s), 0 graph break(s)" in proc.stdout and "bucket 0:" in proc.stdout, proc.stdout
    assert "wte.weight x2" in proc.stdout


@pytest.mark.long
def test_demo_over_a_shaped_link(tmp_path: Path) -> None:
    from distcompile.tools.bench.netns import can_make_namespaces

    reason = can_make_namespaces()
    if reason:
        pytest.skip(reason)
    proc = run(
        "-m", "distcompile.tools.cli", "demo", "--steps", "3", "--backend", "aot_eager",
        "--logdir", str(tmp_path / "runs"), "--link", "200mbit", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks on cpu (200mbit)" in proc.stdout and "-> OK" in proc.stdout, proc.stdout


@pytest.mark.long  # a cold Inductor compile split between the demo's two ranks (about 40 s)
def test_the_demos_compile_sharing_wait_prints_no_c10d_lines(tmp_path: Path) -> None:
    """Issue 45: while one rank waited for the other's share of the compiles, the store's
    timed-out waits made c10d print `socket.cpp ... waitForInput ... likely a timeout` twice a
    second; a new user read them as a failure. Compile sharing now polls (Note [The control plane])."""
    env_cache = tmp_path / "inductor"
    proc = subprocess.run(
        [sys.executable, "-m", "distcompile.tools.cli", "demo", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=900,
        env=child_env(OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(env_cache)),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiles split between ranks" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    noisy = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "socket.cpp" in line or "waitForInput" in line
    ]
    assert not noisy, noisy[:5]


@pytest.mark.parametrize("flag", ["--chaos", "--control-plane"])
def test_checkout_harnesses_are_not_subcommands(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The installed package ships what users run: the chaos run and the control-plane
    simulator live in the checkout's benchmarks/, and the old flags say where."""
    from distcompile.tools.cli import main

    with pytest.raises(SystemExit):
        main(["bench", flag])
    assert "python benchmarks/" in capsys.readouterr().err


def test_the_package_reaches_nothing_outside_itself() -> None:
    """No module of the installed package finds files of a checkout by walking up from its own
    folder (``os.pardir``): from a wheel there is nothing there."""
    import ast

    import distcompile

    root = Path(distcompile.__file__).parent
    found = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "pardir"
    ]
    assert not found, f"modules reaching outside the package: {found}"
