#!/usr/bin/env bash
# Run a command in a world of its own — fresh network, mount and PID namespaces — so a real
# node (containerd, runc, the CNI bridge, kubelet, kube-proxy) can run beside the control
# plane without touching the machine:
#
#   e2e/controlplane/sandbox.sh DIR -- CMD [ARG...]
#
# Inside, CMD sees:
#   - only loopback and a veth pair tw0/tw1, the node address $NODE_IP (10.250.0.1/24) on
#     tw0 and a default route into tw1, where packets end: no traffic can leave;
#   - fresh tmpfs on /run, /var/lib and /var/log (containerd's root, state and shim sockets —
#     containerd 1.6 keeps those under /run/containerd whatever --state says —, the kubelet's
#     root, CNI state, pod logs), a fresh /proc and /sys;
#   - the machine-wide sysctls the kubelet rewrites at every start (vm.overcommit_memory,
#     vm.panic_on_oom, kernel.panic, kernel.panic_on_oops, kernel.keys.root_maxkeys,
#     kernel.keys.root_maxbytes) replaced by files holding the machine's values, so the
#     kubelet's writes land there and the machine's settings never change;
#   - $CGROUP_ROOT, a cgroup made for it in every hierarchy (under this process's own memory
#     cgroup path), for the kubelet's --cgroup-root;
#   - TAILWARDEN_SANDBOX=1, NODE_IP, SANDBOX_DIR=DIR.
#
# Nothing survives it. CMD is PID 1's only child in the new PID namespace; when it exits, or
# this script dies in any way (even SIGKILL: the namespace's first process has a parent-death
# signal), the kernel kills every process inside and the mount and network namespaces go with
# them. What lives outside namespaces — the cgroups — is removed afterwards by this script
# or, if it was killed, by a reaper that watches it. DIR (on the host, for logs) is the
# caller's. Exit status: CMD's.
#
# Needs root, util-linux (unshare, setpriv), iproute2.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODE_IP="${SANDBOX_NODE_IP:-10.250.0.1}"
KERNEL_TUNABLES="vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes"
log() { echo "sandbox: $*" >&2; }

# ------------------------------------------------------------------ cgroups (host side)
# Every cgroup hierarchy mounted under /sys/fs/cgroup (v1 controllers, named and unified),
# or /sys/fs/cgroup itself on a pure v2 host.
hierarchies() {
  awk '$3 ~ /^cgroup2?$/ && $2 ~ "^/sys/fs/cgroup" {print $2}' /proc/self/mounts | sort -u
}
# remove_cgroups FILE: kill what is left in the cgroups listed (created ones, one per line,
# parents first) and remove them, deepest first. Idempotent.
remove_cgroups() {
  local list=$1 try d
  [[ -f "$list" ]] || return 0
  for try in 1 2 3 4 5 6 7 8 9 10; do
    local left=0
    # Deepest first: the kubelet's kubepods/… children before their parents.
    while IFS= read -r d; do
      [[ -d "$d" ]] || continue
      find "$d" -depth -type d 2>/dev/null | while IFS= read -r c; do
        if [[ -s "$c/cgroup.procs" ]]; then xargs -r kill -KILL < "$c/cgroup.procs" 2>/dev/null || true; fi
        rmdir "$c" 2>/dev/null || true
      done
      [[ -d "$d" ]] && left=1
    done < <(tac "$list")
    [[ $left == 0 ]] && { rm -f "$list"; return 0; }
    sleep 0.5
  done
  log "could not remove every cgroup in $list"
  return 1
}

if [[ "${1:-}" != --inside ]]; then
  [[ $# -ge 3 && "$2" == -- ]] || { echo "usage: sandbox.sh DIR -- CMD [ARG...]" >&2; exit 2; }
  DIR="$1"; shift 2
  [[ $EUID == 0 ]] || { log "needs root (namespaces, mounts, cgroups)"; exit 1; }
  for tool in unshare setpriv ip; do
    command -v "$tool" >/dev/null || { log "$tool not found"; exit 1; }
  done
  mkdir -p "$DIR"; DIR="$(cd "$DIR" && pwd)"
  # The kubelet's cgroup root, named after this process, nested under the memory cgroup this
  # process runs in: the pods' memory stays accounted where the caller's is.
  parent="$(awk -F: '$2=="memory" {print $3}' /proc/self/cgroup)"
  [[ -n "$parent" ]] || parent="$(awk -F: '$1=="0" {print $3}' /proc/self/cgroup)"
  CGROUP_ROOT="${parent%/}/tailwarden-node-$$"
  CREATED="$DIR/.sandbox-cgroups"
  : > "$CREATED"
  for h in $(hierarchies); do
    [[ -f "$h/cgroup.procs" ]] || continue
    path="$h"
    for part in ${CGROUP_ROOT//\// }; do
      path="$path/$part"
      if [[ ! -d "$path" ]]; then
        mkdir "$path"; echo "$path" >> "$CREATED"
        # A new v1 cpuset is empty and takes no tasks until it has CPUs and memory nodes.
        if [[ -f "$path/cpuset.cpus" ]]; then
          cat "$(dirname "$path")/cpuset.cpus" > "$path/cpuset.cpus"
          cat "$(dirname "$path")/cpuset.mems" > "$path/cpuset.mems"
        fi
      fi
    done
  done

  # The reaper: once this script is gone (any way), remove the cgroups. Identity is pid +
  # start time, so a recycled pid does not fool it.
  start_of() { local s; s="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1; s="${s##*) }"; set -- $s
    [[ "$1" != Z && "$1" != X ]] || return 1; echo "${20}"; }
  me_start="$(start_of $$)"
  setsid bash -c "$(declare -f start_of remove_cgroups log)"'
    while [[ "$(start_of "$1")" == "$2" ]]; do sleep 1; done
    remove_cgroups "$3"
  ' reaper "$$" "$me_start" "$CREATED" </dev/null >>"$DIR/sandbox-reaper.log" 2>&1 &
  REAPER=$!

  # setpriv: the PID namespace's parent (unshare) is SIGKILLed when this script dies;
  # --kill-child: then so is the namespace's first process, and with it all inside.
  set +e
  setpriv --pdeathsig KILL -- unshare --net --mount --pid --fork --kill-child --mount-proc \
    --propagation private -- "$0" --inside "$DIR" "$CGROUP_ROOT" -- "$@"
  rc=$?
  set -e
  if ! remove_cgroups "$CREATED" && [[ $rc == 0 ]]; then rc=1; fi
  kill "$REAPER" 2>/dev/null || true
  exit "$rc"
fi

# ------------------------------------------------------------------ inside the namespaces
shift
DIR="$1"; CGROUP_ROOT="$2"; shift 2; [[ "$1" == -- ]] && shift

# What is "inside", for checks from outside that nothing of it is left.
for ns in pid net mnt; do echo "$ns $(readlink "/proc/self/ns/$ns")"; done > "$DIR/.sandbox-ns"

ip link set lo up
ip link add tw0 type veth peer name tw1
ip addr add "$NODE_IP/24" dev tw0
ip link set tw0 up; ip link set tw1 up
ip route add default dev tw0

# /sys for this network namespace (its /sys/class/net), keeping the machine's cgroup mounts.
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p /run/.cg && mount --rbind /sys/fs/cgroup /run/.cg
mount -t sysfs sysfs /sys
mount --move /run/.cg /sys/fs/cgroup
rmdir /run/.cg 2>/dev/null || true
mount -t tmpfs -o mode=755 tmpfs /var/lib
mount -t tmpfs -o mode=755 tmpfs /var/log
# The machine-wide tunables the kubelet sets, as files with the machine's values.
mkdir -p /run/sandbox-sysctl
for t in $KERNEL_TUNABLES; do
  f="/run/sandbox-sysctl/${t//\//.}"
  cat "/proc/sys/$t" > "$f"
  mount --bind "$f" "/proc/sys/$t"
done

export TAILWARDEN_SANDBOX=1 NODE_IP SANDBOX_DIR="$DIR" CGROUP_ROOT
# PID 1 of the namespace: run CMD as a child (so signals reach it and orphans are reaped
# here), pass SIGTERM/SIGINT on, exit with its status.
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
while :; do
  set +e; wait "$child"; rc=$?; set -e
  kill -0 "$child" 2>/dev/null || break
done
exit "$rc"
