"""Failed guards, condensed for the recompile warning."""

from __future__ import annotations

from distcompile.capture.guards import condense_guard_failures, recompile_note

HINT = "  # self.calls += 1  # m.py:20 in forward (HINT: make it a tensor)"


def test_one_guard_failing_on_every_version_is_one_line() -> None:
    reasons = [f"0/{v}: self.calls == {v}{HINT}" for v in range(6, -1, -1)]
    (line,) = condense_guard_failures(reasons)
    assert line.startswith("0/6: self.calls == 6" + HINT)
    assert line.endswith("[the same guard failed on 6 older versions: 0/5, 0/4, 0/3, 0/2, ...]")


def test_guards_on_different_dimensions_or_names_stay_apart() -> None:
    reasons = [
        "0/1: tensor 'x' size mismatch at index 1. expected 16, actual 9",
        "0/0: tensor 'x' size mismatch at index 0. expected 8, actual 4",
        "0/0: tensor 'y' size mismatch at index 1. expected 12, actual 9",
        "0/0: GLOBAL_STATE changed: grad_mode",
    ]
    assert condense_guard_failures(reasons) == reasons
    same_dim = [
        "1/1: tensor 'x' size mismatch at index 1. expected 16, actual 9",
        "1/0: tensor 'x' size mismatch at index 1. expected 12, actual 9",
    ]
    assert condense_guard_failures(same_dim) == [
        same_dim[0] + "  [the same guard failed on 1 older version: 1/0]"
    ]


def test_the_one_line_note_names_the_newest_guard_only() -> None:
    assert recompile_note([f"0/1: self.calls == 1{HINT}", f"0/0: self.calls == 0{HINT}"]) == (
        " (recompile: 0/1: self.calls == 1, 2 failed guard(s))"
    )
    assert recompile_note(["no version prefix"]) == " (recompile: no version prefix, 1 failed guard(s))"
    assert recompile_note([]) == ""
