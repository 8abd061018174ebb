"""Checkpoints: atomic under SIGKILL mid-write, keep the last K, restore RNG."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from torch import nn

import distcompile

ROOT = Path(__file__).resolve().parents[2]


def test_keep_last_k_and_resume_rng(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        distcompile.save_checkpoint(
            str(tmp_path), model=model, optimizer=opt, step=step, keep=2, extra={"epoch": step // 2}
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003.pt", "step-00000004.pt"]
    expected_next = torch.randn(3)  # the RNG draw right after the last save
    fresh = nn.Linear(4, 4)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = distcompile.load_checkpoint(str(tmp_path), model=fresh, optimizer=fresh_opt)
    assert state["step"] == 4 and state["extra"] == {"epoch": 2}
    assert torch.equal(torch.randn(3), expected_next)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    assert distcompile.load_checkpoint(str(tmp_path / "empty"), model=fresh) is None


def test_sigkill_mid_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import distcompile
        from torch import nn
        small = nn.Linear(2, 2)
        distcompile.save_checkpoint({str(tmp_path)!r}, model=small, optimizer=None, step=1)
        print("first written", flush=True)
        big = nn.Linear(8192, 8192)  # 256 MiB of weights: the write takes a while
        distcompile.save_checkpoint({str(tmp_path)!r}, model=big, optimizer=None, step=2)
        print("second written", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "first written"
        deadline = time.monotonic() + 120
        while not any(".tmp-" in p.name for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "the second write never started"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "second written" not in proc.stdout.read()
    assert distcompile.latest_checkpoint(str(tmp_path)).endswith("step-00000001.pt")
    state = distcompile.load_checkpoint(str(tmp_path), model=nn.Linear(2, 2))
    assert state["step"] == 1
    # The next checkpoint written removes the half-written one the kill left.
    assert any(".tmp-" in p.name for p in tmp_path.iterdir())
    distcompile.save_checkpoint(str(tmp_path), model=nn.Linear(2, 2), optimizer=None, step=3)
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir()), sorted(tmp_path.iterdir())


class _Wrapped(nn.Module):
    """Stands for a wrapped model's state dict layout (keys under ``module.``, as DDP's)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def test_checkpoint_of_a_wrapped_model_loads_into_the_plain_model(tmp_path: Path) -> None:
    trained = _Wrapped(nn.Linear(4, 4))
    distcompile.save_checkpoint(str(tmp_path), model=trained, optimizer=None, step=0)
    plain = nn.Linear(4, 4)
    assert distcompile.load_checkpoint(str(tmp_path), model=plain)["step"] == 0
    assert torch.equal(plain.weight, trained.module.weight)
    # and the other way round: a plain model's checkpoint into the wrapped layout
    distcompile.save_checkpoint(str(tmp_path / "plain"), model=nn.Linear(4, 4), optimizer=None, step=1)
    distcompile.load_checkpoint(str(tmp_path / "plain"), model=_Wrapped(nn.Linear(4, 4)))


def test_missing_checkpoint_directory_is_reported(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    missing = str(tmp_path / "nope")
    with caplog.at_level("INFO", logger="distcompile"):
        assert distcompile.load_checkpoint(missing, model=nn.Linear(4, 4)) is None
    assert any("does not exist: starting fresh" in r.getMessage() for r in caplog.records)
    try:
        distcompile.load_checkpoint(missing, model=nn.Linear(4, 4), strict=True)
    except FileNotFoundError as exc:
        assert "nope" in str(exc) and "strict=False" in str(exc)
    else:
        raise AssertionError("strict=True must raise for a missing directory")
