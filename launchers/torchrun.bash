# Sourced by local.sh and multinode.sh (not run on its own): what both do around torchrun.
#
#   run_torchrun TORCHRUN_ARGS... SCRIPT ARGS...
#
# - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless set: restarted ranks must not share the
#   previous attempt's rendezvous store, or they can read stale addresses and fail to
#   connect (pytorch#135712; docs/launching.md).
# - distcompile's event log: DISTCOMPILE_EVENTS as you set it, else a temporary file removed
#   at the end; its summary (lives of the process group, failures recovered from, each
#   life's first errors) is printed when torchrun exits.
# - SIGTERM, SIGINT and SIGHUP sent to the launcher's pid alone reach torchrun, which stops
#   its workers; the launcher then exits with torchrun's status.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

run_torchrun() {
  local events_default="" status=0 pid
  if [[ -z "${DISTCOMPILE_EVENTS:-}" ]]; then
    events_default=$(mktemp "${TMPDIR:-/tmp}/distcompile-events.XXXXXX")
    export DISTCOMPILE_EVENTS="$events_default"
  fi
  python -m torch.distributed.run "$@" &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null || true' TERM
  trap 'kill -INT "$pid" 2>/dev/null || true' INT
  trap 'kill -HUP "$pid" 2>/dev/null || true' HUP
  # A trapped signal interrupts `wait`; wait again until torchrun has really exited.
  while true; do
    wait "$pid" && status=0 || status=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - TERM INT HUP
  python -m distcompile.tools.cli events "$DISTCOMPILE_EVENTS" >&2 || true
  [[ -z "$events_default" ]] || rm -f "$events_default"
  return "$status"
}
