#!/usr/bin/env bash
# Stop a control plane started by up.sh DIR and remove its state.
#
#   e2e/controlplane/down.sh DIR
#
# Every process listed in DIR/pids is the leader of its own process group
# (up.sh starts each with setsid) and the whole group is signalled. Then DIR is
# deleted, unless CONTROLPLANE_KEEP_LOGS=1, in which case only DIR/logs is kept
# (up.sh does that when it fails).
# Components get SIGTERM in reverse start order (a node's kubelet and kube-proxy,
# then containerd; kwok, scheduler and KCM together, then the apiserver, then etcd), SIGKILL after CONTROLPLANE_STOP_GRACE
# seconds (default 10) per step; about 1.5 s in all.
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

# group_alive PGID: a member of the group is still running. Zombies do not count:
# they hold no ports or memory, and a slow init may take a while to reap them.
group_alive() {
  ps -e -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}
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
  # A node (up.sh --node) first: the kubelet and kube-proxy, then containerd.
  for group in "kubelet kube-proxy" containerd "kwok kube-scheduler kube-controller-manager" kube-apiserver etcd; do
    pids=()
    for name in $group; do [[ -n "${PIDS[$name]:-}" ]] && pids+=("${PIDS[$name]}"); done
    [[ ${#pids[@]} -gt 0 ]] && stop "${pids[@]}"
  done
fi

if [[ "$KEEP" == 1 ]]; then
  find "$DIR" -mindepth 1 -maxdepth 1 ! -name logs ! -name .tailwarden-controlplane -exec rm -rf {} +
  echo "down.sh: stopped; logs kept in $DIR/logs" >&2
else
  rm -rf "$DIR"
fi
