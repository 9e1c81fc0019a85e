#!/usr/bin/env bash
# Runs the real OpenAI Python and Node SDKs against tailwarden-sidecar, with tailwarden-sim as
# the provider, over loopback. Also checks that the provider key (a canary) never appears in
# any output. Usage: e2e/sdk/run.sh TARGET_DIR (where tailwarden-sim and -sidecar are built).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${1:-$root/target/debug}
cache=$root/.cache
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

wait_line() { # file pattern
  for _ in $(seq 1 200); do
    if grep -q "$2" "$1" 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "timed out waiting for '$2' in $1:" >&2; cat "$1" >&2; return 1
}

"$bin/tailwarden-sim" --listen 127.0.0.1:0 --profile instant >"$work/sim.out" 2>"$work/sim.err" &
pids+=($!)
wait_line "$work/sim.out" "listening on"
sim=$(grep -o 'listening on [0-9.:]*' "$work/sim.out" | awk '{print $3}')

canary="sk-canary-$(date +%s%N)"
cat >"$work/routes.yaml" <<YAML
apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: chat, namespace: sdk}
spec:
  models: [sdk-chat]
  providers:
  - {name: sim, baseUrl: "http://$sim/v1", auth: {env: TAILWARDEN_SDK_CANARY_KEY}}
---
apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: errors, namespace: sdk}
spec:
  models: [sdk-errors]
  providers:
  - {name: sim, baseUrl: "http://$sim/v1", auth: {env: TAILWARDEN_SDK_CANARY_KEY}}
  retries: {maxAttempts: 1}
  circuitBreaker: {enabled: false}
---
apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: fallback, namespace: sdk}
spec:
  models: [sdk-fallback]
  providers:
  - {name: sim, baseUrl: "http://$sim/v1", auth: {env: TAILWARDEN_SDK_CANARY_KEY}}
  retries: {maxAttempts: 2}
  circuitBreaker: {enabled: false}
  streaming:
    fallback: {afterFailures: 1, probeAfter: 1h}
YAML

TAILWARDEN_SDK_CANARY_KEY=$canary TAILWARDEN_LOG=debug "$bin/tailwarden-sidecar" \
  --config "$work/routes.yaml" --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
  >"$work/sidecar.out" 2>"$work/sidecar.err" &
pids+=($!)
wait_line "$work/sidecar.out" "listening on"
addr=$(grep -o 'listening on [0-9.:]*' "$work/sidecar.out" | awk '{print $3}')
export OPENAI_BASE_URL="http://$addr/v1" OPENAI_API_KEY="client-side-key-not-forwarded"

status=0
echo "== OpenAI Python SDK"
"$cache/venv/bin/python" -m pytest -q -p no:cacheprovider "$root/e2e/sdk/test_python_sdk.py" || status=1
echo "== OpenAI Node SDK"
(cd "$root/e2e/sdk" && node --test node_sdk.test.mjs) || status=1

# The provider saw the configured key; nobody printed it.
curl -fsS "http://$sim/sim/stats" >"$work/stats.json"
grep -q "Bearer $canary" "$work/stats.json" || { echo "FAIL: provider did not receive the configured key" >&2; status=1; }
if grep -q "$canary" "$work/sidecar.out" "$work/sidecar.err"; then
  echo "FAIL: the API key appeared in the sidecar's output" >&2; status=1
else
  echo "ok: canary key absent from $(wc -l <"$work/sidecar.err") lines of sidecar logs"
fi
if grep -q "client-side-key-not-forwarded" "$work/stats.json"; then
  echo "FAIL: the client's own key was forwarded to the provider" >&2; status=1
fi
exit $status
