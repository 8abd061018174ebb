"""The compat seam: no module but ``_torch_compat`` touches a private torch name, and its fallbacks work."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
from torch import fx
from torch.fx.passes.split_module import split_module

import distcompile
from distcompile import _torch_compat as compat

ROOT = pathlib.Path(distcompile.__file__).parent
#: Names bound to torch modules in our sources.
TORCH_ROOTS = {"torch", "dist", "fx", "nn", "F", "DDP"}
#: Private attributes of distcompile's own objects read across modules (not torch's).
OWN_PRIVATE = {"_torch_compat", "_capture", "_demo", "_bench", "_netns", "_exit", "_wrap_id"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_torch_uses(source: str) -> list[str]:
    """Every private torch name a module's source touches, as 'line: text'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names = node.module.split(".") + [a.name for a in node.names]
            if any(_private(n) for n in names):
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith("torch") and any(_private(n) for n in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _chain(node)
            # A private attribute on a torch module, or on any object that is not our own
            # (self._x is ours; model._comm_hooks is DDP's).
            if chain and chain[0] != "self" and node.attr not in OWN_PRIVATE:
                found.append(f"{node.lineno}: {'.'.join(chain)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_checker_finds_each_kind_of_private_use() -> None:
    src = (
        "import torch._dynamo\nfrom torch._inductor import config\nfrom torch.utils._pytree import tree_leaves\n"
        "x = torch._dynamo.utils.counters\ny = ddp._comm_hooks\nz = getattr(ddp, '_use_python_reducer')\n"
        "ok = self._reducer\nok2 = torch.compile\n"
    )
    assert sorted({int(u.split(":")[0]) for u in private_torch_uses(src)}) == [1, 2, 3, 4, 5, 6]


def test_no_module_but_the_seam_touches_private_torch_names() -> None:
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "_torch_compat" in path.relative_to(ROOT).parts:
            continue
        uses = private_torch_uses(path.read_text())
        if "integrations" in path.relative_to(ROOT).parts:
            # The glue to another stack touches that stack's own private names (Accelerate's
            # model list); only torch's count here.
            uses = [u for u in uses if u.split(": ", 1)[1].split(".")[0] in TORCH_ROOTS]
        if uses:
            offenders[str(path.relative_to(ROOT))] = uses
    assert not offenders, f"private torch names outside distcompile/_torch_compat/: {offenders}"


def test_tested_range_matches_pyproject() -> None:
    text = (ROOT.parent / "pyproject.toml").read_text()
    (a, b), (c, d) = compat.TESTED_RANGE
    assert f'"torch>={a}.{b},<{c}.{d + 1}"' in text


def test_untested_torch_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    compat.warn_if_untested.cache_clear()
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.warn_if_untested() is False
        assert compat.warn_if_untested() is False
    assert len(caught) == 1 and "torch 2.99.0" in str(caught[0].message)
    assert "2.11 to 2.15" in str(caught[0].message)
    compat.warn_if_untested.cache_clear()


def test_piece_names_without_split_module_metadata() -> None:
    # torch 2.11's split_module does not record partition_names (the bug behind this seam).
    gm = fx.symbolic_trace(torch.nn.Sequential(*[torch.nn.ReLU() for _ in range(12)]))
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    split = split_module(gm, None, lambda n: index[n.name])
    expected = [f"submod_{i}" for i in range(1, 13)]
    split.meta.pop("partition_names", None)
    assert compat.piece_names(split) == expected  # numeric order: submod_10 after submod_9


def test_missing_internal_raises_unsupported_torch_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.backends.distributed as ddp_optimizer

    monkeypatch.delattr(ddp_optimizer, "SubmodCompiler")
    with pytest.raises(
        distcompile.UnsupportedTorchError, match=r"torch 2\.\d+.*tested with torch 2\.11 to 2\.15"
    ):
        compat.piece_compiler_base()
