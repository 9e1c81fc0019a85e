#!/usr/bin/env bash
# Build Jaeger v2 (github.com/jaegertracing/jaeger/cmd/jaeger, pinned in go.mod beside this
# file) from the Go module proxy, once:
#
#   .cache/jaeger/<version>/bin/jaeger
#
# Rebuilt only when the binary is missing or its stamp (a hash of go.mod, go.sum, the Go
# version and the flags) differs. Only the one binary is built: CGO off, -trimpath, symbols
# stripped. GOCACHE/GOMODCACHE are the user's normal Go caches; go.sum is committed and
# complete, so -mod=readonly needs nothing but the module proxy.
#
# Usage: e2e/jaeger/build.sh          # prints the binary's path last
#        JAEGER_CACHE=DIR build.sh    # another cache root
# Concurrent callers are serialised with flock; the loser reuses the result.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
else echo "jaeger/build.sh: no Go toolchain (need go >= 1.24 on PATH or /usr/local/go/bin/go)" >&2; exit 1
fi

MODULE=github.com/jaegertracing/jaeger
VERSION="$(awk -v m="$MODULE" '$1==m && $2 ~ /^v/ {print $2; exit}' "$HERE/go.mod")"
[[ -n "$VERSION" ]] || { echo "jaeger/build.sh: cannot read the pinned $MODULE version from go.mod" >&2; exit 1; }

CACHE_ROOT="${JAEGER_CACHE:-$REPO/.cache/jaeger}"
BIN="$CACHE_ROOT/$VERSION/bin"
mkdir -p "$BIN"

export CGO_ENABLED=0
export GOFLAGS="-mod=readonly -buildvcs=false -trimpath"
LDFLAGS="-s -w -X $MODULE/internal/version.latestVersion=$VERSION"

STAMP="$( (cd "$HERE" && sha256sum go.mod go.sum; "$GO" env GOVERSION GOOS GOARCH; echo "$GOFLAGS $LDFLAGS") \
  | sha256sum | cut -d' ' -f1)"

exec 9>"$CACHE_ROOT/$VERSION/.build.lock"
flock 9

if [[ -x "$BIN/jaeger" && -f "$BIN/.stamp" && "$(cat "$BIN/.stamp")" == "$STAMP" ]]; then
  echo "jaeger/build.sh: jaeger $VERSION up to date" >&2
else
  t0="$(date +%s)"
  echo "jaeger/build.sh: building jaeger $VERSION with $("$GO" env GOVERSION), GOCACHE=$("$GO" env GOCACHE)" >&2
  (cd "$HERE" && "$GO" mod download) >&2
  echo "jaeger/build.sh: modules ready after $(( $(date +%s) - t0 ))s" >&2
  tmp="$(mktemp -d "$BIN/.tmp.XXXXXX")"
  (cd "$HERE" && "$GO" build -ldflags "$LDFLAGS" -o "$tmp/jaeger" "$MODULE/cmd/jaeger") >&2
  mv -f "$tmp/jaeger" "$BIN/jaeger"
  rmdir "$tmp"
  echo "$STAMP" > "$BIN/.stamp"
  echo "jaeger/build.sh: built jaeger $VERSION in $(( $(date +%s) - t0 ))s" >&2
fi
echo "$BIN/jaeger"
