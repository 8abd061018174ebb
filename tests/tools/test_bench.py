"""The overlap benchmark runs end to end on loopback (tiny model, 2 steps a variant); no timing is asserted."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distcompile.tools.bench.variants import CPU_DEFAULT
from tests.harness import child_env

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, *args: str, timeout: float = 2300) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overlap.py"), *args, "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.long
@pytest.mark.timeout(2400)  # every variant also starts twice alone (cold and warm cache): minutes
def test_benchmark_end_to_end_on_loopback(tmp_path: Path) -> None:
    # What users compare, and one distcompile variant of each kind (the rest are options of these).
    names = "ddp,ddp_fp16,compile_ddpopt,regional,dc_inductor,dc_inductor_bf16,dc_auto,dc_auto_optim"
    # The first steps (each variant alone, cold then warm: two more jobs a variant) of one variant.
    proc = _bench(
        tmp_path, "--small", "--rounds", "1", "--block", "2", "--warmup", "1", "--variants", names,
        "--first-steps-of", "dc_inductor",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*-overlap-loopback-small.json")
    res = json.loads(js.read_text())
    assert list(res["variants"]) == names.split(",") and set(names.split(",")) <= set(CPU_DEFAULT)
    for name, r in res["variants"].items():
        assert "error" not in r, (name, r)
        assert r["steps"] == 2 and r["median_ms"] > 0, (name, r)
        alone = name == "dc_inductor"
        assert (r.get("warm_first_step_s", 0) > 0) == alone and (
            r.get("cold_first_step_s", 0) > 0
        ) == alone, r
        assert (r.get("peak_rss_mb", 0) > 100) == alone, (name, r)  # torch alone is more: a real measurement
        # The ranks' CPU a step, gloo's threads included: some, and no more than the cores give.
        assert 0 < r["cpu_ms"] <= 1.1 * r["max_ms"] and 0 < r["busy_pct"] <= 110, (name, r)
    assert res["floor"]["floor_ms"] > 0 and res["meta"]["link"] == "loopback"
    assert res["floor"]["cpu_floor_ms"] >= res["floor"]["floor_ms"]
    assert all(p.startswith("measured costs") for p in res["variants"]["dc_auto"]["plan"]["planned_by"])
    md = js.with_suffix(".md").read_text()
    assert "floor" in md and "torch" in md and "dc_inductor_bf16" in md and "- dc_auto: [" in md
    assert res["variants"]["dc_auto"]["tail_mb"] > 0 and res["variants"]["dc_auto"]["comm_ms"] > 0
    assert "vs floor" in proc.stdout and "busy %" in proc.stdout


@pytest.mark.long
def test_opt_in_variants_run_on_cpu(tmp_path: Path) -> None:
    # The compiled model without DDP and FSDP2 on a replicate mesh run on gloo too.
    names = "ddp,compile_noddp,fsdp_replicate"
    proc = _bench(
        tmp_path,
        *("--small", "--variants", names, "--no-first-steps", "--rounds", "1", "--block", "2"),
        *("--trace-dir", "traces"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*-overlap-loopback-small.json")
    res = json.loads(js.read_text())
    assert list(res["variants"]) == names.split(",")
    for name, r in res["variants"].items():
        assert "error" not in r and r["steps"] == 2 and r["median_ms"] > 0, (name, r)
    assert res["meta"]["device"] == "cpu"
    for name in names.split(","):  # 3 warm steps each, a trace Perfetto reads
        with gzip.open(tmp_path / "traces" / f"trace-{name}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        assert sum(1 for e in events if e.get("name") == "aten::addmm") >= 3, name
        assert "host_syncs_per_step" not in res["variants"][name]  # counted on GPUs only


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_mode_without_a_gpu_is_refused_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the parser, before any rank starts (in this process: the parent's checks)."""
    from distcompile.tools.bench.parent import main

    def refusal(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--out-dir", str(tmp_path)])
        assert exit_.value.code == 2
        return capsys.readouterr().err

    err = refusal("--device", "cuda", "--small")
    assert "no CUDA GPU found" in err and "Run without --device" in err
    err = refusal("--small", "--variants", "ddp,dc_cudagraphs")
    assert "need CUDA graphs" in err and "--device cuda" in err
    assert "--ranks-per-gpu places ranks on GPUs" in refusal("--small", "--ranks-per-gpu", "2")
    assert "no CUDA GPU found" in refusal("--device", "cuda", "--small", "--ranks-per-gpu", "2")
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.long
def test_compile_scaling_mode_writes_table_and_json(tmp_path: Path) -> None:
    # distcompile's rows alone (regional trains in the end-to-end test above; the ratio column
    # is the table's doctest): its cold, warm and recompile first steps at two depths.
    proc = _bench(tmp_path, "--compile-scaling", "--small", "--depths", "2,4", "--variants", "dc_inductor")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*-compile-scaling-small.json")
    rows = json.loads(js.read_text())["rows"]
    assert [(r["layers"], r["variant"]) for r in rows] == [(2, "dc_inductor"), (4, "dc_inductor")]
    for r in rows:
        assert "error" not in r and r["cold_first_step_s"] > 0 and r["warm_first_step_s"] > 0, r
        assert r["recompile_s"] > 0, r
    assert rows[0]["pieces_compiled"] == rows[1]["pieces_compiled"], (
        rows
    )  # twice the layers, no more compiles
    assert "cold vs regional" in proc.stdout and js.with_suffix(".md").exists()


@pytest.mark.long  # a store server in a process of its own, and 10 simulated ranks: ~30 s, mostly waiting
def test_control_plane_simulator_runs_the_real_protocols_in_a_few_store_operations(tmp_path: Path) -> None:
    # A checkout's script (not a subcommand of the installed package); its folder made first.
    script = ROOT / "benchmarks" / "control_plane.py"
    out = tmp_path / "new" / "x-control-plane"
    proc = subprocess.run(
        [sys.executable, str(script), "--ranks", "2,8", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = (tmp_path / "new").glob("*-control-plane.json")
    results = json.loads(js.read_text())["results"]
    for n in ("2", "8"):
        assert list(results[n]) == ["agreement", "costs", "layout", "recompile", "peers", "sharing"]
        for phase, r in results[n].items():
            assert not r["errors"] and r["ops_per_rank_max"] > 0, (n, phase, r)
            assert r["ops_per_rank_max"] <= (40 if phase == "sharing" else 12), (n, phase, r)
        assert results[n]["costs"]["ops_per_rank_max"] == 1  # the first rank sets, each other gets


def test_a_shaped_star_of_namespaces_connects_every_node_and_leaves_nothing() -> None:
    """``--nodes`` above 2: nodes on one switch, each port shaped; all gone on exit."""
    from distcompile.tools.bench.netns import can_make_namespaces, star

    reason = can_make_namespaces()
    if reason:
        pytest.skip(reason)
    serve = (
        "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 5077)); s.listen(); c, _ = s.accept(); "
        "n = 0\nwhile (d := c.recv(1 << 20)): n += len(d)\nprint(n)"
    )
    send = (
        "import socket, sys; s = socket.create_connection((sys.argv[1], 5077)); s.sendall(bytes(4_000_000))"
    )
    with star("10.213.15", 3, rate="200mbit") as net:
        names = set(net.namespaces)
        assert len(names) == 3 and len(set(net.addresses)) == 3
        for a, b in ((0, 2), (2, 1)):
            server = subprocess.Popen(
                ["ip", "netns", "exec", net.namespaces[b], sys.executable, "-c", serve, net.addresses[b]],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(50):  # until the server listens
                sent = subprocess.run(
                    ["ip", "netns", "exec", net.namespaces[a], sys.executable, "-c", send, net.addresses[b]],
                    capture_output=True,
                )
                if sent.returncode == 0:
                    break
                time.sleep(0.1)
            out, _ = server.communicate(timeout=60)
            assert out.strip() == "4000000", (a, b, out)
        qdiscs = subprocess.run(
            ["ip", "netns", "exec", net.namespaces[0], "tc", "qdisc", "show", "dev", net.devices[0]],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdiscs and "200Mbit" in qdiscs, qdiscs
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not names & {line.split()[0] for line in left.splitlines() if line.strip()}, left
