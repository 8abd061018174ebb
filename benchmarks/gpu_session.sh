#!/usr/bin/env bash
# One short GPU session in one command (docs/gpu.md, "The next GPU session"): the versions,
# the GPU tests, then the overlap benchmark on the small model (every CUDA variant) and on the
# benchmark GPT (the variants the goals name), each step under its own time limit so a slow
# one leaves the others their turn. Logs and results go to $OUT (default: gpu-session/).
#
#   PYTHONPATH=. OUT=/tmp/gpu benchmarks/gpu_session.sh [TESTS_S SMALL_S FULL_S]
set -uo pipefail
OUT=${OUT:-gpu-session}
TESTS_S=${1:-300} SMALL_S=${2:-150} FULL_S=${3:-200}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== tests/gpu (limit ${TESTS_S}s; the two benchmark tests run below as the benchmark itself)"
timeout "$TESTS_S" "$PY" -m pytest tests/gpu -q -rA -p no:cacheprovider --timeout "$TESTS_S" \
  -k "not benchmark" 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
echo "tests rc=${PIPESTATUS[0]}"

echo "== benchmark, small model, every CUDA variant (limit ${SMALL_S}s)"
timeout "$SMALL_S" "$PY" benchmarks/overlap.py --device cuda --small --no-first-steps \
  --rounds 2 --block 5 --warmup 2 --out-dir "$OUT" 2>&1 | tee "$OUT/bench-small.log" | tail -25
echo "bench small rc=${PIPESTATUS[0]}"

echo "== benchmark, benchmark GPT (limit ${FULL_S}s)"
timeout "$FULL_S" "$PY" benchmarks/overlap.py --device cuda --no-first-steps --rounds 2 --block 5 \
  --variants ddp,compile_ddpopt,compile_ddpopt_cg,dc_inductor,dc_inductor_quiet,dc_cudagraphs --out-dir "$OUT" 2>&1 \
  | tee "$OUT/bench-gpt.log" | tail -25
echo "bench gpt rc=${PIPESTATUS[0]}"
