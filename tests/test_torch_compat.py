"""The compat seam: no module but ``_torch_compat`` touches a private torch name, and its fallbacks work."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch import fx
from torch.fx.passes.split_module import split_module

import distcompile
from distcompile import _torch_compat as compat
from tests import workers
from tests.harness import child_env, run_ranks

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
        elif isinstance(node, ast.Compare) and _compares_a_type_name(node):
            found.append(f"{node.lineno}: a type recognised by its name")
    return found


def _compares_a_type_name(node: ast.Compare) -> bool:
    """``type(e).__name__ == "SomeError"`` (or ``in ("A", "B")``): a class recognised by a
    name string, which reaches torch's internals as surely as an import and is invisible to
    the import checks. ``if __name__ == "__main__"`` is a module's own name, not a type's."""
    sides = [node.left, *node.comparators]
    names = [s for s in sides if isinstance(s, ast.Attribute) and s.attr in ("__name__", "__qualname__")]

    def literal(side: ast.AST) -> bool:
        if isinstance(side, ast.Constant):
            return isinstance(side.value, str)
        return isinstance(side, (ast.Tuple, ast.List, ast.Set)) and all(literal(e) for e in side.elts)

    return bool(names) and any(literal(s) for s in sides if s not in names)


def test_the_checker_finds_each_kind_of_private_use() -> None:
    src = (
        "import torch._dynamo\nfrom torch._inductor import config\nfrom torch.utils._pytree import tree_leaves\n"
        "x = torch._dynamo.utils.counters\ny = ddp._comm_hooks\nz = getattr(ddp, '_use_python_reducer')\n"
        "ok = self._reducer\nok2 = torch.compile\n"
        "a = type(e).__name__ == 'UncapturedHigherOrderOpError'\nb = e.__class__.__qualname__ in ('X', 'Y')\n"
        "if __name__ == '__main__': pass\nok3 = type(o).__name__ in KNOWN\n"
    )
    assert sorted({int(u.split(":")[0]) for u in private_torch_uses(src)}) == [1, 2, 3, 4, 5, 6, 9, 10]


def test_no_library_module_patches_with_unittest_mock() -> None:
    """Library code sets torch's state through the seam's context managers, never with
    ``unittest.mock`` (a test tool, whose patches hide which attribute of torch is relied on)."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                imported = [node.module]
            if any(name.split(".")[0] == "unittest" for name in imported):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"unittest imported by library code: {offenders}"


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


def test_the_piece_compiler_contract_holds() -> None:
    """What ``compile/segments.py`` relies on of DDPOptimizer's ``SubmodCompiler`` (through
    ``compat.piece_compiler_base``), checked on the installed release: an FX interpreter
    built as ``(split_gm, compiler, fake_mode)`` with ``fake_mode``, ``compile_submod(module,
    args, kwargs)``, ``fetch_args_kwargs_from_env``, ``fetch_attr`` and ``module``, whose
    ``run_node`` compiles each ``call_module`` piece, puts it in place under a
    ``compiled_`` name, and returns fake outputs for the next piece."""
    import inspect

    base = compat.piece_compiler_base()
    assert issubclass(base, fx.Interpreter)
    assert list(inspect.signature(base.__init__).parameters)[1:4] == ["module", "compiler", "fake_mode"]
    assert list(inspect.signature(base.compile_submod).parameters)[1:4] == ["input_mod", "args", "kwargs"]
    assert base.run_node is not fx.Interpreter.run_node
    for name in ("fetch_args_kwargs_from_env", "fetch_attr"):
        assert callable(getattr(base, name))

    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    split = split_module(gm, None, lambda n: min(index[n.name], 2), keep_original_order=True)
    seen = []

    def compiler(piece: fx.GraphModule, args: list) -> object:
        seen.append([tuple(a.shape) for a in args])
        return piece

    x = torch.randn(3, 4)
    fake_mode = compat.fake_mode_of([])
    interpreter = base(split, compiler, fake_mode)
    assert interpreter.fake_mode is fake_mode and interpreter.module is split
    out = interpreter.run(fake_mode.from_tensor(x))
    assert compat.is_fake(out) and tuple(out.shape) == (3, 2)
    assert seen == [[(3, 4)], [(3, 4)]]
    assert sorted(n for n, _ in split.named_children()) == ["compiled_submod_1", "compiled_submod_2"]
    split.recompile()
    assert torch.equal(split(x), gm(x))


def test_missing_internal_raises_unsupported_torch_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.backends.distributed as ddp_optimizer

    monkeypatch.delattr(ddp_optimizer, "SubmodCompiler")
    with pytest.raises(
        distcompile.UnsupportedTorchError, match=r"torch 2\.\d+.*tested with torch 2\.11 to 2\.15"
    ):
        compat.piece_compiler_base()


def test_the_process_groups_own_all_reduce_sums_as_dist_all_reduce() -> None:
    got = run_ranks(workers.started_all_reduces, 2)
    factor = 1 + 2  # ranks 0 and 1 scale by 1 and 2
    want = [[float(i * factor) for i in range(4)], [(1 + 2j) * factor, (3 - 1j) * factor]] * 2
    assert got == [want, want]


def test_counting_optimizers_in_backward_imports_nothing() -> None:
    """Every step asks whether ``_apply_optimizer_in_backward`` registered hooks; in a process
    that never imported it the answer is 0 without importing ``torch.distributed.optim``
    (0.4-0.8 s, scripting its functional optimizers), and once it registered some, their count."""
    script = (
        "import sys, torch\n"
        "from distcompile import _torch_compat as compat\n"
        "print(compat.optimizer_in_backward_count(), 'torch.distributed.optim' in sys.modules)\n"
        "from torch.distributed.optim import _apply_optimizer_in_backward\n"
        "_apply_optimizer_in_backward(torch.optim.SGD, torch.nn.Linear(2, 2).parameters(), {'lr': 0.1})\n"
        "print(compat.optimizer_in_backward_count())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "False", "2"], out.stdout
