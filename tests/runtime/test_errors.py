"""Errors that need several ranks: a disagreeing or missing rank raises instead of hanging."""

from __future__ import annotations

import pytest

from tests import verify_workers, workers
from tests.harness import run_ranks


def test_a_comm_hook_with_compression_or_without_a_future_is_a_clear_error() -> None:
    for res in run_ranks(workers.custom_hook, 2):
        assert (
            "compression='bf16' and the DDP model's communication hook '_bf16_reference_hook'" in res["both"]
        )
        assert "'_returns_a_tensor' returned a Tensor" in res["broken"] and "Future" in res["broken"], res


def test_a_rank_that_captures_another_graph_raises_on_every_rank_naming_the_code() -> None:
    for rank, msg in enumerate(run_ranks(workers.desync_structure, 2, timeout=120)):
        assert "graph 0 differs between rank" in msg and "Their structure differs" in msg, (rank, msg)
        assert "call_function tanh" in msg and "workers.py:" in msg, msg  # the op and its code line


def test_batch_sizes_that_differ_between_ranks_train_as_under_eager_ddp() -> None:
    """Sizes may differ by data (Note [Graphs that differ by data]): rank 1 recompiles at other
    steps than rank 0, alone, and the ranks stay in sync."""
    import numpy as np

    results = run_ranks(workers.batch_sizes_differ, 2, timeout=300)
    for res in results:
        np.testing.assert_allclose(
            [b for _, b in res["losses"]], [a for a, _ in res["losses"]], rtol=1e-4, atol=1e-5
        )
        for a, b in zip(res["params"], res["ref_params"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(results[0]["params"], results[1]["params"]):
        np.testing.assert_array_equal(a, b)


def test_desync_missing_rank_times_out_with_a_clear_error() -> None:
    msg = run_ranks(workers.desync_missing, 2, timeout=120)[0]
    assert "rank(s) [1] did not compile graph 0 within 3 s" in msg
    seconds = float(msg.split("s ", 1)[0])
    assert seconds < 30, msg


def test_recompile_error_after_warmup() -> None:
    for msg in run_ranks(workers.recompile_forbidden, 2):
        assert "recompile='error' forbids recompiles" in msg, msg
        assert "size mismatch" in msg and "mark_dynamic" in msg, msg


def test_mark_dynamic_passes_through() -> None:
    assert run_ranks(workers.dynamic_no_recompile, 2) == [1, 1]


def test_fullgraph_names_the_break() -> None:
    for msg in run_ranks(workers.fullgraph_break, 2):
        assert "graph_break()" in msg and "models.py" in msg, msg


def test_peer_raising_in_forward_is_named() -> None:
    msg = run_ranks(workers.peer_failure, 2, "raise", timeout=180)[0]
    assert "rank 1 raised first: TorchRuntimeError" in msg and "same reduction dim" in msg, msg
    assert float(msg.split("s ", 1)[0]) < 60, msg


def test_killed_peer_gives_an_error_not_a_hang() -> None:
    msg = run_ranks(workers.peer_failure, 2, "kill", timeout=180, may_die=(1,))[0]
    assert "No other rank recorded an error" in msg and "bucket" in msg, msg
    assert msg.split("s ", 1)[1].startswith("rank 0: step 2, bucket "), msg  # where, first
    assert "a peer died" in msg, msg  # what happened, in words
    assert "(rank 1) while" in msg, msg  # and who: the rank behind gloo's peer address
    assert "ran out of data" in msg and "model.join()" in msg, msg  # uneven inputs: Join is the fix
    assert float(msg.split("s ", 1)[0]) < 60, msg


def test_stalled_peer_is_called_a_stall_not_a_death() -> None:
    msg = run_ranks(workers.peer_failure, 2, "stall", timeout=180)[0]
    assert "a peer stalled or the link timed out" in msg and "step 2, bucket" in msg, msg
    assert float(msg.split("s ", 1)[0]) < 8, msg  # the group's 3 s timeout, not the stall's end


@pytest.mark.parametrize("imaginary", [False, True], ids=["real", "complex-imaginary-part"])
def test_parameters_differing_across_ranks_are_detected(imaginary: bool) -> None:
    for msg in run_ranks(workers.params_differ, 2, imaginary):
        assert "parameter values at wrap time differs" in msg and "2.0.weight" in msg, msg
        assert "check_params=False" in msg


def test_nonfinite_gradients_stop_every_rank() -> None:
    for msg in run_ranks(workers.nonfinite, 2):
        assert msg.startswith("step 1: bucket") and "NaN/Inf" in msg, msg
        assert "0.0.weight" in msg, msg


def test_destroyed_process_group() -> None:
    for msg in run_ranks(workers.dead_group, 2):
        assert "process group is no longer usable" in msg, msg


@pytest.mark.long  # 48 s: in the long set, so that the README command stays under 8 minutes
def test_a_backward_inductor_cannot_compile_raises_a_compile_error_in_backward() -> None:
    """Inductor compiles each backward lazily, inside the user's backward(): its failure must
    still come as distcompile's CompileError with the next step down the ladder."""
    for msg in run_ranks(verify_workers.backward_compile_fails, 2, timeout=300):
        assert msg.startswith("rank ") and "compiling the backward of a piece" in msg, msg
        assert "AssertionError: an internal check failed" in msg, msg
        assert "backend='aot_eager'" in msg, msg


def test_ranks_whose_restart_counts_differ_share_one_store_prefix() -> None:
    """The SLURM failure of a restarted two-node job: each agent counts its own restarts, and a
    prefix built from that count split the ranks' keys (a DesyncError after desync_timeout_s)."""
    import numpy as np

    results = run_ranks(workers.restart_counts_differ, 2, timeout=120)
    first, second = results[0]["prefixes"][0]
    assert results[0]["prefixes"] == results[1]["prefixes"] == [(first, second)] * 2, results
    assert first != second  # each wrap its own keys
    for a, b in zip(results[0]["grads"], results[1]["grads"]):
        np.testing.assert_array_equal(a, b)
