"""The benchmark's outputs: the table a person reads and the dated markdown report."""

from __future__ import annotations

__all__ = ["gpu_table", "report_markdown", "table", "write_results"]


def write_results(out_dir: str, name: str, data: dict, markdown: str) -> str:
    """Write ``out_dir/name.json`` and ``out_dir/name.md``; return the path without suffix.

    Example:
        >>> # stem = write_results("benchmarks/results", "2026-11-23-overlap-1gbit", res, md)
    """
    import json
    import os

    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, name)
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    print(f"\n[bench] wrote {stem}.json and {stem}.md")
    return stem


def _fmt(x: float | None, unit: str = "", nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


#: The communication columns, as ``telemetry.timeline.mean_figures`` names them, then the estimate.
FIGURE_HEADS = (
    "comm ms",
    "overlapped ms",
    "exposed ms",
    "wait ms",
    "overlap %",
    "tail MB",
    "over compute ms",
)


def _figure_cells(r: dict) -> tuple[str, ...]:
    keys = ("comm_ms", "overlapped_ms", "exposed_ms", "wait_ms", "overlap_pct", "tail_mb", "over_compute_ms")
    return tuple(_fmt(r.get(k), nd=2 if k == "tail_mb" else 1) for k in keys)


def _peak(r: dict, ddp: dict) -> str:
    if "peak_rss_mb" not in r:
        return "-"
    ratio = f" ({r['peak_rss_mb'] / ddp['peak_rss_mb']:.2f}x)" if ddp.get("peak_rss_mb") else ""
    return f"{r['peak_rss_mb']:.0f}{ratio}"


def _render(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _ratio(m: float, ref: dict, key: str = "median_ms") -> str:
    return _fmt(m / ref[key] if ref.get(key) else None, "x", 3)


def gpu_table(res: dict) -> str:
    """GPU step times (CUDA events) against the compiled model without DDP, eager DDP and DDPOptimizer.

    Example:
        >>> # print(gpu_table(json.load(open("benchmarks/results/2026-11-24-overlap-cuda.json"))))
    """
    head = (
        "variant",
        "median ms",
        "min",
        "max",
        "wall ms",
        "vs floor",
        "vs DDP",
        "vs DDPOpt",
        "vs DDPOpt+CG",
    )
    rows = [head + (*FIGURE_HEADS, "syncs/step", "cold s", "warm s", "peak GPU MB")]
    v = res["variants"]
    floor, ddp, ddpopt, cg = (
        v.get(n, {}) for n in ("compile_noddp", "ddp", "compile_ddpopt", "compile_ddpopt_cg")
    )
    for name, r in v.items():
        if "error" in r:
            rows.append((name, "failed: " + r["error"][:60], *[""] * (len(rows[0]) - 2)))
            continue
        m = r["median_ms"]
        peak = r.get("peak_gpu_mb")
        rows.append(
            (
                name,
                _fmt(m),
                _fmt(r["min_ms"]),
                _fmt(r["max_ms"]),
                _fmt(r.get("wall_ms")),
                _ratio(m, floor),
                _ratio(m, ddp),
                _ratio(m, ddpopt),
                _ratio(m, cg),
                *_figure_cells(r),
                _fmt(r.get("host_syncs_per_step"), "", 1),
                _fmt(r.get("cold_first_step_s"), "", 2),
                _fmt(r.get("warm_first_step_s"), "", 2),
                "-" if peak is None else f"{peak:.0f} ({_ratio(peak, ddp, 'peak_gpu_mb')})",
            )
        )
    m = res["meta"]
    return "\n".join(
        _render(rows)
        + [
            "",
            f"{_gpu_ranks(m)}; median/min/max: CUDA-event time of a step "
            "(the slower rank's); wall ms: host time per step over a block, one wait per block.",
        ]
    )


def _gpu_ranks(m: dict) -> str:
    per = m.get("ranks_per_gpu", 1)
    if per > 1:
        return (
            f"{m['world_size']} gloo ranks, {per} on each GPU ({m['gpu']}), all-reducing through host memory"
        )
    return f"{m['world_size']} NCCL rank(s), one per GPU ({m['gpu']})"


def table(res: dict) -> str:
    """Step times of every variant against eager DDP, DDPOptimizer and the floor, then the floor's terms.

    Example:
        >>> # print(table(json.load(open("benchmarks/results/2026-11-22-overlap-1gbit.json"))))
    """
    if res["meta"].get("device") == "cuda":
        return gpu_table(res)
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
            "CPU ms",
            "busy %",
            *FIGURE_HEADS,
            "cold s",
            "warm s",
            "peak RSS MB",
        )
    ]
    v = res["variants"]
    floor = res["floor"]["floor_ms"]
    for name, r in v.items():
        if "error" in r:
            rows.append((name, "failed: " + r["error"][:60], *[""] * (len(rows[0]) - 2)))
            continue
        m = r["median_ms"]
        rows.append(
            (
                name,
                _fmt(m),
                _fmt(r["min_ms"]),
                _fmt(r["max_ms"]),
                _ratio(m, v.get("ddp", {})),
                _ratio(m, v.get("compile_ddpopt", {})),
                _fmt(m / floor, "x", 3),
                _fmt(m / res["floor"]["cpu_floor_ms"] if "cpu_floor_ms" in res["floor"] else None, "x", 3),
                _fmt(r.get("cpu_ms")),
                _fmt(r.get("busy_pct"), nd=0),
                *_figure_cells(r),
                _fmt(r.get("cold_first_step_s"), "", 2),
                _fmt(r.get("warm_first_step_s"), "", 2),
                _peak(r, v.get("ddp", {})),
            )
        )
    lines = _render(rows)
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


_CPU_COLUMNS = (
    "CPU ms: the CPU time a rank's process spends a step, all its threads (gloo's included), the ranks' "
    "mean, median over the steps; busy %: the ranks' CPU time over the step times the cores (every rank "
    "runs on this machine). Near 100% the cores, not the link, set the step: overlap hides the wait for "
    "the link but not the CPU the all-reduces take. "
)


def report_markdown(res: dict) -> str:
    """The dated markdown report: machine, link, versions, command, the table, and the plans.

    Example:
        >>> # open(stem + ".md", "w").write(report_markdown(res))
    """
    m = res["meta"]
    gpu = m.get("device") == "cuda"
    versions = f"torch {m['torch']}, python {m['python']}, distcompile {m['distcompile']}"
    if gpu:
        versions += f", CUDA {m['cuda']}, NCCL {m['nccl']}, Triton {m['triton']}, driver {m['driver']}"
    ranks = (
        f"{_gpu_ranks(m)}; bf16 autocast, fused AdamW"
        if gpu
        else f"{m['world_size']} gloo ranks, 1 thread each"
    )
    return (
        "\n".join(
            [
                f"# Overlap benchmark, {m['link']}{'' if gpu else ' link'}, {m['date']}",
                "",
                f"- machine: {m['machine']}",
                f"- link: {m['link_detail']}",
                f"- versions: {versions}",
                f"- model: {m['model']}; {ranks}",
                f"- steps: {m['rounds']} rounds x {m['block']} steps per variant, alternating; "
                f"warm-up {m['warmup']} steps each",
                f"- command: `{m['command']}`",
                "",
                "```",
                table(res),
                "```",
                "",
                ("" if gpu else _CPU_COLUMNS)
                + "comm / overlapped / exposed ms, overlap %: distcompile's telemetry, per step, mean over the measured "
                "steps of rank 0 (docs/telemetry.md: communication = union of all-reduce spans, overlapped = the part "
                "under computation, exposed = the rest; overlap % = overlapped / communication); `-`: not measured "
                "(the other variants have no such telemetry). wait ms: host time blocked on communication (rank skew "
                "included). tail MB: bytes all-reduced for gradients final only when backward ends (the first "
                "forward segment's bucket; with a tied embedding split by use, just its lookup's rows). over compute ms: median step minus the compute-only step (an estimate of what "
                "communication costs, for every variant). cold s / "
                "warm s: the first step of the variant alone in a new pair of processes, with an empty compile cache of "
                "its own / with the cache that run filled. peak RSS MB: the larger rank's peak resident memory in the "
                "warm process, which built only this variant and ran its warm-up steps (ratio to eager DDP's)."
                + (
                    " On GPUs: distcompile's figures are GPU times (CUDA events), computation being its segments; "
                    "syncs/step counts synchronizing CUDA runtime calls (profiler, 3 warm steps); peak GPU MB is "
                    "torch.cuda.max_memory_allocated in that warm process."
                    if gpu
                    else ""
                ),
                "",
                "Plans of the distcompile variants (buckets in launch order, MB):",
                "",
                *[
                    f"- {n}: {r['plan']['buckets_mb']} ({'; '.join(sorted(set(r['plan']['planned_by'])))})"
                    for n, r in res["variants"].items()
                    if "plan" in r
                ],
                *_predictions(res),
            ]
        )
        + "\n"
    )


def _predictions(res: dict) -> list[str]:
    """The ``'auto'`` planner's step against the measured one, for the variants it planned."""
    floor = res.get("floor") or {}
    rows = [
        (n, r)
        for n, r in res["variants"].items()
        if r.get("plan", {}).get("predicted_ms") and "median_ms" in r
    ]
    if not rows or "t_fwd_ms" not in floor:
        return []
    lines = [
        "",
        "The planner's prediction (`bucket_cap_mb='auto'`): predicted step = t_fwd + the cost model's "
        "backward-and-communication time for the chosen plan (each backward node timed on the first "
        "rank at its first compile and priced at the matmul rate every rank measured computing at once, "
        "a node not timed at twice its forward FLOPs; the compute the all-reduces take from backward "
        "per byte, measured at wrap; its all-reduces from the measured latency and bandwidth) + t_opt; "
        "t_fwd and t_opt from the floor's compute-only steps.",
        "",
    ]
    for n, r in rows:
        predicted = floor["t_fwd_ms"] + r["plan"]["predicted_ms"] + floor["t_opt_ms"]
        lines.append(
            f"- {n}: predicted {predicted:.1f} ms, measured {r['median_ms']:.1f} ms "
            f"({predicted / r['median_ms'] - 1:+.1%}); backward and communication predicted "
            f"{r['plan']['predicted_ms']:.1f} ms against a measured backward alone of {floor['t_bwd_ms']:.1f} ms"
        )
    return lines
