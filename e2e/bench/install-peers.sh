#!/usr/bin/env bash
# Installs the peer gateways that `make bench` compares tailwarden-sidecar with, pinned, into
# a git-ignored cache folder keyed by version (a second run reuses it):
#
#   nginx     Debian bookworm package `nginx` (what `nginx-light` depends on), downloaded with
#             `apt-get download` and unpacked — not installed system-wide, so no service starts
#   LiteLLM   `litellm[proxy]==1.106.12` from PyPI in a virtualenv (newer ones fail to install)
#   Portkey   `@portkey-ai/gateway@1.15.2` from npm, plus the fetch-wrapper preload that makes
#             its streaming work on Node 20 (Portkey issues #1389 / #1550)
#
# Each peer is independent: one that cannot be installed is recorded as failed (with the
# reason) and the others still install. The benchmark reads the result from
# CACHE/peers/manifest.tsv: `name<TAB>version<TAB>ok|failed<TAB>path-or-reason`.
#
# Usage: e2e/bench/install-peers.sh [CACHE_DIR]   (default: .cache)
set -uo pipefail

NGINX_VERSION="1.22.1-9+deb12u11"
LITELLM_VERSION="1.106.12"
PORTKEY_VERSION="1.15.2"

CACHE="$(mkdir -p "${1:-.cache}" && cd "${1:-.cache}" && pwd)"
PEERS="$CACHE/peers"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$PEERS"
MANIFEST="$PEERS/manifest.tsv"
: > "$MANIFEST.new"

record() { # name version ok|failed path-or-reason
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$MANIFEST.new"
  if [ "$3" = ok ]; then echo "install-peers: $1 $2 ready: $4"; else echo "install-peers: $1 $2 NOT installed: $4" >&2; fi
}

last_line() { tail -n 3 "$1" 2>/dev/null | tr '\n\t' '  ' | cut -c1-300; }

# --- nginx -------------------------------------------------------------------------------
install_nginx() {
  local dir="$PEERS/nginx-$NGINX_VERSION" log="$PEERS/nginx-install.log" bin
  bin="$dir/root/usr/sbin/nginx"
  if [ -x "$bin" ]; then record nginx "$NGINX_VERSION" ok "$bin"; return; fi
  if ! command -v apt-get >/dev/null; then record nginx "$NGINX_VERSION" failed "apt-get not available"; return; fi
  mkdir -p "$dir" && rm -f "$dir"/*.deb
  {
    # The package lists are needed once on a fresh machine.
    if [ -z "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v -e lock -e partial)" ] || ! apt-cache show "nginx=$NGINX_VERSION" >/dev/null 2>&1; then
      apt-get update -qq
    fi
    local version="$NGINX_VERSION"
    if ! apt-cache show "nginx=$version" >/dev/null 2>&1; then
      # Debian replaces point-release versions; take the current bookworm one and say so.
      version="$(apt-cache policy nginx | awk '/Candidate:/ {print $2}')"
      echo "pinned nginx $NGINX_VERSION is no longer in the archive; using $version"
    fi
    (cd "$dir" && apt-get download "nginx=$version") &&
      dpkg-deb -x "$dir"/nginx_*.deb "$dir/root" &&
      echo "$version" > "$dir/VERSION"
  } > "$log" 2>&1
  if [ ! -x "$bin" ]; then record nginx "$NGINX_VERSION" failed "download failed: $(last_line "$log") (log: $log)"; return; fi
  # Its shared libraries are in every Debian base image; install any that are missing.
  if ldd "$bin" | grep -q "not found"; then
    apt-get install -y -qq --no-install-recommends libpcre2-8-0 libssl3 zlib1g libcrypt1 >> "$log" 2>&1
  fi
  if ! "$bin" -v >> "$log" 2>&1; then record nginx "$NGINX_VERSION" failed "binary does not run: $(last_line "$log")"; return; fi
  record nginx "$(cat "$dir/VERSION")" ok "$bin"
}

# --- LiteLLM -----------------------------------------------------------------------------
install_litellm() {
  local dir="$PEERS/litellm-$LITELLM_VERSION" log="$PEERS/litellm-install.log" bin
  bin="$dir/venv/bin/litellm"
  if [ -x "$bin" ] && [ -f "$dir/.complete" ]; then record litellm "$LITELLM_VERSION" ok "$bin"; return; fi
  local py
  py="$(command -v python3 || true)"
  if [ -z "$py" ]; then record litellm "$LITELLM_VERSION" failed "python3 not found"; return; fi
  rm -rf "$dir" && mkdir -p "$dir"
  {
    "$py" -m venv "$dir/venv" &&
      "$dir/venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip &&
      "$dir/venv/bin/pip" install --quiet --disable-pip-version-check "litellm[proxy]==$LITELLM_VERSION"
  } > "$log" 2>&1
  if [ ! -x "$bin" ]; then record litellm "$LITELLM_VERSION" failed "pip install failed: $(last_line "$log") (log: $log)"; return; fi
  touch "$dir/.complete"
  record litellm "$LITELLM_VERSION" ok "$bin"
}

# --- Portkey -----------------------------------------------------------------------------
install_portkey() {
  local dir="$PEERS/portkey-$PORTKEY_VERSION" log="$PEERS/portkey-install.log" entry
  entry="$dir/node_modules/@portkey-ai/gateway/build/start-server.js"
  if [ -f "$entry" ] && [ -f "$dir/.complete" ]; then
    cp "$HERE/portkey-fetch-wrapper.cjs" "$dir/"
    record portkey "$PORTKEY_VERSION" ok "$entry"; return
  fi
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then record portkey "$PORTKEY_VERSION" failed "node/npm not found"; return; fi
  rm -rf "$dir" && mkdir -p "$dir"
  (cd "$dir" && echo '{"name":"tailwarden-bench-portkey","private":true}' > package.json &&
    npm install --no-audit --no-fund --loglevel=error "@portkey-ai/gateway@$PORTKEY_VERSION") > "$log" 2>&1
  if [ ! -f "$entry" ]; then record portkey "$PORTKEY_VERSION" failed "npm install failed: $(last_line "$log") (log: $log)"; return; fi
  cp "$HERE/portkey-fetch-wrapper.cjs" "$dir/"
  touch "$dir/.complete"
  record portkey "$PORTKEY_VERSION" ok "$entry"
}

only="${PEERS_ONLY:-nginx litellm portkey}"
for p in $only; do "install_$p"; done
mv "$MANIFEST.new" "$MANIFEST"
