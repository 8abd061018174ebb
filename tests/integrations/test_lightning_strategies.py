"""Lightning's Trainer and Fabric with distcompile's strategies against Lightning's own DDP, on 2 ranks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import run_ranks
from tests.integrations import stacks

pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

#: aot_eager runs eager's kernels: losses and parameters agree to float32 rounding.
RTOL, ATOL = 1e-5, 1e-6


def _compare(ref: list[dict], ours: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(ref, ours)):
        np.testing.assert_allclose(
            b["losses"], a["losses"], rtol=RTOL, atol=ATOL, err_msg=f"losses, rank {rank}"
        )
        for i, (p, q) in enumerate(zip(b["params"], a["params"])):
            np.testing.assert_allclose(p, q, rtol=RTOL, atol=ATOL, err_msg=f"param {i}, rank {rank}")
        assert b["plain_keys_load"], "the checkpoint must load into a plain model"
        assert b.get("restored", True), "loading the checkpoint must restore the parameters"
        assert b["synced_steps"] == 3, "6 micro-batches, 2 per optimizer step: 3 synchronized steps"
    for i, (p, q) in enumerate(zip(ours[0]["params"], ours[1]["params"])):
        np.testing.assert_array_equal(p, q, err_msg=f"param {i} differs between ranks")


@pytest.mark.long  # Lightning's loops on 2 ranks run in the long set (20-70 s each)
def test_fabric_strategy(tmp_path) -> None:
    _compare(*zip(*run_ranks(stacks.both, 2, stacks.fabric_loop, str(tmp_path / "fabric.ckpt"), timeout=600)))


@pytest.mark.long  # about 35 s; the README's command runs no Lightning loop (each is 20-70 s)
def test_trainer_strategy(tmp_path) -> None:
    ref, ours = zip(
        *run_ranks(stacks.both, 2, stacks.lightning_trainer_loop, str(tmp_path / "out"), timeout=600)
    )
    _compare(ref, ours)
    # Lightning runs training_step through the model's forward, so training_step is what is
    # captured (as with Lightning's own torch.compile support): the model's graph, the pieces
    # around self.log's graph breaks, and one recompile of Lightning's logging after its first
    # call. More would mean a recompile per step.
    assert ours[0]["graphs"] <= 4, (
        f"{ours[0]['graphs']} graphs: the training step must not recompile every step"
    )


@pytest.mark.long  # two 2-epoch fits with validation: about a minute on 2 cores
def test_fit_with_validation_recompiles_once_and_a_second_fit_reuses_the_first(tmp_path) -> None:
    ref, ours = zip(*run_ranks(stacks.both, 2, stacks.lightning_fit_recompiles, str(tmp_path), timeout=900))
    for rank, (a, b) in enumerate(zip(ref, ours)):
        for i, (p, q) in enumerate(zip(b["params"], a["params"])):
            np.testing.assert_allclose(p, q, rtol=RTOL, atol=ATOL, err_msg=f"param {i}, rank {rank}")
        first, second = b["fits"]
        # Training (a graph and the break after it), validation's first batch (no grad: two
        # inference graphs), its smaller last batch (the batch dimension made dynamic: two more);
        # nothing in the second epoch, nothing in the second fit.
        assert first["graphs"] <= 6, first
        assert second["graphs"] == first["graphs"], (first, second)
        reasons = " ".join(first["recompiles"])
        assert "_trainer" not in reasons and "_logger_connector" not in reasons, reasons
