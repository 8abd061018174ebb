"""The benchmark's outputs: the table a person reads and the dated markdown report."""

from __future__ import annotations

__all__ = ["report_markdown", "table"]


def _fmt(x: float | None, unit: str = "", nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def _peak(r: dict, ddp: dict) -> str:
    if "peak_rss_mb" not in r:
        return "-"
    ratio = f" ({r['peak_rss_mb'] / ddp['peak_rss_mb']:.2f}x)" if ddp.get("peak_rss_mb") else ""
    return f"{r['peak_rss_mb']:.0f}{ratio}"


def table(res: dict) -> str:
    """Step times of every variant against eager DDP, DDPOptimizer and the floor, then the floor's terms.

    Example:
        >>> # print(table(json.load(open("benchmarks/results/2026-11-22-overlap-1gbit.json"))))
    """
    rows = [
        (
            "variant",
            "median ms",
            "min",
            "max",
            "vs DDP",
            "vs DDPOpt",
            "vs floor",
            "vs CPU floor",
            "exposed ms",
            "overlap %",
            "cold s",
            "warm s",
            "peak RSS MB",
        )
    ]
    v = res["variants"]
    base, ddpopt, floor = (
        v.get("ddp", {}).get("median_ms"),
        v.get("compile_ddpopt", {}).get("median_ms"),
        res["floor"]["floor_ms"],
    )
    for name, r in v.items():
        if "error" in r:
            rows.append((name, "failed: " + r["error"][:60], *[""] * 11))
            continue
        m = r["median_ms"]
        rows.append(
            (
                name,
                _fmt(m),
                _fmt(r["min_ms"]),
                _fmt(r["max_ms"]),
                _fmt(m / base if base else None, "x", 3),
                _fmt(m / ddpopt if ddpopt else None, "x", 3),
                _fmt(m / floor, "x", 3),
                _fmt(m / res["floor"]["cpu_floor_ms"] if "cpu_floor_ms" in res["floor"] else None, "x", 3),
                _fmt(r.get("exposed_ms")),
                _fmt(r.get("overlap_pct")),
                _fmt(r.get("cold_first_step_s"), "", 2),
                _fmt(r.get("warm_first_step_s"), "", 2),
                _peak(r, v.get("ddp", {})),
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    f = res["floor"]
    lines.append("")
    lines.append(
        f"floor {f['floor_ms']:.1f} ms = t_fwd {f['t_fwd_ms']:.1f} + max(t_bwd {f['t_bwd_ms']:.1f} + t_tail "
        f"{f['t_tail_ms']:.1f}, t_head {f['t_head_ms']:.1f} + t_comm {f['t_comm_ms']:.1f}) + t_opt {f['t_opt_ms']:.1f}"
    )
    if "cpu_floor_ms" in f:
        lines.append(
            f"CPU-aware floor {f['cpu_floor_ms']:.1f} ms = floor + CPU cost of communication under backward "
            f"{f['cpu_comm_ms']:.1f} + rank skew {f['skew_ms']:.1f}"
        )
    lines.append(
        f"gradients {f['grad_mb']:.1f} MB; link all-reduce alone: {f['t_comm_ms']:.1f} ms "
        f"({f['busbw_gbit']:.2f} Gbit/s bus bandwidth)"
    )
    return "\n".join(lines)


def report_markdown(res: dict) -> str:
    """The dated markdown report: machine, link, versions, command, the table, and the plans.

    Example:
        >>> # open(stem + ".md", "w").write(report_markdown(res))
    """
    m = res["meta"]
    return (
        "\n".join(
            [
                f"# Overlap benchmark, {m['link']} link, {m['date']}",
                "",
                f"- machine: {m['machine']}",
                f"- link: {m['link_detail']}",
                f"- versions: torch {m['torch']}, python {m['python']}, distcompile {m['distcompile']}",
                f"- model: {m['model']}; {m['world_size']} gloo ranks, 1 thread each",
                f"- steps: {m['rounds']} rounds x {m['block']} steps per variant, alternating; "
                f"warm-up {m['warmup']} steps each",
                f"- command: `{m['command']}`",
                "",
                "```",
                table(res),
                "```",
                "",
                "exposed ms: time `backward()` waited for communication (distcompile's own figure); for the other "
                "variants, step time minus the compute-only step (an estimate). overlap %: share of all-reduce "
                "time that ran under computation (distcompile telemetry; not measurable for the others). cold s / "
                "warm s: the first step of the variant alone in a new pair of processes, with an empty compile cache of "
                "its own / with the cache that run filled. peak RSS MB: the larger rank's peak resident memory in the "
                "warm process, which built only this variant and ran its warm-up steps (ratio to eager DDP's).",
                "",
                "Plans of the distcompile variants (buckets in launch order, MB):",
                "",
                *[
                    f"- {n}: {r['plan']['buckets_mb']} ({'; '.join(sorted(set(r['plan']['planned_by'])))})"
                    for n, r in res["variants"].items()
                    if "plan" in r
                ],
            ]
        )
        + "\n"
    )
