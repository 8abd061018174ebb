"""``model.attach_optimizer``: the optimizer stepped bucket by bucket inside backward, on real
gloo ranks, against the plain loop on distcompile and on eager DDP.

Tolerances: aot_eager runs eager's kernels. Against the plain loop on distcompile the
parameters are equal to rtol 1e-6 / atol 1e-7 (a per-parameter optimizer stepped on a subset
computes the same numbers; foreach kernels group tensors differently); against eager DDP
rtol 1e-4 / atol 1e-5 over 4 steps. Replicas bitwise equal across ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import optim_workers
from tests.harness import run_ranks


def _check(results: list[dict], steps: int = 4) -> None:
    for rank, res in enumerate(results):
        eager, plain, ours = res["params"]
        for i, (a, b, c) in enumerate(zip(eager, plain, ours)):
            np.testing.assert_allclose(
                c, b, rtol=1e-6, atol=1e-7, err_msg=f"param {i} vs plain loop, rank {rank}"
            )
            np.testing.assert_allclose(
                c, a, rtol=1e-4, atol=1e-5, err_msg=f"param {i} vs eager DDP, rank {rank}"
            )
        losses = np.array(res["losses"])
        np.testing.assert_allclose(losses[:, 2], losses[:, 1], rtol=1e-6, err_msg=f"losses, rank {rank}")
        assert res["ranks_equal"], f"rank {rank}: replicas apart"
        # Stepped inside backward: when backward() returned, every parameter had moved.
        assert res["moved_in_backward"] == [res["nparams"]] * steps, res["moved_in_backward"]
        assert res["buckets"] >= 4


@pytest.mark.parametrize(
    ("opt", "mode", "world"),
    [
        ("sgd", "plain", 2),
        ("adam", "no_sync", 2),
        ("adamw", "resume", 2),
        # The rest in the long set (CI runs it after the README's command).
        pytest.param("adamw", "plain", 3, marks=pytest.mark.long),
        pytest.param("adamw_foreach", "calls_step", 2, marks=pytest.mark.long),
        pytest.param("sgd", "no_sync", 3, marks=pytest.mark.long),
        pytest.param("adamw", "scheduler", 2, marks=pytest.mark.long),
    ],
)
def test_attached_optimizer_equals_the_plain_loop(opt: str, mode: str, world: int) -> None:
    results = run_ranks(optim_workers.attached_parity, world, opt, mode)
    _check(results)
    if mode == "scheduler":
        assert results[0]["lr"] == pytest.approx(1e-3 * 0.5**4)


def test_refusals_name_the_cause_and_the_fix() -> None:
    (out, _) = run_ranks(optim_workers.refusals, 2)
    assert "LBFGS" in out["lbfgs"] and "per_parameter=True" in out["lbfgs"]
    assert "_MySGD" in out["subclass"] and "per_parameter=True" in out["subclass"]
    assert "torch.optim.Optimizer" in out["not_optimizer"]
    assert "1 parameter(s) the wrapped model does not train" in out["stranger"]
    assert out["vouched"] == "no error"
    assert "gradient clipping" in out["clipped"] and "already stepped in backward" in out["clipped"]
    assert "closure" in out["closure"]
    assert out["detached_is_plain"] == "True"
