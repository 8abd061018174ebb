"""What scripts do around the model after ``wrap``, against eager DDP on real gloo ranks
(Note [Parameters that change after wrap], Note [Copies of a wrapped model]).

Tolerances as tests/runtime/test_ddp_parity.py: aot_eager runs eager's kernels; losses and
parameters within rtol 1e-4 / atol 1e-5 of eager DDP's, the ranks' parameters bitwise equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from distcompile.runtime.model_watch import ModelWatch
from tests import around_workers
from tests.harness import run_ranks
from tests.runtime.test_ddp_parity import _check


def test_the_watch_sees_replaced_added_unfrozen_materialized_tensors_and_hooks() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    net[0].weight.requires_grad_(False)
    watch = ModelWatch(net)
    assert not watch.changed()
    with torch.no_grad():  # values and .data change nothing that is synchronized
        net[2].weight.add_(1)
    net[2].bias.data = torch.zeros(1)
    assert not watch.changed()
    net[0].weight.requires_grad_(True)
    assert watch.changed() and watch.compare().added == ("0.weight",)
    watch.take()
    net[2] = nn.Linear(2, 1)
    net[1].register_buffer("extra", torch.zeros(1))
    change = watch.compare()
    assert watch.changed() and change.replaced == ("2.weight", "2.bias") and change.buffers == ("1.extra",)
    watch.take()
    net.load_state_dict(net.state_dict(), assign=True)  # new tensors under the same names
    assert watch.changed() and len(watch.compare().replaced) == 6
    watch.take()
    net[1].register_forward_pre_hook(lambda m, args: None)  # TorchDynamo would not see it
    assert watch.changed() and watch.compare().hooks == ("1",)
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    watch = ModelWatch(meta)
    meta.to_empty(device="cpu")
    assert watch.changed() and watch.compare().replaced == ("weight", "bias")


@pytest.mark.parametrize("case", ["head", "unfreeze", "assign"])
def test_a_change_after_wrap_is_adopted_as_a_ddp_built_after_it(case: str, tmp_path) -> None:  # noqa: ANN001
    results = run_ranks(around_workers.changed_after_wrap, 2, case, str(tmp_path / "sd.pt"))
    _check(results)
    assert results[0]["graphs"] >= 1


def test_a_meta_model_is_refused_until_materialized_then_takes_rank_0s_values() -> None:
    results = run_ranks(around_workers.meta_materialized, 2)
    _check(results)
    for res in results:
        assert "meta device" in res["early"] and "to_empty" in res["early"], res["early"]


def test_ranks_that_change_the_model_differently_raise_naming_the_difference() -> None:
    errors = run_ranks(around_workers.changes_differ, 2)
    for rank, msg in enumerate(errors):
        assert "changed since wrap, differently" in msg, msg
        assert f"6.weight ({8 + rank}, 64)" in msg and "Every rank must make the same change" in msg, msg


def test_a_trainable_parameter_from_outside_the_model_is_refused_with_the_fix() -> None:
    for msg in run_ranks(around_workers.outside_parameter, 2):
        assert "(8,) torch.float32" in msg and "never be averaged" in msg and "register it" in msg, msg


@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
def test_copies_and_averages_of_a_wrapped_model_work_as_a_ddp_models(how: str) -> None:
    results = run_ranks(around_workers.copies, 2, how)
    _check(results)
    assert results[0]["type"] == "DistCompiledModule"
    for name, (ref, ours) in results[0]["evals"].items():
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.long  # repeated wrap, train and close cycles on 2 ranks (about 18 s)
def test_wrap_train_close_cycles_hold_no_model_and_no_memory() -> None:
    # Before close released TorchDynamo's hold (its guard managers' failure callback, kept by
    # weakref finalizers on the module), every closed model stayed alive with its gradients.
    for res in run_ranks(around_workers.wrap_close_cycles, 2, 8):
        assert res["alive"] == res["modules"] == res["reducers"] == 0, res
        assert res["rss"][-1] < 1.1 * res["rss"][0], res["rss"]


def test_wrapping_a_model_again_closes_the_earlier_wrapper() -> None:
    """A notebook cell run twice: the earlier wrapper, still open, kept its gradient hooks on the
    same parameters and warned of a second backward at the later one's every step."""
    results = run_ranks(around_workers.wrapped_again, 2)
    for res in results:
        for ref, ours in res["losses"]:
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
        for a, b in zip(res["params"], res["ref_params"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        assert res["first_closed"] and res["hooks"] == 1, res
        assert "wrapped again" in res["first_trains"], res["first_trains"]
        warnings = [s for s in res["said"] if s.startswith("WARNING")]
        assert len(warnings) == 1 and "earlier wrapper that is still open" in warnings[0], res["said"]
    np.testing.assert_array_equal(results[0]["params"][0], results[1]["params"][0])


def test_two_models_sharing_a_submodule_both_stay_open_and_it_is_said() -> None:
    for res in run_ranks(around_workers.shared_submodule_wrapped, 2):
        assert res["closed"] == (False, False), res
        assert (
            len(res["said"]) == 1 and "2 parameter(s) of this model (0.weight, 0.bias)" in res["said"][0]
        ), res


def test_a_model_cast_after_wrap_keeps_averaging() -> None:
    """``model.module.double()`` after wrap swaps each parameter's data, not the parameter: eager
    DDP's hooks sit on the old gradient accumulators and it stops averaging, silently (measured
    on torch 2.13: its gradients are then each rank's own). distcompile's hooks are on the
    parameters: it goes on averaging, in the buckets made at wrap (float32 here, so within
    float32's rounding of the float64 average)."""
    for res in run_ranks(around_workers.cast_after_wrap, 2):
        assert res["dtype"] == "torch.float64", res
        assert res["worst"][0] < 1e-6 and res["worst"][1] < 1e-6, res


def test_dcp_checkpoints_move_between_ddp_distcompile_and_torch_compile(tmp_path) -> None:  # noqa: ANN001
    results = run_ranks(around_workers.dcp_round_trip, 2, str(tmp_path))
    _check(results)
    ddp_keys, our_keys, compiled_keys = results[0]["keys"]
    assert ddp_keys == our_keys == compiled_keys and ddp_keys[0][0] == "0.0.bias", results[0]["keys"]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_hooks_added_after_the_first_steps_are_honoured(backend: str) -> None:
    # TorchDynamo does not guard on module hooks: without the watch, the compiled graphs ran
    # without them (losses 6.9e-2 and parameters 5.5e-3 from eager DDP's, no word).
    results = run_ranks(around_workers.hooks_after_steps, 2, backend, timeout=600)
    _check(results) if backend == "aot_eager" else None
    for res in results:
        np.testing.assert_allclose(res["params"][0], res["ref_params"][0], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    ("how", "verify"),
    [("retain", "forward"), ("two_forwards", "forward"), ("two_forwards", True), ("no_sync", True)],
)
def test_a_backward_after_the_step_trains_as_eager_ddp_and_is_said_once(how: str, verify: object) -> None:
    results = run_ranks(around_workers.backward_after_step, 2, how, verify)
    for res in results:
        for ref, ours in zip(res["ref"], res["ours"]):
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    apart = max(float(np.abs(a - b).max()) for a, b in zip(results[0]["ours"], results[1]["ours"]))
    if how == "no_sync":
        assert apart == 0.0 and results[0]["said"] == [], (apart, results[0]["said"])
        return
    # Eager DDP leaves the second backward's gradients local: the ranks drift apart, as here.
    assert apart > 1e-6, apart
    for res in results:
        said = res["said"]
        assert len(said) == 1 and "no_sync()" in said[0] and ".weight" in said[0], said


@pytest.mark.parametrize(("broadcast", "verify"), [(True, "forward"), (False, "forward"), (True, True)])
def test_a_buffer_the_forward_rebinds_each_step_is_taken_as_it_is(broadcast: bool, verify: object) -> None:
    results = run_ranks(around_workers.rebound_buffer, 2, broadcast, verify)
    _check(results)
    for res in results:
        np.testing.assert_allclose(*res["running"], rtol=1e-4, atol=1e-5)
        for ref, ours in res["evals"]:
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
        assert res["adopted"] == [] and res["steps"] == 10, (res["adopted"], res["steps"])


def test_a_discriminator_frozen_for_each_generator_step_trains_as_eager_ddp_unrebuilt() -> None:
    results = run_ranks(around_workers.toggled_discriminator, 2)
    _check(results)
    for res in results:
        assert res["adopted"] == [] and res["steps"] == 10, (res["adopted"], res["steps"])


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_calls_through_functional_call_train_as_eager_ddp(backend: str) -> None:
    # Stand-ins in the parameters' entries for one call: until 2026-11-30 they were adopted as
    # new parameters, and the reducer's hooks refused them (non-leaf tensors).
    results = run_ranks(around_workers.functional_calls, 2, backend)
    _check(results)
    for res in results:
        assert res["adopted"] == [] and res["steps"] == 5, (res["adopted"], res["steps"])
