"""The GPU benchmark's table and report, from results shaped as its ranks write them (no GPU here)."""

from __future__ import annotations

from distcompile.tools.bench.report import report_markdown, table


def _gpu_results() -> dict:
    def row(median: float, peak: float, **extra: float) -> dict:
        return {
            "median_ms": median,
            "min_ms": median - 1,
            "max_ms": median + 1,
            "wall_ms": median + 0.5,
            "steps": 30,
            "host_syncs_per_step": 0.0,
            "peak_gpu_mb": peak,
            "cold_first_step_s": 30.0,
            "warm_first_step_s": 5.0,
            **extra,
        }

    return {
        "meta": {
            "date": "2026-11-23",
            "device": "cuda",
            "link": "cuda",
            "link_detail": "NCCL between 1 GPU(s) of this machine",
            "gpu": "NVIDIA H100 80GB HBM3, 79 GiB",
            "gpus": 1,
            "driver": "580.00",
            "cuda": "13.0",
            "nccl": "2.28.9",
            "triton": "3.6.0",
            "torch": "2.11.0",
            "python": "3.11",
            "distcompile": "0.1.0",
            "world_size": 1,
            "rounds": 6,
            "block": 5,
            "warmup": 3,
            "machine": "x86_64",
            "model": "GPT 124M",
            "command": "python benchmarks/overlap.py --device cuda",
        },
        "floor": {},
        "variants": {
            "compile_noddp": row(20.0, 1000.0),
            "ddp": row(40.0, 2000.0, exposed_ms=20.0),
            "compile_ddpopt": row(44.0, 2100.0),
            "compile_ddpopt_cg": row(25.0, 2200.0),
            "fsdp_replicate": {"error": "ImportError: no fully_shard"},
            "dc_cudagraphs": row(22.0, 2050.0, exposed_ms=0.5, overlap_pct=90.0),
        },
    }


def test_gpu_table_compares_with_floor_ddp_and_ddpoptimizer() -> None:
    text = table(_gpu_results())
    header, _, *rows = text.splitlines()
    for col in ("wall ms", "vs floor", "vs DDPOpt+CG", "syncs/step", "peak GPU MB"):
        assert col in header
    (dc,) = [r for r in rows if r.startswith("dc_cudagraphs")]
    # 22 ms against the 20 ms floor, 40 ms DDP, 44 ms DDPOptimizer, 25 ms with CUDA graphs.
    assert "1.100x" in dc and "0.550x" in dc and "0.500x" in dc and "0.880x" in dc
    assert "2050 (1.025x)" in dc
    assert any(r.startswith("fsdp_replicate") and "failed: ImportError" in r for r in rows)


def test_gpu_report_names_the_gpu_and_versions() -> None:
    md = report_markdown(_gpu_results())
    assert md.startswith("# Overlap benchmark, cuda, 2026-11-23")
    assert "NCCL 2.28.9" in md and "Triton 3.6.0" in md and "driver 580.00" in md and "H100" in md


def test_gpu_report_of_ranks_sharing_a_gpu_says_gloo_through_host_memory() -> None:
    res = _gpu_results()
    res["meta"].update(world_size=2, ranks_per_gpu=2, link="cuda-2-per-gpu")
    md = report_markdown(res)
    assert md.startswith("# Overlap benchmark, cuda-2-per-gpu, 2026-11-23")
    assert (
        "2 gloo ranks, 2 on each GPU (NVIDIA H100 80GB HBM3, 79 GiB), all-reducing through host memory" in md
    )
    assert "NCCL rank" not in md and "one per GPU" not in table(res)
