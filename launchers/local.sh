#!/usr/bin/env bash
# Single node: torchrun --standalone with one rank per GPU (2 ranks on a CPU-only machine).
#
#   launchers/local.sh examples/train_gpt.py --distcompile --steps 50
#   NPROC=4 MAX_RESTARTS=2 launchers/local.sh examples/train_gpt.py --distcompile --ckpt-dir ckpt
#
# Environment: NPROC (ranks; default: GPU count, else 2), MAX_RESTARTS (elastic restarts
# after a rank fails; default 0). Everything after the script is passed to it.
set -euo pipefail
# The store setting, the event log and its summary, signals: launchers/torchrun.bash.
source "$(dirname "${BASH_SOURCE[0]}")/torchrun.bash"
if [[ $# -lt 1 ]]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
gpus=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
nproc=${NPROC:-$([[ "$gpus" -gt 0 ]] && echo "$gpus" || echo 2)}
run_torchrun --standalone --nproc-per-node "$nproc" \
  --max-restarts "${MAX_RESTARTS:-0}" "$@"
