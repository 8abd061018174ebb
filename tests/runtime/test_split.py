"""Shared weights reduced by use (Note [Shared weights reduced by use]) on real gloo ranks.

A GPT with a tied embedding (63% of its parameters) against eager DDP with the same
batches. Tolerances: aot_eager runs eager's kernels, but the split adds the tied weight's
two contributions after reducing each, so sums round differently: gradients within 1e-5
of the largest gradient of each parameter, parameters after 3 SGD steps within rtol 1e-4 /
atol 1e-5; under bf16 compression (against eager DDP in fp32) 2e-2. Replicas bitwise
equal across ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import split_workers
from tests.harness import run_ranks


def _check(results: list[dict], tol: float = 1e-5) -> None:
    for rank, res in enumerate(results):
        assert max(res["grad_diff"]) <= tol, (rank, res["grad_diff"])
        ptol = 1e-4 if tol <= 1e-5 else 5e-2
        for i, (a, b) in enumerate(zip(res["params"], res["ref_params"])):
            np.testing.assert_allclose(a, b, rtol=ptol, atol=ptol / 10, err_msg=f"param {i}, rank {rank}")
        assert res["ranks_equal"], f"rank {rank}: replicas apart"


def _tail(res: dict) -> tuple[str, int]:
    (kind, _, nbytes) = next(b for b in res["buckets"] if b[1] == ["wte.weight"])
    return kind, nbytes


@pytest.mark.parametrize(
    ("mode", "world"),
    [
        ("plain", 2),
        ("no_sync", 2),
        ("find_unused", 2),
        # The rest in the long set (CI runs it after the README's command).
        pytest.param("plain", 3, marks=pytest.mark.long),
        pytest.param("grad_as_view", 2, marks=pytest.mark.long),
        pytest.param("bf16", 2, marks=pytest.mark.long),
    ],
)
def test_tied_embedding_reduced_by_use_matches_eager_ddp(mode: str, world: int) -> None:
    results = run_ranks(split_workers.split_parity, world, mode)
    _check(results, tol=2e-2 if mode == "bf16" else 1e-5)
    res = results[0]
    assert "split: wte.weight" in res["split"], res["split"]
    first = res["layouts"][0]  # the first step's buckets
    names = [b[1] for b in first]
    holder = "wte.weight@" + res["split"].split("piece ")[1].split(" ")[0]
    part = next(i for i, b in enumerate(names) if holder in b)
    assert part < names.index(["wte.weight"]), names  # the output projection's share goes early,
    assert len(names[part]) > 1, names  # in the bucket of its segment (ln_f's)
    assert first[names.index(["wte.weight"])][0] == "RowBucket", first
    assert not [w for w in res["warnings"] if "no captured graph" in w], res[
        "warnings"
    ]  # parts are not eager
    if mode != "no_sync":  # the tail carries the rows looked up, not the table
        kind, nbytes = _tail(res)
        assert kind == "RowBucket" and nbytes <= 0.25 * res["wte_bytes"], (kind, nbytes, res["wte_bytes"])
    else:  # the accumulated micro-batch made the whole table nonzero: from then on reduced whole
        _reduced_whole_after_the_first_step(res)


def _reduced_whole_after_the_first_step(res: dict) -> None:
    for layout in res["layouts"][1:]:
        assert not any("@" in n for _, names in layout for n in names), layout  # no parts
        assert [kind for kind, names in layout if "wte.weight" in names] == ["FlatBucket"], layout


@pytest.mark.parametrize("mode", ["dense", pytest.param("dense_find_unused", marks=pytest.mark.long)])
def test_a_dense_table_drops_its_parts_and_stays_exact(mode: str) -> None:
    # 2 ranks touch most of the 128 rows every step: the parts only doubled the table's bytes.
    # find_unused_parameters: the layout frozen at the first step (Note [Graphs that differ by data]).
    results = run_ranks(split_workers.split_parity, 2, mode, 4)
    _check(results)
    res = results[0]
    assert any("@" in n for _, names in res["layouts"][0] for n in names), res["layouts"][0]
    _reduced_whole_after_the_first_step(res)


def test_split_off_is_one_reduction_per_parameter_and_verify_accepts_the_split() -> None:
    off = run_ranks(split_workers.split_parity, 2, "off")
    _check(off)
    assert off[0]["split"] == "" and all(b[0] == "FlatBucket" for b in off[0]["buckets"])
    assert not any("@" in n for b in off[0]["buckets"] for n in b[1])
    checked = run_ranks(split_workers.split_parity, 2, "verify")  # raises VerificationError if wrong
    _check(checked)


def test_a_row_bucket_gathers_each_ranks_rows_and_sums_them_alike_everywhere() -> None:
    # Note [Rows gathered, not agreed]: rows touched by several ranks are added once each, a
    # rank without a gradient sends padding only, and every rank writes the same bits.
    results = run_ranks(split_workers.row_bucket_sums, 3)
    for rank, res in enumerate(results):
        assert res["collective"] == "all-gather", res["collective"]
        assert res["sent"] < res["table_bytes"] / 3, (res["sent"], res["table_bytes"])
        assert res["grad"] is not None, f"rank {rank}: no .grad although two ranks produced one"
        np.testing.assert_allclose(res["grad"], res["expected"], rtol=1e-6, atol=1e-7, err_msg=f"rank {rank}")
        assert np.array_equal(res["grad"], results[0]["grad"]), f"rank {rank}: a sum apart from rank 0's"


def test_a_table_also_read_outside_the_graphs_is_reduced_whole_and_stays_exact() -> None:
    # An L2 penalty on the tied table in the training loop gives every row a gradient, more rows
    # than the lookups bound: found at the first write, the table is reduced whole that step and
    # after (before 2026-11-29 the rows past the bound were left out, silently: gradients 60% off).
    results = run_ranks(split_workers.split_parity, 2, "eager_use")
    _check(results)
    res = results[0]
    assert any("more rows than its lookups touch" in w for w in res["warnings"]), res["warnings"]
    _reduced_whole_after_the_first_step(res)


def test_a_table_tried_by_rows_again_warns_once() -> None:
    # A tied table's rows are tried again after DENSE_FOR steps on a bucket built anew; each
    # try overflows and reduces whole again (exact), and said it again before 2026-11-29.
    results = run_ranks(split_workers.split_parity, 2, "eager_use_retry", 8)
    _check(results)
    layouts = results[0]["layouts"]
    assert sum(any("@" in n for _, names in layout for n in names) for layout in layouts) >= 2, layouts
    warned = [w for w in results[0]["warnings"] if "more rows than its lookups touch" in w]
    assert len(warned) == 1, warned


def test_rows_past_the_bound_reduce_the_table_whole_on_every_rank_even_a_joined_one() -> None:
    results = run_ranks(split_workers.row_bucket_overflow, 2, timeout=120)
    assert [r["overflowed"] for r in results] == [True, True], results  # the same decision on both
    np.testing.assert_array_equal(results[0]["grad"], results[0]["expected"])  # no row left out
