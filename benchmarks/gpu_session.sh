#!/usr/bin/env bash
# One short GPU session in one command (docs/gpu.md, "The next GPU session"): the versions,
# where a step's host time goes (benchmarks/gpu_host_profile.py), the overlap benchmark on the
# benchmark GPT (the variants the goals name, distcompile with telemetry on and off), then the
# GPU tests; each step under its own time limit so a slow one leaves the others their turn.
# Logs and results go to $OUT (default: gpu-session/): seven files, under the device tool's
# eight.
#
#   PYTHONPATH=. OUT=/tmp/gpu benchmarks/gpu_session.sh [PROFILE_S BENCH_S TESTS_S]
set -uo pipefail
OUT=${OUT:-gpu-session}
PROFILE_S=${1:-140} BENCH_S=${2:-200} TESTS_S=${3:-180}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
{
  date -u
  git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  # Telemetry's event records are checksummed in C only with google-crc32c (Note [Event records]).
  "$PY" -c "import tensorboard, google_crc32c as g; print('tensorboard', tensorboard.__version__, 'google-crc32c', g.implementation)" \
    || echo "google-crc32c or tensorboard missing: telemetry's event records in pure Python"
  nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== host profile, benchmark GPT (limit ${PROFILE_S}s)"
timeout "$PROFILE_S" "$PY" benchmarks/gpu_host_profile.py --out-dir "$OUT" >"$OUT/host-profile.log" 2>&1
echo "host profile rc=$?"
tail -12 "$OUT/host-profile.log"

echo "== benchmark, benchmark GPT (limit ${BENCH_S}s)"
timeout "$BENCH_S" "$PY" benchmarks/overlap.py --device cuda --no-first-steps --rounds 2 --block 5 \
  --variants ddp,compile_ddpopt,compile_ddpopt_cg,regional,dc_inductor,dc_inductor_quiet,dc_cudagraphs \
  --out-dir "$OUT" >"$OUT/bench-gpt.log" 2>&1
echo "bench gpt rc=$?"
tail -14 "$OUT/bench-gpt.log"

echo "== tests/gpu (limit ${TESTS_S}s; the two benchmark tests are the benchmark above)"
timeout "$TESTS_S" "$PY" -m pytest tests/gpu -q -rA -p no:cacheprovider --timeout "$TESTS_S" \
  -k "not benchmark" >"$OUT/gpu-tests.log" 2>&1
echo "tests rc=$?"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu-tests.log" | tail -25
