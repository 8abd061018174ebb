#!/usr/bin/env bash
# Several nodes, c10d rendezvous. Run the same command on every node:
#
#   NNODES=2 RDZV_ENDPOINT=node0:29500 launchers/multinode.sh examples/train_gpt.py --distcompile
#   NNODES=1:4 RDZV_ENDPOINT=node0:29500 MAX_RESTARTS=3 launchers/multinode.sh train.py   # elastic
#
# Environment: NNODES (a count, or MIN:MAX for elastic membership; default 2),
# RDZV_ENDPOINT (host:port that every node reaches; required), NPROC (ranks per node;
# default: GPU count, else 1), NODE_RANK (optional; fixes this node's rank, non-elastic),
# RDZV_ID (job id shared by the nodes; default distcompile), MAX_RESTARTS (default 0),
# LOCAL_ADDR (the address this node advertises; default: its hostname's address),
# RDZV_CONF (torchrun --rdzv-conf, e.g. is_host=1 on the node that serves the endpoint when
# torchrun cannot tell from its hostname).
# On CPU, set GLOO_SOCKET_IFNAME to the interface the nodes talk over.
set -euo pipefail
# The store setting, the event log and its summary, signals: launchers/torchrun.bash.
source "$(dirname "${BASH_SOURCE[0]}")/torchrun.bash"
if [[ $# -lt 1 || -z "${RDZV_ENDPOINT:-}" ]]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
gpus=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
nproc=${NPROC:-$([[ "$gpus" -gt 0 ]] && echo "$gpus" || echo 1)}
args=(--nnodes "${NNODES:-2}" --nproc-per-node "$nproc" --rdzv-backend c10d
      --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-distcompile}"
      --max-restarts "${MAX_RESTARTS:-0}")
if [[ -n "${NODE_RANK:-}" ]]; then
  args+=(--node-rank "$NODE_RANK")
fi
if [[ -n "${RDZV_CONF:-}" ]]; then
  args+=(--rdzv-conf "$RDZV_CONF")
fi
if [[ -n "${LOCAL_ADDR:-}" ]]; then
  args+=(--local-addr "$LOCAL_ADDR")
fi
run_torchrun "${args[@]}" "$@"
