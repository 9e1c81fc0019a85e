#!/usr/bin/env bash
# Which MutatingWebhookConfiguration clientConfig can the real kube-apiserver of
# up.sh reach, with no kube-proxy and no pod network? Runs a tiny HTTPS webhook
# (webhook.py, cert signed by the cluster CA) as a host process and tries, with
# --enable-aggregator-routing off and on:
#   url          clientConfig.url: https://127.0.0.1:PORT/...
#   svc-loopback Service (no selector) + Endpoints/EndpointSlice at 127.0.0.1
#   svc-hostip   Service (no selector) + Endpoints at the host's non-loopback IP
#   svc-extname  Service type ExternalName, externalName: localhost
# A variant works when a ConfigMap it selects comes back carrying the webhook's
# annotation. Prints a table; results are recorded in ../README.md.
#
#   e2e/controlplane/probe/webhook-probe.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CP_DIR="$(cd "$HERE/.." && pwd)"
BIN="$("$CP_DIR/build.sh")"
export CONTROLPLANE_BIN="$BIN"
HOSTIP="$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9.]+$' | grep -v '^127\.' | head -1 || true)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tailwarden-webhook-probe.XXXXXX")"
WEBHOOK_PID=""
CURRENT=""
cleanup() {
  [[ -n "$WEBHOOK_PID" ]] && kill "$WEBHOOK_PID" 2>/dev/null
  [[ -n "$CURRENT" ]] && "$CP_DIR/down.sh" "$CURRENT"
  rm -rf "$WORK"
}
trap cleanup EXIT
RESULTS=()
record() { RESULTS+=("$(printf '%-8s %-13s %-8s %s' "$1" "$2" "$3" "$4")"); }
NS=webhook-probe

try_variant() { # try_VARIANT ROUTING NAME CLIENTCONFIG-YAML
  local routing=$1 name=$2 cc=$3 out via
  kubectl apply -f - >/dev/null <<EOF
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: probe-$name}
webhooks:
- name: $name.probe.tailwarden.io
  admissionReviewVersions: ["v1"]
  sideEffects: None
  failurePolicy: Fail
  timeoutSeconds: 5
  objectSelector: {matchLabels: {probe: $name}}
  rules:
  - {apiGroups: [""], apiVersions: ["v1"], operations: ["CREATE"], resources: ["configmaps"]}
  clientConfig:
$cc
EOF
  sleep 1 # webhook configuration informer
  if out="$(kubectl -n $NS create -f - 2>&1 <<EOF
apiVersion: v1
kind: ConfigMap
metadata: {generateName: "$name-", labels: {probe: $name}}
EOF
)"; then
    via="$(kubectl -n $NS get configmap -l probe="$name" -o jsonpath='{.items[0].metadata.annotations.probe\.tailwarden\.io/via}')"
    if [[ "$via" == "$name" ]]; then record "$routing" "$name" WORKS "mutated by the host webhook"
    else record "$routing" "$name" "no" "created but not mutated (annotation '$via')"; fi
  else
    record "$routing" "$name" "no" "$(echo "$out" | oneline | sed 's/.*failed to call webhook: //')"
  fi
  kubectl delete mutatingwebhookconfiguration "probe-$name" >/dev/null
}

# A ClusterIP Service with no selector: its Endpoints are ours to write (with a
# selector, the endpoints controller would overwrite them).
selectorless_service() {
  kubectl -n $NS apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Service
metadata: {name: $1}
spec:
  ports: [{port: 443, targetPort: $PORT, protocol: TCP}]
EOF
}
oneline() { tr '\n' ' ' | sed -E 's/Warning: v1 Endpoints is deprecated in v1.33\+; use discovery.k8s.io\/v1 EndpointSlice //'; }

for routing in 0 1; do
  CURRENT="$WORK/cp-$routing"
  CONTROLPLANE_AGGREGATOR_ROUTING=$routing "$CP_DIR/up.sh" --owner-pid $$ "$CURRENT"
  set -a; . "$CURRENT/env"; set +a

  # Webhook serving cert from the cluster CA, for every name the apiserver may use.
  pki="$CURRENT/probe-pki"; mkdir -p "$pki"
  san="IP:127.0.0.1,DNS:localhost,DNS:svc-loopback.$NS.svc,DNS:svc-hostip.$NS.svc,DNS:svc-extname.$NS.svc"
  [[ -n "$HOSTIP" ]] && san+=",IP:$HOSTIP"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$pki/tls.key" \
    -out "$pki/tls.csr" -subj "/CN=probe" 2>/dev/null
  printf 'extendedKeyUsage=serverAuth\nsubjectAltName=%s\n' "$san" > "$pki/ext"
  openssl x509 -req -in "$pki/tls.csr" -CA "$CA_CERT" -CAkey "$CA_KEY" -CAcreateserial -days 1 \
    -extfile "$pki/ext" -out "$pki/tls.crt" 2>/dev/null
  PORT=$(( 20000 + RANDOM % 10000 ))
  python3 "$HERE/webhook.py" 0.0.0.0 "$PORT" "$pki/tls.crt" "$pki/tls.key" > "$CURRENT/logs/webhook.log" 2>&1 &
  WEBHOOK_PID=$!
  for _ in $(seq 1 50); do grep -q listening "$CURRENT/logs/webhook.log" && break; sleep 0.1; done
  CA_B64="$(base64 -w0 < "$CA_CERT")"

  kubectl create namespace $NS >/dev/null
  try_variant "$routing" url "    url: https://127.0.0.1:$PORT/mutate/url
    caBundle: $CA_B64"

  # Service without selector + Endpoints at 127.0.0.1 (the API server validates these)
  selectorless_service svc-loopback
  if out="$(kubectl -n $NS apply -f - 2>&1 <<EOF
apiVersion: v1
kind: Endpoints
metadata: {name: svc-loopback}
subsets: [{addresses: [{ip: 127.0.0.1}], ports: [{port: $PORT, protocol: TCP}]}]
EOF
)"; then echo "Endpoints 127.0.0.1 accepted" >&2
  else record "$routing" "(Endpoints)" "-" "127.0.0.1 rejected: $(echo "$out" | oneline)"; fi
  if out="$(kubectl -n $NS apply -f - 2>&1 <<EOF
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc-loopback-1, labels: {kubernetes.io/service-name: svc-loopback}}
addressType: IPv4
endpoints: [{addresses: [127.0.0.1]}]
ports: [{port: $PORT, protocol: TCP}]
EOF
)"; then echo "EndpointSlice 127.0.0.1 accepted" >&2
  else record "$routing" "(EndpointSlice)" "-" "127.0.0.1 rejected: $(echo "$out" | oneline)"; fi
  try_variant "$routing" svc-loopback "    service: {namespace: $NS, name: svc-loopback, path: /mutate/svc-loopback, port: 443}
    caBundle: $CA_B64"

  if [[ -n "$HOSTIP" ]]; then
    selectorless_service svc-hostip
    kubectl -n $NS apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Endpoints
metadata: {name: svc-hostip}
subsets: [{addresses: [{ip: $HOSTIP}], ports: [{port: $PORT, protocol: TCP}]}]
EOF
    try_variant "$routing" svc-hostip "    service: {namespace: $NS, name: svc-hostip, path: /mutate/svc-hostip, port: 443}
    caBundle: $CA_B64"
  fi

  kubectl -n $NS create service externalname svc-extname --external-name=localhost >/dev/null
  try_variant "$routing" svc-extname "    service: {namespace: $NS, name: svc-extname, path: /mutate/svc-extname, port: $PORT}
    caBundle: $CA_B64"

  echo "--- webhook log (routing=$routing)" >&2; cat "$CURRENT/logs/webhook.log" >&2
  kill "$WEBHOOK_PID"; WEBHOOK_PID=""
  "$CP_DIR/down.sh" "$CURRENT"; CURRENT=""
done

echo
printf '%-8s %-13s %-8s %s\n' routing variant result detail
printf '%s\n' "${RESULTS[@]}"
