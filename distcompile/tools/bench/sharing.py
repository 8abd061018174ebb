"""The compile-sharing mode: the job's first step when its ranks have separate cache folders.

Two ranks ("nodes": one per network namespace on a shaped link, or both on loopback),
each run in new processes, first step of ``dc_inductor`` (the slower rank's, as the
step ends in an all-reduce). Cold: one shared empty folder (a node with a shared
filesystem), two empty folders with compiles shared between them (Note
[Compiles shared across cache folders]), two empty folders with ``share_compiles=False``
(every rank compiles everything: the behaviour without sharing). Restart: both folders
warm, and one folder emptied (a replacement node), with sharing and without.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable

from .report import write_results

__all__ = ["run_sharing", "sharing_table"]

#: (name, folders by rank (letters name folders), variant, folder emptied first, reference row)
_SCENARIOS = (
    ("cold, one shared folder", "AA", "dc_inductor", "", ""),
    ("cold, two folders, shared between them", "BC", "dc_inductor", "", "cold, one shared folder"),
    ("cold, two folders, share_compiles=False", "DE", "dc_inductor_noshare", "", "cold, one shared folder"),
    ("restart, both folders warm", "BC", "dc_inductor", "", ""),
    ("restart, folder of rank 1 emptied", "BC", "dc_inductor", "C", "restart, both folders warm"),
    (
        "restart, folder of rank 1 emptied, share_compiles=False",
        "DE",
        "dc_inductor_noshare",
        "E",
        "restart, both folders warm",
    ),
)


def sharing_table(rows: list[dict]) -> str:
    """The table a person reads: each scenario's first step and its ratio to the reference.

    Example:
        >>> print(sharing_table([{"scenario": "cold, one shared folder", "first_step_s": 10.0, "ratio": None}]))
        scenario                 first step s  vs reference  rank 0's pieces: here / cache / same folder / other folder
        -----------------------  ------------  ------------  ----------------------------------------------------------
        cold, one shared folder  10.00         -             -
    """
    out = [
        (
            "scenario",
            "first step s",
            "vs reference",
            "rank 0's pieces: here / cache / same folder / other folder",
        )
    ]
    for r in rows:
        if "error" in r:
            out.append((r["scenario"], "failed: " + r["error"][:60], "", ""))
            continue
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        from ...fleet.sharing import SOURCES  # imports torch: not in the parent process until here

        src = r.get("sources") or {}
        pieces = " / ".join(str(src.get(k, 0)) for k in SOURCES) if src else "-"
        out.append((r["scenario"], f"{r['first_step_s']:.2f}", ratio, pieces))
    widths = [max(len(str(row[i])) for row in out) for i in range(len(out[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _row(
    args: argparse.Namespace, launch: Callable, net: object, tmp: str, scenario: tuple
) -> tuple[dict, dict]:
    name, folders, variant, emptied, _ = scenario
    if emptied:
        shutil.rmtree(os.path.join(tmp, emptied), ignore_errors=True)
    caches = [os.path.join(tmp, f) for f in folders[: args.world]]
    out = os.path.join(tmp, "result.json")
    extra = [
        *("--variants", variant, "--device", "cpu", "--world", str(args.world)),
        *("--warmup", "0", "--first-step-only", "--workload", args.workload),
        *(["--small"] if args.small else []),
        *(["--layers", str(args.layers)] if args.layers else []),
    ]
    launch(args, extra, net, caches, out)
    with open(out) as f:
        res = json.load(f)
    r = res["variants"][variant]
    row: dict = {"scenario": name, "variant": variant, "folders": folders}
    if "error" in r:
        return {**row, "error": r["error"]}, res["meta"]
    row["first_step_s"] = r["first_step_s"]
    if "plan" in r:
        row["sources"] = r["plan"]["sources"]
    return row, res["meta"]


def run_sharing(
    args: argparse.Namespace, launch: Callable, net: object, link: tuple[str, str], argv: list[str]
) -> int:
    """Run every scenario in order, print the table, write JSON and markdown.

    Example:
        >>> # distcompile bench --compile-sharing --link 1gbit
    """
    rows, meta = [], {}
    with tempfile.TemporaryDirectory(prefix="dc_sharing_") as tmp:
        for k, scenario in enumerate(_SCENARIOS):
            print(f"[bench] {k + 1}/{len(_SCENARIOS)}: {scenario[0]}", flush=True)
            row, meta = _row(args, launch, net, tmp, scenario)
            ref = next((x for x in rows if x["scenario"] == scenario[4]), None)
            if ref and "first_step_s" in ref and "first_step_s" in row:
                row["ratio"] = row["first_step_s"] / ref["first_step_s"]
            rows.append(row)
            print(sharing_table([row]).splitlines()[-1], flush=True)
    meta = {k: v for k, v in meta.items() if k not in ("rounds", "block", "warmup")}
    meta.update(link=link[0], link_detail=link[1], command=" ".join(["distcompile bench", *argv]))
    text = sharing_table(rows)
    print("\n" + text)
    name = f"{meta.get('date', 'undated')}-compile-sharing-{link[0]}" + ("-small" if args.small else "")
    name += f"-{args.layers}-layers" if args.layers else ""
    markdown = (
        f"# Compile sharing across cache folders, {meta.get('date')}\n\n"
        f"Command: `{meta['command']}`\n\n"
        + "".join(f"- {k}: {v}\n" for k, v in meta.items() if k not in ("command", "date"))
        + "\nEach row: new rank processes, one per node, first step of `dc_inductor` (seconds, rank 0; "
        "the step ends in an all-reduce, so it waits for the slower rank). Folders are Inductor cache "
        "folders (`TORCHINDUCTOR_CACHE_DIR`); the restart rows reuse the folders of the cold rows above "
        "them. Rank 0's pieces: where its distinct pieces came from (compiled in the process, its "
        "cache folder, a peer of the same folder, another folder's leader, by the leaders' tree or, after a failure there, the store).\n\n"
        f"```\n{text}\n```\n"
    )
    write_results(args.out_dir, name, {"meta": meta, "rows": rows}, markdown)
    return 0
