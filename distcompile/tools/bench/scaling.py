"""The compile-scaling mode: time to first step against model depth, cold and warm, and a recompile.

Each (depth, variant) runs alone in new rank processes with an empty compile cache of its
own (cold: capture, compile and one step, then a step at half the sequence length, which
recompiles), then again in new processes with the cache that run filled (warm). The
variants are what a user would otherwise pick: ``torch.compile(DDP)`` (DDPOptimizer) and
regional compilation (each block ``torch.compile``d, eager DDP around it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable

from .report import write_results

__all__ = ["SCALING_DEFAULT", "run_scaling", "scaling_table"]

#: The variants of the compile-scaling mode, unless --variants names others.
SCALING_DEFAULT = ("compile_ddpopt", "regional", "dc_inductor")


def _one(args: argparse.Namespace, launch: Callable, name: str, depth: int, tmp: str) -> tuple[dict, dict]:
    cache = os.path.join(tmp, f"cache-{name}-{depth}")
    row: dict = {"variant": name, "layers": depth}
    meta: dict = {}
    for phase in ("cold", "warm"):
        out = os.path.join(tmp, f"{phase}-{name}-{depth}.json")
        extra = [
            *("--variants", name, "--device", args.device, "--world", str(args.world)),
            *("--ranks-per-gpu", str(args.ranks_per_gpu)),
            *("--warmup", "0", "--first-step-only", "--layers", str(depth)),
            *(["--recompile"] if phase == "cold" else []),
            *(["--small"] if args.small else []),
        ]
        launch(args, extra, None, cache, out)
        with open(out) as f:
            res = json.load(f)
        meta, r = res["meta"], res["variants"][name]
        if "error" in r:
            row["error"] = r["error"]
            break
        row[f"{phase}_first_step_s"] = r["first_step_s"]
        if phase == "cold":
            row["recompile_s"] = r.get("recompile_s")
            if "plan" in r:
                row["pieces"] = r["plan"]["pieces"]
                row["pieces_compiled"] = r["plan"]["pieces"] - r["plan"]["pieces_reused"]
    return row, meta


def scaling_table(rows: list[dict]) -> str:
    """The table a person reads: first steps per depth and variant, and ratios to regional.

    Example:
        >>> print(scaling_table([{"variant": "regional", "layers": 2, "cold_first_step_s": 10.0}]))
        layers  variant   cold s  warm s  recompile s  cold vs regional  warm vs regional  pieces (compiled)
        ------  --------  ------  ------  -----------  ----------------  ----------------  -----------------
        2       regional  10.00   -       -            1.00x             -                 -
    """
    head = ("layers", "variant", "cold s", "warm s", "recompile s", "cold vs regional", "warm vs regional")
    out = [(*head, "pieces (compiled)")]
    regional = {r["layers"]: r for r in rows if r["variant"] == "regional" and "error" not in r}

    def fmt(x: float | None, unit: str = "", nd: int = 2) -> str:
        return "-" if x is None else f"{x:.{nd}f}{unit}"

    for r in rows:
        if "error" in r:
            out.append((r["layers"], r["variant"], "failed: " + r["error"][:60], *[""] * 5))
            continue
        ref = regional.get(r["layers"], {})

        def ratio(key: str, r: dict = r, ref: dict = ref) -> str:
            return fmt(r[key] / ref[key], "x") if ref.get(key) and r.get(key) else "-"

        pieces = f"{r['pieces']} ({r['pieces_compiled']})" if "pieces" in r else "-"
        out.append(
            (
                r["layers"],
                r["variant"],
                fmt(r.get("cold_first_step_s")),
                fmt(r.get("warm_first_step_s")),
                fmt(r.get("recompile_s")),
                ratio("cold_first_step_s"),
                ratio("warm_first_step_s"),
                pieces,
            )
        )
    widths = [max(len(str(row[i])) for row in out) for i in range(len(out[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_scaling(args: argparse.Namespace, names: list[str], launch: Callable, argv: list[str]) -> int:
    """Run every (depth, variant) cold then warm, print the table, write JSON and markdown.

    Example:
        >>> # distcompile bench --compile-scaling --depths 2,8,16,32
    """
    depths = [int(d) for d in args.depths.split(",") if d]
    rows, meta = [], {}
    total = len(depths) * len(names)
    with tempfile.TemporaryDirectory(prefix="dc_scaling_") as tmp:
        for depth in depths:
            for name in names:
                print(
                    f"[bench] {len(rows) + 1}/{total}: {name} at {depth} layers, empty compile cache "
                    "(then a recompile), then warm",
                    flush=True,
                )
                row, meta = _one(args, launch, name, depth, tmp)
                rows.append(row)
                print(scaling_table([row]).splitlines()[-1], flush=True)
    meta = {k: v for k, v in meta.items() if k not in ("rounds", "block", "warmup")}
    meta["model"] = meta.get("model", "").replace(f"n_layer={depths[-1]}", "n_layer=<layers>")
    meta["command"] = " ".join(["distcompile bench", *argv])
    text = scaling_table(rows)
    print("\n" + text)
    name = f"{meta.get('date', 'undated')}-compile-scaling" + ("-small" if args.small else "")
    markdown = (
        f"# Compile scaling, {meta.get('date')}\n\n"
        f"Command: `{meta['command']}`\n\n"
        + "".join(f"- {k}: {v}\n" for k, v in meta.items() if k not in ("command", "date"))
        + "\nEach row: the variant alone in new rank processes. cold: empty compile cache of its own "
        "(capture, compile, one step); recompile: then one step at half the sequence length; warm: "
        "new processes with the cache the cold run filled. Seconds of the slower rank.\n\n"
        f"```\n{text}\n```\n"
    )
    write_results(args.out_dir, name, {"meta": meta, "rows": rows}, markdown)
    return 0
