"""No host read in a steady-state step (issue 55): on a GPU, an operation whose result the host
reads (``.item()``, ``nonzero``, a boolean-mask index, ``torch.equal``), or a Python number
copied into a device tensor (``t[i] = 1.0``), stops the host until the stream catches up, and
every launch queued behind it waits. Counted here on CPU, where the same operations appear,
under torch's profiler: the model reads nothing itself, so whatever is found is distcompile's
(the row bucket used to read its union's size, four reads a step; on the first GPU run of this
test, `set_sync_debug_mode("error")` caught its `touched[-1] = 1.0`)."""

from __future__ import annotations

import pytest

from tests import workers
from tests.harness import run_ranks


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_warm_default_steps_read_nothing_on_the_host(backend: str) -> None:
    for res in run_ranks(workers.host_reads, 2, backend):
        assert "RowBucket" in res["buckets"], res["buckets"]  # the table is reduced by rows
        assert res["ops"] > 100 and res["found"] == [], res["found"]


def test_a_table_looked_up_more_than_at_the_first_step_is_refused_with_the_fix() -> None:
    for msg in run_ranks(workers.rows_outgrown, 2):
        assert msg.startswith("8: ") and "at most 64 indices a step" in msg and "split_shared=False" in msg, (
            msg
        )
