"""The package layout stays true: who may import whom, no cycles, small modules and functions.

The rules are those of each package's ``__init__`` docstring and ``docs/design.md``.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess

import pytest

import distcompile

ROOT = pathlib.Path(distcompile.__file__).parent

LEAVES = {"errors", "_options", "_config", "_log", "_events", "_torch_compat", "_store", "_agreement"}
CORE = {"planning", "capture", "compile", "fleet", "runtime", "telemetry"}
#: Unit -> the units it may import (a unit is a subpackage or a top-level module).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_log": set(),
    "_events": set(),
    "_options": {"errors", "_torch_compat"},
    "_config": {"errors", "_options"},
    "_torch_compat": {"errors"},
    "_store": {"_torch_compat"},
    "_agreement": {"errors", "_torch_compat", "_store"},
    "planning": {"errors"},
    "capture": LEAVES | {"planning"},
    "compile": LEAVES | {"planning", "capture"},
    # Compile sharing: the seam it implements is compile's (compile/jobs.py); compile never imports it.
    "fleet": LEAVES | {"compile"},
    "runtime": LEAVES | {"planning", "capture", "compile", "fleet"},
    "telemetry": LEAVES | {"planning", "capture", "compile", "runtime"},
    "_wrap": LEAVES | CORE,
    "diagnostics": LEAVES | CORE | {"_wrap"},
    "models": set(),
    "__init__": LEAVES | CORE | {"_wrap", "diagnostics"},
    "tools": LEAVES | CORE | {"_wrap", "diagnostics", "models", "__init__"},
    # Other stacks' glue: the public API only; nothing imports it (the core never does).
    "integrations": {"__init__"},
}
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 85


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _runtime_imports(path: pathlib.Path, *, type_only: bool = False) -> set[str]:
    """distcompile modules ``path`` imports when it runs (with ``type_only``, also those of its
    ``TYPE_CHECKING`` blocks)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    return _imports_in(path.read_text(), module, package, type_only=type_only)


def _imports_in(source: str, module: str, package: str, *, type_only: bool = False) -> set[str]:
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "distcompile")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "distcompile":
                continue
            if node.module is None or target == "distcompile":  # from . import name
                found.update(f"{target}.{a.name}" for a in node.names)
            else:
                found.add(target)
    return {f for f in found if f != module}


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def test_every_unit_has_a_rule() -> None:
    units = {_unit(m) for m in _modules()}
    assert units <= set(ALLOWED), f"add a rule for {sorted(units - set(ALLOWED))} to ALLOWED"


def test_imports_follow_the_package_rules() -> None:
    broken = []
    for module, path in _modules().items():
        unit = _unit(module)
        for target in _runtime_imports(path):
            other = _unit(target)
            if other != unit and other not in ALLOWED[unit]:
                broken.append(f"{module} imports {target} ({unit} may not import {other})")
    assert not broken, "\n".join(broken)


def test_no_import_cycles() -> None:
    """No cycle, type-only imports included: a cycle that only type checkers follow still
    means two modules that cannot be read, or moved, one without the other."""
    modules = _modules()
    graph = {
        m: {t for t in _runtime_imports(p, type_only=True) if t in modules and t != m}
        for m, p in modules.items()
    }
    # A package's __init__ is imported with any of its modules; that edge is not a cycle.
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t) :] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_modules_and_functions_stay_small() -> None:
    big = []
    for module, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"{module}: {lines} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    big.append(f"{module}.{node.name}: {n} lines (max {MAX_FUNCTION_LINES})")
    assert not big, "\n".join(big)


#: The core a maintainer reads to change how a piece is compiled (compile sharing is in fleet/).
MAX_COMPILE_LINES = 1800


def test_compile_stays_a_local_compiler() -> None:
    """``compile/`` turns a graph into pieces and compiles them here; sharing between ranks
    lives in ``fleet/`` behind ``compile.jobs.SharedCompiles`` and is never imported by it."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "compile").glob("*.py"))
    assert lines < MAX_COMPILE_LINES, f"compile/ is {lines} lines"
    for path in (ROOT / "compile").glob("*.py"):
        assert not any(m.startswith("distcompile.fleet") for m in _runtime_imports(path, type_only=True)), (
            path
        )


def test_every_package_says_what_it_owns() -> None:
    for init in ROOT.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, (
            f"{init.relative_to(ROOT)} needs a docstring: what it owns and may import"
        )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from ..runtime.reducer import X", {"distcompile.runtime.reducer"}),
        ("from .. import _torch_compat as compat", {"distcompile._torch_compat"}),
        ("from .plan import GraphCosts", {"distcompile.planning.plan"}),
        ("if TYPE_CHECKING:\n    from ..telemetry.sink import T", set()),
        ("def f():\n    from ..telemetry import sink", {"distcompile.telemetry"}),
        ("import distcompile.models", {"distcompile.models"}),
    ],
)
def test_import_reader(source: str, expected: set[str]) -> None:
    # The reader itself, on code as if in distcompile/planning/costs.py.
    assert _imports_in(source, "distcompile.planning.costs", "distcompile.planning") == expected


def test_importing_distcompile_imports_no_other_stack() -> None:
    """The core never imports an integration's stack (they are optional and slow to import)."""
    import sys

    code = (
        "import sys, distcompile, distcompile.integrations; "
        "print(sorted({'accelerate', 'transformers', 'pytorch_lightning', 'lightning', 'lightning_fabric'} "
        "& set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_every_module_is_named_in_its_package_docstring_and_in_the_design_map() -> None:
    """Each package's ``__init__`` lists its modules (``name.py``) and docs/design.md names
    them all: a new module comes with its line in both."""
    design = (ROOT.parent / "docs" / "design.md").read_text()
    missing = []
    for init in sorted(ROOT.rglob("__init__.py")):
        package = init.parent
        if package == ROOT or package.name in ("_torch_compat", "integrations"):
            continue  # the top level has its own table rows; the seam's topics are listed apart
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for path in sorted(package.glob("*.py")):
            if path.name == "__init__.py":
                continue
            name = f"``{path.name}``"
            if name not in doc:
                missing.append(f"{path.relative_to(ROOT)} not named in {init.relative_to(ROOT)}")
            if f"`{path.name}`" not in design:
                missing.append(f"{path.relative_to(ROOT)} not named in docs/design.md")
    assert not missing, "\n".join(missing)


#: Committed files may be this large only under these folders (figures, measured results).
MAX_COMMITTED_BYTES = 200_000
LARGE_FILES_ALLOWED_UNDER = ("docs/", "benchmarks/results/")


def test_no_large_file_is_committed_outside_docs_and_results() -> None:
    """Training outputs and binary blobs stay out of git: what the examples write goes under
    ignored folders (``runs/``, ``ckpt/``), and a committed file over 200 kB must be a figure
    or a measured result."""
    repo = ROOT.parent
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout (an installed package)")
    listed = (
        subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True, timeout=60)
        .stdout.decode()
        .split("\0")
    )
    large = [
        f"{name} ({(repo / name).stat().st_size / 1e3:.0f} kB)"
        for name in listed
        if name
        and not name.startswith(LARGE_FILES_ALLOWED_UNDER)
        and (repo / name).is_file()
        and (repo / name).stat().st_size > MAX_COMMITTED_BYTES
    ]
    assert not large, "committed files over 200 kB outside docs/ and benchmarks/results/: " + ", ".join(large)


def test_the_ignore_file_covers_what_the_examples_write() -> None:
    """The folders the examples and the demo write are ignored by git."""
    ignored = (ROOT.parent / ".gitignore").read_text().split()
    for folder in ("runs/", "ckpt/", "lightning_logs/"):
        assert folder in ignored, f".gitignore does not name {folder}"
    for script in (ROOT.parent / "examples").rglob("*.py"):
        for written in ('"ckpt/', "'ckpt/"):
            assert written not in script.read_text(), f"{script.name} writes outside runs/"


def _type_names(path: pathlib.Path) -> set[str]:
    """Classes and CamelCase type aliases a module defines at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            name = node.targets[0].id
            if name[:1].isupper() and not name.isupper() and not isinstance(node.value, ast.Constant):
                names.add(name)
    return names


def test_one_meaning_per_type_name() -> None:
    """No two modules define a class (or a type alias) of the same name: a reader who meets
    ``Bucket`` knows which one it is."""
    where: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for name in _type_names(path):
            where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"type names defined in more than one module: {twice}"


def test_errors_live_in_one_module() -> None:
    """Every error a user may catch (a ``DistCompileError``) is defined in ``distcompile.errors``,
    listed in its ``__all__``, and importable from the top level too."""
    import importlib

    from distcompile import errors

    defined = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "__main__.py":
            continue  # runs a command when imported
        try:
            module = importlib.import_module(_module_name(path))
        except ImportError:  # glue to a stack this environment lacks (integrations/)
            continue
        defined += [
            (path.name, value)
            for value in vars(module).values()
            if isinstance(value, type)
            and issubclass(value, errors.DistCompileError)
            and value.__module__ == module.__name__
        ]
    elsewhere = [
        f"{name}: {value.__name__}" for name, value in defined if value.__module__ != "distcompile.errors"
    ]
    assert not elsewhere, f"errors defined outside distcompile/errors.py: {elsewhere}"
    assert sorted(errors.__all__) == sorted(value.__name__ for _, value in defined)
    for name in errors.__all__:
        assert getattr(distcompile, name, None) is getattr(errors, name), f"distcompile.{name}"
