"""torch.compile's fine-grained tracing APIs and odd-but-legal forward code, on real ranks.

Each model trains 4 SGD steps with distcompile (aot_eager) and with eager DDP on 2 ranks;
losses and parameters must agree (rtol 1e-4, atol 1e-5) and ranks must stay in sync.
"""

from __future__ import annotations

import pytest

from tests import workers
from tests.harness import run_ranks
from tests.runtime.test_parity import TOL, _check

CASES = [
    "compiler_disable",
    "disable_nonrecursive",
    "allow_in_graph",
    "disallow_in_graph",
    "is_compiling",
    "custom_op",
    "func_transforms",
    "jacrev",
    "numpy",
    "checkpoint",
]


@pytest.mark.parametrize("model", CASES)
def test_parity(model: str) -> None:
    results = run_ranks(workers.parity, 2, model, "aot_eager")
    _check(results, TOL["aot_eager"])
    if model in ("compiler_disable", "disallow_in_graph", "disable_nonrecursive"):
        assert results[0]["graphs"] >= 2, "these APIs split the forward into several graphs"


#: Cases whose graphs are only cut or joined by TorchDynamo (nothing odd inside them for the
#: FLOP count): their auto-bucket runs are in the long set, the others in the README's command.
_PLAIN_GRAPHS = {
    "compiler_disable",
    "disable_nonrecursive",
    "allow_in_graph",
    "disallow_in_graph",
    "is_compiling",
}


@pytest.mark.parametrize(
    "model",
    [pytest.param(m, marks=pytest.mark.long) if m in _PLAIN_GRAPHS else m for m in [*CASES, "convbn"]],
)
def test_parity_with_auto_buckets(model: str) -> None:
    """bucket_cap_mb='auto' counts FLOPs on each graph: odd graphs must plan (or fall back) and match."""
    results = run_ranks(workers.parity, 2, model, "aot_eager", "auto")
    _check(results, TOL["aot_eager"])
    assert results[0]["fingerprints"] == results[1]["fingerprints"]
