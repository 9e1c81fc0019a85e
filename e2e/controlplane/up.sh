#!/usr/bin/env bash
# Bring up a real Kubernetes control plane on loopback, in DIR:
#   etcd (embedded, v3.5.21) → kube-apiserver → kube-controller-manager,
#   kube-scheduler, kwok (fake node "kwok-node-0", pods become Running).
#
#   e2e/controlplane/up.sh [--owner-pid PID|none] DIR
#   . DIR/env            # KUBECONFIG, KUBE_APISERVER_URL, ports, pids (see README.md)
#   e2e/controlplane/down.sh DIR
#
# With --node (only inside sandbox.sh, which gives it a network of its own), kwok is
# replaced by a real node: containerd, runc, the CNI bridge, kube-proxy and a kubelet
# (node.sh), the apiserver listens on the node address too and pods reach it through the
# `kubernetes` Service, and the images in .cache/images are imported (NODE_IMAGES names
# them; default: pause operator sidecar openai-app).
#
# Ports are chosen free at run time. Every component runs in its own process
# group (setsid) and is recorded in DIR/pids; down.sh stops them all.
# Nothing is left behind:
#   - if up.sh itself fails or is interrupted, its EXIT trap runs down.sh;
#   - after a successful start a reaper watches the owner process (default: the
#     caller of up.sh, i.e. $PPID) and runs down.sh when it exits, even if it
#     was SIGKILLed. Use --owner-pid none to keep the cluster until down.sh
#     (interactive use), or --owner-pid PID for another lifetime.
#
# Environment: CONTROLPLANE_BIN (use these binaries, skip build.sh),
#   CONTROLPLANE_AGGREGATOR_ROUTING=1 (apiserver --enable-aggregator-routing:
#   Service-referenced webhooks resolve through Endpoints instead of ClusterIP),
#   CONTROLPLANE_TIMEOUT (seconds to wait for readiness, default 120),
#   KUBECTL (default: the kubectl build.sh built, else kubectl on PATH).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OWNER="$PPID"
NODE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --node) NODE=1; shift ;;
    --owner-pid) OWNER="$2"; shift 2 ;;
    --owner-pid=*) OWNER="${1#*=}"; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    -*) echo "up.sh: unknown flag $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ $# -eq 1 ]] || { echo "usage: up.sh [--node] [--owner-pid PID|none] DIR" >&2; exit 2; }
if [[ $NODE == 1 && ( "${TAILWARDEN_SANDBOX:-}" != 1 || -z "${NODE_IP:-}" ) ]]; then
  echo "up.sh: --node runs only inside e2e/controlplane/sandbox.sh (its own network, mounts and sysctls)" >&2
  exit 2
fi
DIR="$1"
case "$DIR" in *[[:space:]]*) echo "up.sh: DIR must not contain whitespace" >&2; exit 2 ;; esac
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
if [[ -n "$(ls -A "$DIR")" ]]; then
  echo "up.sh: $DIR is not empty (a running cluster? run down.sh $DIR first)" >&2; exit 2
fi
touch "$DIR/.tailwarden-controlplane"   # down.sh only deletes directories carrying this
mkdir -p "$DIR/pki" "$DIR/logs" "$DIR/kwok-home"; mkdir -m 700 "$DIR/etcd"
: > "$DIR/pids"

TIMEOUT="${CONTROLPLANE_TIMEOUT:-120}"
REPO="$(cd "$HERE/../.." && pwd)"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
log() { echo "up.sh: $*" >&2; }
T_START="$(now)"

SUCCESS=0
cleanup() {
  local rc=$?
  if [[ "$SUCCESS" != 1 ]]; then
    log "failed (exit $rc); last log lines:"
    local f; for f in "$DIR"/logs/*.log; do
      [[ -s "$f" && "$f" != */openssl.log ]] || continue
      echo "----- $(basename "$f") (tail) -----" >&2; tail -n 25 "$f" >&2
    done
    CONTROLPLANE_KEEP_LOGS="${CONTROLPLANE_KEEP_LOGS:-1}" "$HERE/down.sh" "$DIR" >&2 || true
  fi
}
trap cleanup EXIT
set -E
trap 'log "failed at line $LINENO: $BASH_COMMAND"' ERR
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# ---------------------------------------------------------------- binaries
if [[ -n "${CONTROLPLANE_BIN:-}" ]]; then BIN="$CONTROLPLANE_BIN"
else BIN="$("$HERE/build.sh")"
fi
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do
  [[ -x "$BIN/$b" ]] || { log "missing $BIN/$b"; exit 1; }
done
K8S_VERSION="$(basename "$(dirname "$BIN")")"
if [[ -z "${KUBECTL:-}" ]]; then
  if [[ -x "$BIN/kubectl" ]]; then KUBECTL="$BIN/kubectl"; else KUBECTL="$(command -v kubectl || true)"; fi
fi
[[ -n "$KUBECTL" ]] || { log "kubectl not found (build.sh builds it; or set KUBECTL)"; exit 1; }
if [[ $NODE == 1 ]]; then
  # shellcheck source=node.sh
  . "$HERE/node.sh"
  node_check
fi

# ---------------------------------------------------------------- ports
# Random ports below the ephemeral range (so outgoing connections cannot be
# holding them), checked free by a connect attempt; a bind race with another
# process is caught by start_component's retry.
declare -A TAKEN=()
pick_port() { # pick_port VAR: set VAR to a free port not picked before by this script
  local p i
  for i in $(seq 1 200); do
    p=$(( 20000 + (RANDOM * 32768 + RANDOM) % 12000 ))
    [[ -z "${TAKEN[$p]:-}" ]] || continue
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then TAKEN[$p]=1; printf -v "$1" '%s' "$p"; return; fi
  done
  log "no free port found"; return 1
}

# ---------------------------------------------------------------- certificates
PKI="$DIR/pki"
t="$(now)"
ossl() { openssl "$@" 2>>"$DIR/logs/openssl.log"; }
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
  -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -subj "/CN=tailwarden-test-ca"
# issue NAME SUBJECT [SAN] — a cert signed by the CA (client auth if no SAN)
issue() {
  local name=$1 subj=$2 san=${3:-} ext="$PKI/$1.ext"
  ossl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$PKI/$name.key" -out "$PKI/$name.csr" -subj "$subj"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [[ -n "$san" ]]; then echo "extendedKeyUsage=serverAuth"; echo "subjectAltName=$san"
    else echo "extendedKeyUsage=clientAuth"; fi
  } > "$ext"
  ossl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$ext" -out "$PKI/$name.crt"
  rm -f "$PKI/$name.csr" "$ext"
}
APISERVER_SANS="IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
[[ $NODE == 1 ]] && APISERVER_SANS+=",IP:$NODE_IP"
issue apiserver "/CN=kube-apiserver" "$APISERVER_SANS"
issue admin "/O=system:masters/CN=tailwarden-admin"
issue controller-manager "/CN=system:kube-controller-manager"
issue scheduler "/CN=system:kube-scheduler"
issue kwok "/O=system:masters/CN=kwok"
# front proxy (aggregation layer): its CA is what KCM and the scheduler read
# from extension-apiserver-authentication for request-header authentication.
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
  -keyout "$PKI/front-proxy-ca.key" -out "$PKI/front-proxy-ca.crt" -subj "/CN=tailwarden-test-front-proxy-ca"
issue_front_proxy() {
  ossl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$PKI/front-proxy-client.key" -out "$PKI/front-proxy-client.csr" -subj "/CN=front-proxy-client"
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' > "$PKI/fp.ext"
  ossl x509 -req -in "$PKI/front-proxy-client.csr" -CA "$PKI/front-proxy-ca.crt" -CAkey "$PKI/front-proxy-ca.key" \
    -CAcreateserial -days 3650 -sha256 -extfile "$PKI/fp.ext" -out "$PKI/front-proxy-client.crt"
  rm -f "$PKI/front-proxy-client.csr" "$PKI/fp.ext"
}
issue_front_proxy
[[ $NODE == 1 ]] && node_certs
ossl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$PKI/sa.key"
ossl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub"
ADMIN_TOKEN="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
echo "$ADMIN_TOKEN,tailwarden-admin-token,tailwarden-admin-token,system:masters" > "$PKI/tokens.csv"
chmod 600 "$PKI"/*.key "$PKI/tokens.csv"
log "certificates in $(since "$t")s"

# ---------------------------------------------------------------- processes
# start NAME CMD... — own session/process group, output to logs/NAME.log
start() {
  local name=$1; shift
  setsid "$@" </dev/null >>"$DIR/logs/$name.log" 2>&1 &
  local pid=$!
  echo "$name $pid" >> "$DIR/pids"
  printf -v "PID_${name//-/_}" '%s' "$pid"
}
alive() { kill -0 "$1" 2>/dev/null; }
pid_of() { local v="PID_${1//-/_}"; echo "${!v}"; }
# wait_for NAME DESCRIPTION CMD... — until CMD succeeds; fails if NAME died
wait_for() {
  local name=$1 what=$2; shift 2
  local deadline=$(( SECONDS + TIMEOUT ))
  until "$@" >/dev/null 2>&1; do
    alive "$(pid_of "$name")" || { log "$name exited while waiting for $what"; return 1; }
    (( SECONDS < deadline )) || { log "timed out after ${TIMEOUT}s waiting for $what"; return 1; }
    sleep 0.2
  done
}
bind_failed() { grep -qiE 'address already in use|bind: ' "$DIR/logs/$1.log"; }
# await_component NAME PORTVARS READY-DESC READY-FN LAUNCHER: wait for a
# launched component; if it died because a port was taken, choose new ports
# (the variables named in PORTVARS) and launch it again, up to 3 times.
await_component() {
  local name=$1 portvars=$2 what=$3 readyfn=$4 launcher=$5 attempt v
  for attempt in 1 2 3; do
    if wait_for "$name" "$what" "$readyfn"; then return 0; fi
    if alive "$(pid_of "$name")" || ! bind_failed "$name"; then return 1; fi
    log "$name: port taken, retrying with new ports"
    sed -i "/^$name /d" "$DIR/pids"
    for v in $portvars; do pick_port "$v"; done
    "$launcher"
  done
  return 1
}
# start_component: choose ports, launch, await (same arguments)
start_component() {
  local v; for v in $2; do pick_port "$v"; done
  "$5"
  await_component "$@"
}

# etcd
launch_etcd() {
  start etcd "$BIN/etcd" --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT"
}
etcd_ready() { curl -sf --max-time 2 "http://127.0.0.1:$ETCD_CLIENT_PORT/health" | grep -q '"health":"true"'; }
t="$(now)"
start_component etcd "ETCD_CLIENT_PORT ETCD_PEER_PORT" "etcd /health" etcd_ready launch_etcd
log "etcd ready on 127.0.0.1:$ETCD_CLIENT_PORT in $(since "$t")s"

# kube-apiserver. Without a node, --endpoint-reconciler-type=none: the default
# reconciler would write 127.0.0.1 into Endpoints default/kubernetes every 10 s
# and fail ("may not be in the loopback range"); nothing there needs that object.
ROUTING=false; [[ "${CONTROLPLANE_AGGREGATOR_ROUTING:-0}" == 1 ]] && ROUTING=true
SA_ISSUER="https://kubernetes.default.svc.cluster.local"
# With a node, pods reach the apiserver through the `kubernetes` Service: it listens on the
# sandbox's node address too and the lease reconciler publishes that address as the
# Service's endpoint (kube-proxy does the rest); it reaches kubelets (logs, exec) with its
# own client certificate and checks theirs.
if [[ $NODE == 1 ]]; then
  APISERVER_NET=(--bind-address=0.0.0.0 --advertise-address="$NODE_IP" --endpoint-reconciler-type=lease
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt"
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key"
    --kubelet-certificate-authority="$PKI/ca.crt" --kubelet-preferred-address-types=InternalIP)
else
  APISERVER_NET=(--bind-address=127.0.0.1 --advertise-address=127.0.0.1 --endpoint-reconciler-type=none)
fi
launch_apiserver() {
  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
    "${APISERVER_NET[@]}" --secure-port="$APISERVER_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" --token-auth-file="$PKI/tokens.csv" \
    --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$PKI/front-proxy-client.crt" --proxy-client-key-file="$PKI/front-proxy-client.key" \
    --service-account-issuer="$SA_ISSUER" \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --authorization-mode=Node,RBAC \
    --enable-admission-plugins=NodeRestriction \
    --service-cluster-ip-range=10.0.0.0/24 \
    --enable-aggregator-routing="$ROUTING" \
    --allow-privileged=true --profiling=false
}
apiserver_ready() {
  curl -sf --max-time 3 --cacert "$PKI/ca.crt" "https://127.0.0.1:$APISERVER_PORT/readyz" | grep -qx ok
}
t="$(now)"
start_component kube-apiserver APISERVER_PORT "kube-apiserver /readyz" apiserver_ready launch_apiserver
SERVER="https://127.0.0.1:$APISERVER_PORT"
log "kube-apiserver ready at $SERVER in $(since "$t")s"

# kubeconfigs: admin (DIR/kubeconfig) and one per component
kubeconfig() { # kubeconfig FILE USER CERTNAME
  local f=$1 user=$2 cert=$3
  KUBECONFIG="$f" "$KUBECTL" config set-cluster tailwarden-test --server="$SERVER" \
    --certificate-authority="$PKI/ca.crt" --embed-certs=true >/dev/null
  KUBECONFIG="$f" "$KUBECTL" config set-credentials "$user" \
    --client-certificate="$PKI/$cert.crt" --client-key="$PKI/$cert.key" --embed-certs=true >/dev/null
  KUBECONFIG="$f" "$KUBECTL" config set-context tailwarden-test --cluster=tailwarden-test \
    --user="$user" --namespace=default >/dev/null
  KUBECONFIG="$f" "$KUBECTL" config use-context tailwarden-test >/dev/null
  chmod 600 "$f"
}
kubeconfig "$DIR/kubeconfig" tailwarden-admin admin
kubeconfig "$PKI/controller-manager.kubeconfig" system:kube-controller-manager controller-manager
kubeconfig "$PKI/scheduler.kubeconfig" system:kube-scheduler scheduler
kubeconfig "$PKI/kwok.kubeconfig" kwok kwok
export KUBECONFIG="$DIR/kubeconfig"

# kube-controller-manager, kube-scheduler, kwok: started together
t="$(now)"
pick_port KCM_PORT; pick_port SCHEDULER_PORT
KCFG="$PKI/controller-manager.kubeconfig"
launch_kcm() {
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig="$KCFG" --authentication-kubeconfig="$KCFG" --authorization-kubeconfig="$KCFG" \
    --bind-address=127.0.0.1 --secure-port="$KCM_PORT" \
    --controllers='*' --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --service-cluster-ip-range=10.0.0.0/24 \
    --leader-elect=false --profiling=false
}
SCFG="$PKI/scheduler.kubeconfig"
launch_scheduler() {
  start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig="$SCFG" --authentication-kubeconfig="$SCFG" --authorization-kubeconfig="$SCFG" \
    --bind-address=127.0.0.1 --secure-port="$SCHEDULER_PORT" \
    --leader-elect=false --profiling=false
}
launch_kcm
launch_scheduler
PID_kwok=""
if [[ $NODE == 0 ]]; then
  KWOK_CONFIG=()
  for s in "$HERE"/stages/*.yaml; do KWOK_CONFIG+=(--config "$s"); done
  # HOME points at an empty dir so a user's ~/.kwok/kwok.yaml is not merged in.
  # kwok serves nothing (no --server-address), so it needs no port.
  start kwok env HOME="$DIR/kwok-home" "$BIN/kwok" "${KWOK_CONFIG[@]}" \
    --kubeconfig="$PKI/kwok.kubeconfig" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --node-lease-duration-seconds=40 --cidr=10.244.0.0/16 --node-ip=10.250.0.1
fi

healthz() { curl -sfk --max-time 2 "https://127.0.0.1:$1/healthz" | grep -qx ok; }
kcm_ready() { healthz "$KCM_PORT"; }
scheduler_ready() { healthz "$SCHEDULER_PORT"; }
await_component kube-controller-manager KCM_PORT "kube-controller-manager /healthz" kcm_ready launch_kcm
await_component kube-scheduler SCHEDULER_PORT "kube-scheduler /healthz" scheduler_ready launch_scheduler
log "controller-manager and scheduler healthy in $(since "$t")s"

default_sa() { "$KUBECTL" -n default get serviceaccount default; }
KWOK_NODE=""
NODE_READY_SECONDS=""
if [[ $NODE == 1 ]]; then
  start_node
  wait_for kube-controller-manager "ServiceAccount default/default" default_sa
else
# One fake node, managed by kwok because of its annotation. No taint: every
# pod may land on it.
KWOK_NODE=kwok-node-0
"$KUBECTL" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $KWOK_NODE
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: $KWOK_NODE
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
EOF
node_ready() {
  [[ "$("$KUBECTL" get node "$KWOK_NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]]
}
wait_for kwok "node $KWOK_NODE Ready (kwok)" node_ready
wait_for kube-controller-manager "ServiceAccount default/default" default_sa
log "node $KWOK_NODE Ready in $(since "$t")s"
fi

# ---------------------------------------------------------------- reaper
# Tears the cluster down when the owner process goes away (any exit, even
# SIGKILL). Identity is pid + start time, so a recycled pid does not fool it.
REAPER_PID=""
# proc_start PID: the process's start time, or failure if it is gone or a zombie
# (a SIGKILLed owner stays a zombie until its own parent reaps it).
PROC_START='proc_start() { local s; s="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  s="${s##*) }"; set -- $s; [[ "$1" != Z && "$1" != X ]] || return 1; echo "${20}"; }'
eval "$PROC_START"
if [[ "$OWNER" != none ]]; then
  owner_start="$(proc_start "$OWNER")" || { log "owner pid $OWNER is not running"; exit 1; }
  setsid bash -c "$PROC_START"'
    owner=$1 start=$2 dir=$3 down=$4
    while [[ "$(proc_start "$owner")" == "$start" ]]; do sleep 1; done
    echo "owner $owner exited; tearing down $dir"
    CONTROLPLANE_FROM_REAPER=1 "$down" "$dir"
  ' reaper "$OWNER" "$owner_start" "$DIR" "$HERE/down.sh" </dev/null >>"$DIR/logs/reaper.log" 2>&1 &
  REAPER_PID=$!
  echo "reaper $REAPER_PID" >> "$DIR/pids"
fi

# ---------------------------------------------------------------- env
cat > "$DIR/env" <<EOF
CONTROLPLANE_DIR=$DIR
K8S_VERSION=$K8S_VERSION
KUBECONFIG=$DIR/kubeconfig
KUBE_APISERVER_URL=$SERVER
KUBE_APISERVER_PORT=$APISERVER_PORT
ETCD_URL=http://127.0.0.1:$ETCD_CLIENT_PORT
ETCD_CLIENT_PORT=$ETCD_CLIENT_PORT
ETCD_PEER_PORT=$ETCD_PEER_PORT
KCM_PORT=$KCM_PORT
SCHEDULER_PORT=$SCHEDULER_PORT
CA_CERT=$PKI/ca.crt
CA_KEY=$PKI/ca.key
ADMIN_CERT=$PKI/admin.crt
ADMIN_KEY=$PKI/admin.key
ADMIN_TOKEN=$ADMIN_TOKEN
SA_ISSUER=$SA_ISSUER
SA_SIGNING_KEY=$PKI/sa.key
AGGREGATOR_ROUTING=$ROUTING
KWOK_NODE=$KWOK_NODE
BIN_DIR=$BIN
HELM=$BIN/helm
KUBECTL=$KUBECTL
LOG_DIR=$DIR/logs
ETCD_PID=$PID_etcd
KUBE_APISERVER_PID=$PID_kube_apiserver
KCM_PID=$PID_kube_controller_manager
SCHEDULER_PID=$PID_kube_scheduler
KWOK_PID=$PID_kwok
REAPER_PID=$REAPER_PID
OWNER_PID=$OWNER
EOF
if [[ $NODE == 1 ]]; then
  cat >> "$DIR/env" <<EOF
NODE_NAME=$NODE_NAME
NODE_IP=$NODE_IP
NODE_READY_SECONDS=$NODE_READY_SECONDS
CONTAINERD_ADDRESS=/run/containerd/containerd.sock
PAUSE_IMAGE=$PAUSE_IMAGE
CONTAINERD_PID=$PID_containerd
KUBELET_PID=$PID_kubelet
KUBE_PROXY_PID=$PID_kube_proxy
EOF
fi
SUCCESS=1
log "control plane $K8S_VERSION up in $(since "$T_START")s: . $DIR/env"
