"""The scripts of docs/integrations.md: shown there as they are, and they run on 2 ranks."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.harness import ROOT, child_env

EXAMPLES = sorted((pathlib.Path(ROOT) / "examples" / "integrations").glob("with_*.py"))
DOC = pathlib.Path(ROOT) / "docs" / "integrations.md"


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_doc_shows_the_script_as_it_is(script: pathlib.Path) -> None:
    marker = f"<!-- examples/integrations/{script.name} -->\n```python\n"
    doc = DOC.read_text()
    assert marker in doc, f"docs/integrations.md does not show {script.name}"
    shown = doc.split(marker, 1)[1].split("```\n", 1)[0]
    assert shown == script.read_text(), f"docs/integrations.md shows an old copy of {script.name}"


@pytest.mark.long
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_script_runs_on_two_ranks(script: pathlib.Path, tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("pytorch_lightning")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    env = child_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "loss " in out.stdout, out.stdout[-2000:]
    assert "[distcompile rank 0] graph 0 compiled" in out.stderr, out.stderr[-2000:]
