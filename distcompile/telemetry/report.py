"""``distcompile report LOGDIR``: a summary of what telemetry wrote, without a browser."""

from __future__ import annotations

import glob
import os
import re
import statistics

from .sink import require_extra
from .timeline import describe_figures, mean_figures

__all__ = ["summarize", "find_runs"]


def find_runs(logdir: str) -> list[str]:
    """Directories under ``logdir`` holding distcompile's step scalars (event files).

    Example:
        >>> find_runs("/nonexistent")
        []
    """
    runs = set()
    for path in glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True):
        runs.add(os.path.dirname(path))
    return sorted(r for r in runs if _load(r).get("step/time_ms"))


def _accumulator(run: str):
    require_extra("distcompile report reads TensorBoard files")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run, size_guidance={"scalars": 0, "images": 1, "tensors": 0})
    acc.Reload()
    return acc


def _load(run: str) -> dict[str, list[tuple[int, float]]]:
    acc = _accumulator(run)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _texts(run: str, tag: str) -> list[str]:
    acc = _accumulator(run)
    if f"{tag}/text_summary" not in acc.Tags()["tensors"]:
        return []
    return [b.decode() for e in acc.Tensors(f"{tag}/text_summary") for b in e.tensor_proto.string_val]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _figures(s: dict[str, list[tuple[int, float]]]) -> dict:
    """Mean communication figures over the steps after step 0, as the demo and bench take them."""
    keys = ("comm_ms", "overlapped_ms", "exposed_ms", "wait_ms")
    per_step: dict[int, dict] = {}
    for key in keys:
        for step, v in s.get(f"step/{key}", []):
            if step > 0:
                per_step.setdefault(step, {})[key] = v
    return mean_figures(list(per_step.values())) if per_step else {}


def _control_plane(s: dict[str, list[tuple[int, float]]]) -> str:
    """This rank's store operations and bytes per phase, at its last compile (Note [The control plane])."""
    phases = sorted({t.split("/")[1].rsplit("_", 1)[0] for t in s if t.startswith("control_plane/")})
    if not phases:
        return "control plane: not recorded"
    ops = {p: s[f"control_plane/{p}_ops"][-1][1] for p in phases if s.get(f"control_plane/{p}_ops")}
    nbytes = sum(s[f"control_plane/{p}_bytes"][-1][1] for p in phases if s.get(f"control_plane/{p}_bytes"))
    parts = ", ".join(f"{p} {v:.0f}" for p, v in ops.items())
    return f"control plane: {sum(ops.values()):.0f} store ops, {nbytes / 1e3:.1f} kB on this rank ({parts})"


def summarize(run: str) -> str:
    """A short text summary of one run directory.

    Step 0 (which includes compilation) is left out of the step figures.

    Example:
        >>> # print(summarize("runs/exp1"))
    """
    s = _load(run)

    def values(tag: str, skip_first: bool = True) -> list[float]:
        pts = s.get(tag, [])
        return [v for step, v in pts if not (skip_first and step == 0)] or [v for _, v in pts]

    compile_tags = sorted(t for t in s if re.fullmatch(r"compile/graph_\d+_s", t))
    compile_s = sum(v for t in compile_tags for _, v in s[t])
    pieces = sum(1 for t in s if re.fullmatch(r"compile/graph_\d+_piece_\d+_s", t))
    last = lambda tag: s[tag][-1][1] if s.get(tag) else 0  # noqa: E731
    times = values("step/time_ms")
    bucket_tags = sorted(
        (t for t in s if re.fullmatch(r"comm/bucket_\d+_ms", t)), key=lambda t: int(t.split("_")[1])
    )
    slowest = max(bucket_tags, key=lambda t: _median(values(t)), default=None)
    lines = [
        f"run: {run}",
        f"compile: {len(compile_tags)} graph(s), {pieces} compiled piece(s), {compile_s:.2f} s (forward; "
        f"Inductor compiles backward during step 0); recompiles {last('compile/recompiles'):.0f}, "
        f"graph breaks {last('compile/graph_breaks'):.0f}, cache hits {last('compile/cache_hits'):.0f}",
        f"steps: {len(s.get('step/time_ms', []))}; forward+backward median {_median(times):.1f} ms "
        f"(min {min(times, default=float('nan')):.1f}, max {max(times, default=float('nan')):.1f}); "
        f"step 0 {s['step/time_ms'][0][1]:.0f} ms"
        if s.get("step/time_ms")
        else "steps: 0",
        f"communication per step (mean of steps 1+): {describe_figures(_figures(s))}",
        _control_plane(s),
    ]
    for text in _texts(run, "compile/recompile_reasons"):
        lines.append("recompile: " + text.replace("\n", "\n  "))
    if slowest:
        lines.append(
            f"slowest bucket: {slowest.split('/')[1].rsplit('_', 1)[0].replace('_', ' ')} "
            f"(median {_median(values(slowest)):.1f} ms of {len(bucket_tags)} buckets)"
        )
    for trace_dir in (os.path.join(run, "traces"), os.path.join(os.path.dirname(run), "traces")):
        traces = glob.glob(os.path.join(trace_dir, "trace_rank*_step*.json"))
        if traces:
            lines.append(f"traces: {len(traces)} file(s) in {trace_dir} (open in https://ui.perfetto.dev)")
            break
    return "\n".join(lines)
