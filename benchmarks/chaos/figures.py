"""The chaos run's figures and its report: faults by kind, survived, restarts, steps
recomputed, time from a fault to the next step, compiles at restarts, the final digests."""

from __future__ import annotations

import statistics
from collections import Counter

__all__ = ["figures", "markdown"]


def _survived(rec: dict) -> bool:
    ok = bool(rec.get("recovered"))
    if "resumed_newest" in rec:
        ok = ok and rec["resumed_newest"]
    return ok


def figures(records: list[dict], *, reference: dict, chaos: dict) -> dict:
    """The summary of a run's fault ``records`` against the uninterrupted ``reference`` job.

    ``reference`` and ``chaos`` hold each job's ``digests`` (rank -> digest) and, for the
    reference, ``first_step_s`` (launch to its first step, cold caches) and ``step_s`` (its
    median step).

    Example:
        >>> f = figures([{"kind": "stall", "recovered": True, "fault_to_step_s": 31.0}],
        ...             reference={"digests": {0: "1.5"}, "first_step_s": 40.0, "step_s": 0.2},
        ...             chaos={"digests": {0: "1.5"}, "orphans": [], "exit_codes": [0]})
        >>> f["survived"], f["bitwise_equal"], f["fault_to_step_s"]["median"]
        (1, True, 31.0)
    """
    restarts = [r for r in records if "resumed" in r]
    times = [r["fault_to_step_s"] for r in records if "fault_to_step_s" in r]
    warm = [
        n
        for r in restarts
        for node, n in r.get("compiled_here", {}).items()
        if int(node) != r.get("emptied_node")
    ]
    cold = [
        n
        for r in restarts
        for node, n in r.get("compiled_here", {}).items()
        if int(node) == r.get("emptied_node")
    ]
    bound = [
        2 * (reference["first_step_s"] + r["recomputed"] * reference["step_s"])
        for r in restarts
        if "recomputed" in r
    ]
    within = sum(r["fault_to_step_s"] <= b for r, b in zip(restarts, bound))
    equal = bool(reference["digests"]) and chaos["digests"] == reference["digests"]
    return {
        "faults": len(records),
        "by_kind": dict(Counter(r["kind"] for r in records)),
        "survived_by_kind": dict(Counter(r["kind"] for r in records if _survived(r))),
        "survived": sum(_survived(r) for r in records),
        "hangs": sum(str(r.get("outcome", "")).startswith("hang") for r in records),
        "restarts": len(restarts),
        "recomputed_steps": [r.get("recomputed") for r in restarts],
        "fault_to_step_s": {
            "median": statistics.median(times) if times else None,
            "max": max(times) if times else None,
        },
        "restart_parts_s": {
            "fault_to_new_life_median": _median(
                [r["fault_to_start_s"] for r in restarts if "fault_to_start_s" in r]
            ),
            "new_life_to_step_median": _median(
                [r["fault_to_step_s"] - r["fault_to_start_s"] for r in restarts if "fault_to_start_s" in r]
            ),
        },
        "restart_bound": {"within": within, "of": len(bound), "rule": "2 x (cold start + recomputed x step)"},
        "compiles_at_restart_warm_nodes": sum(warm),
        "compiles_at_restart_emptied_nodes": sum(cold),
        "bitwise_equal": equal,
        "orphans": len(chaos.get("orphans", [])),
        "exit_codes": chaos.get("exit_codes"),
    }


def markdown(meta: dict, records: list[dict], fig: dict, reference: dict, chaos: dict) -> str:
    """The report: the setting, one row per fault, the figures.

    Example:
        >>> markdown({"date": "d"}, [], figures([], reference={"digests": {}, "first_step_s": 1.0,
        ...     "step_s": 0.1}, chaos={"digests": {}}), {"digests": {}}, {"digests": {}}).splitlines()[0]
        '# Chaos run (d)'
    """
    lines = [f"# Chaos run ({meta.get('date')})", ""]
    for key in ("machine", "versions", "topology", "command", "seed", "steps", "wall_s"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    lines += ["", "| # | fault | node | at step | what was done | outcome |", "|---|---|---|---|---|---|"]
    for r in records:
        did, out = str(r.get("did", "")).replace("|", "/"), str(r.get("outcome", "")).replace("|", "/")
        lines.append(
            f"| {r['index'] + 1} | {r['kind']} | {r['node']} | {r.get('step', '-')} | {did} | {out} |"
        )
    ft = fig["fault_to_step_s"]
    lines += [
        "",
        "| figure | value |",
        "|---|---|",
        f"| faults injected (by kind) | {fig['faults']} ({_kinds(fig['by_kind'])}) |",
        f"| faults survived (by kind) | {fig['survived']} ({_kinds(fig['survived_by_kind'])}) |",
        f"| hangs | {fig['hangs']} |",
        f"| restarts | {fig['restarts']} |",
        f"| steps recomputed at each restart | {fig['recomputed_steps']} |",
        f"| fault to next completed step, median / max | {_s(ft['median'])} / {_s(ft['max'])} |",
        f"| of a restart, median: fault to the new processes' wrap / from there to their first step | "
        f"{_s(fig['restart_parts_s']['fault_to_new_life_median'])} / {_s(fig['restart_parts_s']['new_life_to_step_median'])} |",
        f"| restarts within {fig['restart_bound']['rule']} | {fig['restart_bound']['within']} of "
        f"{fig['restart_bound']['of']} (cold start {reference.get('first_step_s', 0):.1f} s, step "
        f"{reference.get('step_s', 0) * 1e3:.0f} ms) |",
        f"| pieces compiled at restarts, warm nodes / emptied nodes | {fig['compiles_at_restart_warm_nodes']} / "
        f"{fig['compiles_at_restart_emptied_nodes']} |",
        f"| final parameters bitwise equal to the uninterrupted run | {'yes' if fig['bitwise_equal'] else 'NO'} "
        f"({len(chaos.get('digests', {}))} ranks; digest {next(iter(reference.get('digests', {}).values()), '-')}) |",
        f"| processes left after the job | {fig['orphans']} |",
        f"| launchers' exit codes | {fig['exit_codes']} |",
    ]
    if chaos.get("launcher_summary"):
        lines += ["", "Node 0's launcher, at the end of the job:", "```", chaos["launcher_summary"], "```"]
    return "\n".join(lines) + "\n"


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


def _kinds(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"
