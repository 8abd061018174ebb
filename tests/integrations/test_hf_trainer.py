"""The Hugging Face Trainer with distcompile against the Trainer's own DDP, on 2 gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import run_ranks
from tests.integrations import stacks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

#: aot_eager runs eager's kernels: losses and parameters agree to float32 rounding.
RTOL, ATOL = 1e-5, 1e-6


def _close(a: list, b: list, what: str) -> None:
    for i, (p, q) in enumerate(zip(a, b)):
        np.testing.assert_allclose(p, q, rtol=RTOL, atol=ATOL, err_msg=f"{what}: tensor {i}")


@pytest.mark.long  # two Trainer runs, a resume and a plain load on 2 ranks (about 40 s); the next test runs the Trainer in the README's command
def test_trainer_accumulation_checkpoint_resume(tmp_path) -> None:
    ref, ours = zip(*run_ranks(stacks.both, 2, stacks.hf_trainer_loop, str(tmp_path / "out"), timeout=600))
    for rank, (a, b) in enumerate(zip(ref, ours)):
        assert b["type"] == "DistCompiledModule", b["type"]
        np.testing.assert_allclose(
            b["losses"], a["losses"], rtol=RTOL, atol=ATOL, err_msg=f"losses, rank {rank}"
        )
        _close(b["params"], a["params"], f"final parameters, rank {rank}")
        _close(b["resumed_params"], b["params"], f"resumed from checkpoint-2, rank {rank}")
        _close(b["plain_load"], b["params"], f"save_model loaded into a plain model, rank {rank}")
        # 3 optimizer steps of 2 micro-batches; the resumed run adds 1 on its own model.
        assert b["synced_steps"] == 3, b["synced_steps"]
    _close(ours[1]["params"], ours[0]["params"], "ranks in sync")


def test_enable_after_a_first_train_raises_instead_of_training_under_ddp(tmp_path) -> None:  # noqa: ANN001
    for msg in run_ranks(stacks.trainer_enable_after_train, 2, str(tmp_path), timeout=300):
        assert "already prepared" in msg and "before train()" in msg, msg
