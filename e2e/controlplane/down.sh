#!/usr/bin/env bash
# Stop a control plane started by up.sh DIR and remove its state.
#
#   e2e/controlplane/down.sh DIR
#
# Every process listed in DIR/pids is the leader of its own process group
# (up.sh starts each with setsid) and the whole group is signalled. Then DIR is
# deleted, unless CONTROLPLANE_KEEP_LOGS=1, in which case only DIR/logs is kept
# (up.sh does that when it fails).
#   - State thrown away (default): SIGKILL to every group at once. The state is
#     deleted anyway, and a graceful stop costs ~7 s (each component takes 2-3 s).
#   - CONTROLPLANE_KEEP_LOGS=1 or CONTROLPLANE_GRACEFUL=1: SIGTERM in reverse
#     start order so the logs end cleanly, SIGKILL after CONTROLPLANE_STOP_GRACE
#     seconds (default 10) per step.
# Idempotent: a second call, or a call on a half-started DIR, is fine. Only
# directories carrying up.sh's marker file are deleted.
set -uo pipefail

[[ $# -eq 1 ]] || { echo "usage: down.sh DIR" >&2; exit 2; }
DIR="$1"
[[ -d "$DIR" ]] || exit 0
DIR="$(cd "$DIR" && pwd)"
if [[ ! -f "$DIR/.tailwarden-controlplane" ]]; then
  echo "down.sh: $DIR was not created by up.sh (no .tailwarden-controlplane); not touching it" >&2
  exit 2
fi
GRACE="${CONTROLPLANE_STOP_GRACE:-10}"
KEEP="${CONTROLPLANE_KEEP_LOGS:-0}"
GRACEFUL="${CONTROLPLANE_GRACEFUL:-$KEEP}"

group_alive() { kill -0 -- "-$1" 2>/dev/null; }
# stop PID...: TERM the groups, wait, KILL the survivors
stop() {
  local pid deadline=$(( SECONDS + GRACE )) left
  for pid in "$@"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null; done
  while :; do
    left=()
    for pid in "$@"; do group_alive "$pid" && left+=("$pid"); done
    [[ ${#left[@]} -eq 0 ]] && return 0
    (( SECONDS < deadline )) || break
    sleep 0.2
  done
  for pid in "${left[@]}"; do
    echo "down.sh: process group $pid did not stop in ${GRACE}s, killing" >&2
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
  done
}

if [[ -f "$DIR/pids" ]]; then
  declare -A PIDS=()
  while read -r name pid; do [[ -n "${pid:-}" ]] && PIDS[$name]=$pid; done < "$DIR/pids"
  # The reaper calls us itself; otherwise stop it first so it does not race us.
  if [[ -z "${CONTROLPLANE_FROM_REAPER:-}" && -n "${PIDS[reaper]:-}" ]]; then stop "${PIDS[reaper]}"; fi
  if [[ "$GRACEFUL" == 1 ]]; then
    for group in "kwok kube-scheduler kube-controller-manager" kube-apiserver etcd; do
      pids=()
      for name in $group; do [[ -n "${PIDS[$name]:-}" ]] && pids+=("${PIDS[$name]}"); done
      [[ ${#pids[@]} -gt 0 ]] && stop "${pids[@]}"
    done
  else
    pids=()
    for name in "${!PIDS[@]}"; do
      [[ $name == reaper ]] && continue
      kill -KILL -- "-${PIDS[$name]}" 2>/dev/null || kill -KILL "${PIDS[$name]}" 2>/dev/null
      pids+=("${PIDS[$name]}")
    done
    # wait until the kernel has reaped them, so their ports are free on return
    for _ in $(seq 1 100); do
      left=0; for pid in "${pids[@]}"; do group_alive "$pid" && left=1; done
      [[ $left == 0 ]] && break; sleep 0.05
    done
  fi
fi

if [[ "$KEEP" == 1 ]]; then
  find "$DIR" -mindepth 1 -maxdepth 1 ! -name logs ! -name .tailwarden-controlplane -exec rm -rf {} +
  echo "down.sh: stopped; logs kept in $DIR/logs" >&2
else
  rm -rf "$DIR"
fi
