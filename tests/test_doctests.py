"""Every ``Example:`` block in the package runs (as a doctest) and shows what it claims.

Examples that need a process group or a training run are written as comments (``>>> #``);
the rest execute here, against the real code.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

import distcompile

ROOT = pathlib.Path(distcompile.__file__).parent
MODULES = sorted(
    ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in ROOT.rglob("*.py")
    if p.name != "__main__.py"
)


#: Modules that import an optional stack when imported (the integrations' extra).
NEEDS = {"distcompile.integrations.lightning_strategies": "pytorch_lightning"}


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} example lines of {name} failed (output above)"
    )
