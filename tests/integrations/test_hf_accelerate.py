"""Accelerate with distcompile against Accelerate's own DDP, on 2 gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import run_ranks
from tests.integrations import stacks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

#: aot_eager runs eager's kernels: losses and parameters agree to float32 rounding.
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.long  # two accelerate runs with a save and a load (about 20 s); the errors below stay in the README's command
def test_accelerate_prepare_accumulate_save_load(tmp_path) -> None:
    ref, ours = zip(*run_ranks(stacks.both, 2, stacks.accelerate_loop, str(tmp_path / "state"), timeout=600))
    for rank, (a, b) in enumerate(zip(ref, ours)):
        np.testing.assert_allclose(b["losses"], a["losses"], rtol=RTOL, atol=ATOL, err_msg=f"rank {rank}")
        for i, (p, q) in enumerate(zip(b["params"], a["params"])):
            np.testing.assert_allclose(p, q, rtol=RTOL, atol=ATOL, err_msg=f"param {i}, rank {rank}")
        assert b["type"] == "DistCompiledModule" and b["unwrapped"] == "GPT2LMHeadModel", b
        assert b["synced_steps"] == 3, "6 micro-batches, 2 per optimizer step: 3 synchronized steps"
        assert min(b["buckets"][:1]) > 0, b["buckets"]
        assert b["restored"] and b["plain_keys_load"], b
    for i, (p, q) in enumerate(zip(ours[0]["params"], ours[1]["params"])):
        np.testing.assert_array_equal(p, q, err_msg=f"param {i} differs between ranks")


def test_wrap_then_prepare_is_an_error_not_a_silent_double_reduce() -> None:
    for msg in run_ranks(stacks.accelerate_wrong_order, 2, timeout=300):
        assert "called from inside a torch.nn.parallel.DistributedDataParallel" in msg, msg
        assert "docs/integrations.md" in msg, msg


@pytest.mark.parametrize("when", ["after_prepare", "twice"])
def test_enable_after_prepare_or_twice_with_other_options_raises(when: str) -> None:
    for msg in run_ranks(stacks.accelerate_enable_late, 2, when, timeout=300):
        if when == "after_prepare":
            assert "already prepared 1 model(s) (GPT2LMHeadModel)" in msg and "before train()" in msg, msg
        else:
            assert (
                "already called on this Accelerator with other options (backend: 'eager' -> 'aot_eager')"
                in msg
            ), msg
