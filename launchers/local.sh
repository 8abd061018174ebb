#!/usr/bin/env bash
# Single node: torchrun --standalone with one rank per GPU (2 ranks on a CPU-only machine).
#
#   launchers/local.sh examples/train_gpt.py --distcompile --steps 50
#   NPROC=4 MAX_RESTARTS=2 launchers/local.sh examples/train_gpt.py --distcompile --ckpt-dir ckpt
#
# Environment: NPROC (ranks; default: GPU count, else 2), MAX_RESTARTS (elastic restarts
# after a rank fails; default 0). Everything after the script is passed to it.
set -euo pipefail
# Restarted ranks must not share the previous attempt's rendezvous store, or they can
# read stale addresses and fail to connect (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
# distcompile's event log: the summary at the end says how many failures the job recovered
# from and why. A DISTCOMPILE_EVENTS you set is kept; the default file is removed after it.
events_default=""
if [[ -z "${DISTCOMPILE_EVENTS:-}" ]]; then
  events_default=$(mktemp "${TMPDIR:-/tmp}/distcompile-events.XXXXXX")
  export DISTCOMPILE_EVENTS="$events_default"
fi
if [[ $# -lt 1 ]]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
gpus=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
nproc=${NPROC:-$([[ "$gpus" -gt 0 ]] && echo "$gpus" || echo 2)}
status=0
python -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
  --max-restarts "${MAX_RESTARTS:-0}" "$@" || status=$?
python -m distcompile._events "$DISTCOMPILE_EVENTS" >&2 || true
[[ -z "$events_default" ]] || rm -f "$events_default"
exit "$status"
