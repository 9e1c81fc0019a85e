#!/usr/bin/env bash
# Smoke test of the local control plane (make controlplane-smoke):
#   build (cached) → up → our CRD is accepted and Established → every example
#   route is accepted → invalid routes are rejected with our CEL messages →
#   a Deployment's pod is created, scheduled and Running (kwok) → down.
# Prints the time of each phase; on failure dumps what it saw and exits non-zero.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
KUBECTL="${KUBECTL:-$(command -v kubectl || true)}"
[[ -n "$KUBECTL" ]] || { echo "smoke: kubectl not found (set KUBECTL)" >&2; exit 1; }
export KUBECTL
WAIT="${SMOKE_TIMEOUT:-90}"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
T0="$(now)"
PHASES=()
PHASE="" PHASE_T=""
phase() { # phase NAME — ends the current phase, starts the next
  [[ -n "$PHASE" ]] && PHASES+=("$(printf '%-12s %6ss' "$PHASE" "$(since "$PHASE_T")")")
  PHASE="$1"; PHASE_T="$(now)"
  [[ -n "$PHASE" ]] && echo "=== smoke: $PHASE" >&2
  return 0
}
fail() { echo "smoke: FAIL [$PHASE]: $*" >&2; exit 1; }
k() { "$KUBECTL" "$@"; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tailwarden-cp-smoke.XXXXXX")"
CP="$WORK/cp"
UP=0
on_exit() {
  local rc=$? failed_in="$PHASE"
  set +e
  [[ -n "$PHASE" ]] && phase ""
  if [[ $rc -ne 0 && $UP == 1 ]]; then
    echo "===== smoke: dump (failed in phase '$failed_in') =====" >&2
    k get nodes -o wide >&2
    k get crd inferenceroutes.tailwarden.io -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}' >&2
    k get inferenceroutes,deployments,replicasets,pods -A -o wide >&2
    k get events -A --sort-by=.lastTimestamp >&2
    for f in "$CP"/logs/*.log; do
      echo "----- $(basename "$f") (last 40 lines) -----" >&2; tail -n 40 "$f" >&2
    done
  fi
  if [[ $UP == 1 ]]; then
    local t; t="$(now)"
    "$HERE/down.sh" "$CP"
    PHASES+=("$(printf '%-12s %6ss' down "$(since "$t")")")
  fi
  rm -rf "$WORK"
  echo "===== smoke: timings =====" >&2
  printf '  %s\n' "${PHASES[@]}" >&2
  printf '  %-12s %6ss\n' total "$(since "$T0")" >&2
  if [[ $rc -eq 0 ]]; then echo "smoke: PASS" >&2; else echo "smoke: FAIL (exit $rc)" >&2; fi
  exit $rc
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# ------------------------------------------------------------------ build
phase build
BIN="$("$HERE/build.sh")"

# ------------------------------------------------------------------ up
phase up
UP=1
CONTROLPLANE_BIN="$BIN" "$HERE/up.sh" "$CP"
set -a; . "$CP/env"; set +a
k version >&2
server_version="$(k version -o json | sed -n 's/.*"gitVersion": *"\(v[^"]*\)".*/\1/p' | tail -1)"
[[ "$server_version" == "$K8S_VERSION" ]] || fail "server reports $server_version, expected $K8S_VERSION"

# ------------------------------------------------------------------ crd
phase crd
if ! out="$(k apply -f "$REPO/crds/inferenceroute.yaml" 2>&1)"; then
  fail "the API server rejected crds/inferenceroute.yaml:
$out"
fi
echo "$out" >&2
k wait --for=condition=Established --timeout="${WAIT}s" crd/inferenceroutes.tailwarden.io >&2 \
  || fail "CRD not Established"
bad_conditions="$(k get crd inferenceroutes.tailwarden.io -o jsonpath='{range .status.conditions[?(@.status=="True")]}{.type}{"\n"}{end}' \
  | grep -vxE 'Established|NamesAccepted' || true)"
[[ -z "$bad_conditions" ]] || fail "CRD has conditions: $bad_conditions"
# The discovery cache must know the new kind before kubectl apply can use it.
for _ in $(seq 1 50); do k api-resources --api-group=tailwarden.io 2>/dev/null | grep -q inferenceroutes && break; sleep 0.2; done

# ------------------------------------------------------------------ examples
phase examples
shopt -s nullglob
examples=("$REPO"/examples/*.yaml)
[[ ${#examples[@]} -gt 0 ]] || fail "no examples/*.yaml"
for ns in $(sed -n 's/^ *namespace: *\([a-z0-9-]*\) *$/\1/p' "${examples[@]}" | sort -u); do
  k create namespace "$ns" --dry-run=client -o yaml | k apply -f - >/dev/null
done
for f in "${examples[@]}"; do
  if ! out="$(k apply -f "$f" 2>&1)"; then fail "$(basename "$f") was rejected:
$out"; fi
  echo "  accepted $(basename "$f"): $out" >&2
done
n="$(k get inferenceroutes -A --no-headers | wc -l)"
echo "  $n InferenceRoutes stored" >&2

# ------------------------------------------------------------------ invalid
phase invalid
NS=smoke
k create namespace "$NS" >/dev/null
route() { # route NAME TIMEOUTS PROVIDERS — a minimal route, to vary
  cat <<EOF
apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: $1, namespace: $NS}
spec:
  models: ["mock-model"]
  timeouts: $2
  providers:
$3
EOF
}
P_A='  - {name: primary, baseUrl: "http://127.0.0.1:18000/v1", auth: {secretRef: {name: keys, key: primary}}}'
P_B='  - {name: backup, baseUrl: "http://127.0.0.1:18001/v1", auth: {secretRef: {name: keys, key: backup}}}'
P_A2='  - {name: primary, baseUrl: "http://127.0.0.1:18002/v1", auth: {secretRef: {name: keys, key: other}}}'
P_W='  - {name: primary, baseUrl: "http://127.0.0.1:18000/v1", weight: 150, auth: {secretRef: {name: keys, key: primary}}}'
OK_T='{firstByte: 8s, total: 60s}'

# The control: the same minimal route, valid, must be accepted.
out="$(route valid "$OK_T" "$P_A
$P_B" | k apply -f - 2>&1)" || fail "the valid minimal route was rejected:
$out"
echo "  accepted the valid minimal route" >&2

expect_rejected() { # expect_rejected NAME MESSAGE  (manifest on stdin)
  local name=$1 want=$2 out
  if out="$(k apply -f - 2>&1)"; then
    fail "$name was accepted, expected rejection with \"$want\":
$out"
  fi
  grep -qF -- "$want" <<<"$out" || fail "$name rejected without \"$want\":
$out"
  echo "  rejected $name: $out" >&2
}
route first-byte-over-total '{firstByte: 90s, total: 60s}' "$P_A" \
  | expect_rejected first-byte-over-total "firstByte must not exceed total"
route duplicate-providers "$OK_T" "$P_A
$P_A2" | expect_rejected duplicate-providers "provider names must be unique"
route weight-150 "$OK_T" "$P_W" | expect_rejected weight-150 "weight must be between 0 and 100"

# ------------------------------------------------------------------ workload
phase workload
k apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: $NS}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
      - {name: web, image: registry.invalid/web:1}
EOF
deadline=$(( SECONDS + WAIT ))
until [[ "$(k -n "$NS" get pods -l app=web -o jsonpath='{.items[*].status.phase}')" == Running ]]; do
  (( SECONDS < deadline )) || fail "the Deployment's pod did not become Running within ${WAIT}s"
  sleep 0.2
done
k -n "$NS" rollout status deployment/web --timeout="${WAIT}s" >&2 || fail "rollout not complete"
k -n "$NS" get pods -l app=web -o wide >&2
node="$(k -n "$NS" get pods -l app=web -o jsonpath='{.items[0].spec.nodeName}')"
[[ "$node" == "$KWOK_NODE" ]] || fail "pod scheduled on '$node', expected $KWOK_NODE"
# A service-account token was mounted: KCM's token controller and root CA work.
k -n "$NS" get pod -l app=web -o jsonpath='{.items[0].spec.volumes[*].projected.sources[*].serviceAccountToken.path}' \
  | grep -q token || fail "no projected service-account token in the pod"

phase ""
