#!/usr/bin/env bash
# Build the local Kubernetes control plane binaries from the Go module proxy,
# once per pinned version:
#
#   .cache/controlplane/<k8s-version>/bin/
#       kube-apiserver kube-controller-manager kube-scheduler   (k8s.io/kubernetes, go.mod)
#       etcd                                                     (./etcd, embedded etcd)
#       kubelet kube-proxy kubectl                               (k8s.io/kubernetes, go.mod)
#       kwok                                                     (kwok/go.mod)
#       helm                                                     (helm/go.mod)
#
# Each group is rebuilt only when a binary is missing or its stamp file
# (bin/.<group>.stamp, a hash of the module's go.mod/go.sum/sources) differs, so
# a second run costs nothing. The two groups of the main module (kube, node) are
# built by one `go build` when both are stale: it compiles their shared
# packages once and links the seven binaries in parallel with the compiles. GOCACHE/GOMODCACHE are the user's normal Go
# caches. go.sum is committed and complete; -mod=readonly means a fresh clone
# needs nothing but the module proxy, and a drifted go.mod fails loudly.
#
# Usage: e2e/controlplane/build.sh            # prints the bin directory last
#        CONTROLPLANE_CACHE=DIR build.sh      # another cache root
# Concurrent callers are serialised with flock; the loser reuses the result.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
else echo "build.sh: no Go toolchain (need go >= 1.24 on PATH or /usr/local/go/bin/go)" >&2; exit 1
fi

modver() { # modver FILE MODULE -> version required in FILE
  awk -v m="$2" '$1==m && $2 ~ /^v/ {print $2; exit}' "$1"
}
K8S_VERSION="$(modver "$HERE/go.mod" k8s.io/kubernetes)"
KWOK_VERSION="$(modver "$HERE/kwok/go.mod" sigs.k8s.io/kwok)"
HELM_VERSION="$(modver "$HERE/helm/go.mod" helm.sh/helm/v3)"
[[ -n "$K8S_VERSION" && -n "$KWOK_VERSION" && -n "$HELM_VERSION" ]] || {
  echo "build.sh: cannot read pinned versions from go.mod files" >&2; exit 1; }
K8S_MINOR="$(echo "$K8S_VERSION" | cut -d. -f2)"

CACHE_ROOT="${CONTROLPLANE_CACHE:-$REPO/.cache/controlplane}"
BIN="$CACHE_ROOT/$K8S_VERSION/bin"
mkdir -p "$BIN"

export CGO_ENABLED=0
export GOFLAGS="-mod=readonly -buildvcs=false -trimpath"

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
stamp_of() { # stamp_of DIR EXTRA... -> hash of the module's inputs in DIR (not its submodules)
  local dir=$1; shift
  (cd "$dir" && find . -maxdepth 2 \( -name go.mod -o -name go.sum -o -name '*.go' \) \
      -not -path './kwok/*' -not -path './helm/*' | LC_ALL=C sort | xargs sha256sum
   "$GO" env GOVERSION GOOS GOARCH; echo "$GOFLAGS $*") | sha256sum | cut -d' ' -f1
}
up_to_date() { # up_to_date GROUP STAMP BIN...
  local group=$1 stamp=$2; shift 2
  [[ -f "$BIN/.$group.stamp" && "$(cat "$BIN/.$group.stamp")" == "$stamp" ]] || return 1
  local b; for b in "$@"; do [[ -x "$BIN/$b" ]] || return 1; done
}
# build_groups MODDIR LDFLAGS GROUP... — each GROUP is "name|binaries|packages"; the stale
# ones are built by a single `go build` (their packages and links share one scheduler).
build_groups() {
  local dir=$1 ldflags=$2; shift 2
  local spec group bins pkgs stamp stale=() all_bins="" all_pkgs="" names=""
  declare -gA STAMPS=()
  for spec in "$@"; do
    IFS='|' read -r group bins pkgs <<<"$spec"
    # shellcheck disable=SC2086
    stamp="$(stamp_of "$dir" "$ldflags" $pkgs)"
    # shellcheck disable=SC2086
    if up_to_date "$group" "$stamp" $bins; then
      echo "build.sh: $group up to date ($bins)" >&2; continue
    fi
    STAMPS[$group]=$stamp; stale+=("$group"); names+=" $group"
    all_bins+=" $bins"; all_pkgs+=" $pkgs"
  done
  [[ ${#stale[@]} -gt 0 ]] || return 0
  local t0 tmp; t0="$(now)"; tmp="$(mktemp -d "$BIN/.tmp-${stale[0]}.XXXXXX")"
  echo "build.sh: building$names ($all_bins ) with $("$GO" env GOVERSION), GOCACHE=$("$GO" env GOCACHE)" >&2
  (cd "$dir" && "$GO" mod download) >&2
  echo "build.sh:$names modules ready after $(elapsed "$t0")s" >&2
  # shellcheck disable=SC2086
  (cd "$dir" && "$GO" build -ldflags "$ldflags" -o "$tmp/" $all_pkgs) >&2
  local b; for b in $all_bins; do mv -f "$tmp/$b" "$BIN/$b"; done
  rmdir "$tmp"
  for group in "${stale[@]}"; do echo "${STAMPS[$group]}" > "$BIN/.$group.stamp"; done
  echo "build.sh: built$names in $(elapsed "$t0")s" >&2
}
build_group() { # build_group GROUP MODDIR LDFLAGS "BINS" PKG...
  local group=$1 dir=$2 ldflags=$3 bins=$4; shift 4
  build_groups "$dir" "$ldflags" "$group|$bins|$*"
}

exec 9>"$CACHE_ROOT/$K8S_VERSION/.build.lock"
flock 9

T0="$(now)"
BUILD_DATE="1970-01-01T00:00:00Z" # reproducible; the version is what matters
KV=k8s.io/component-base/version
CV=k8s.io/client-go/pkg/version
K8S_LDFLAGS="-s -w"
for pkg in $KV $CV; do
  K8S_LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$K8S_MINOR"
  K8S_LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$BUILD_DATE"
done
K=k8s.io/kubernetes/cmd
build_groups "$HERE" "$K8S_LDFLAGS" \
  "kube|kube-apiserver kube-controller-manager kube-scheduler etcd|$K/kube-apiserver $K/kube-controller-manager $K/kube-scheduler ./etcd" \
  "node|kubelet kube-proxy kubectl|$K/kubelet $K/kube-proxy $K/kubectl"

build_group kwok "$HERE/kwok" \
  "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$K8S_VERSION" \
  kwok sigs.k8s.io/kwok/cmd/kwok

HV=helm.sh/helm/v3
# Like helm's own Makefile: the default KubeVersion is that of its client-go.
HELM_K8S_MINOR="$(modver "$HERE/helm/go.mod" k8s.io/client-go | cut -d. -f2)"
build_group helm "$HERE/helm" \
  "-s -w -X $HV/internal/version.version=$HELM_VERSION -X $HV/internal/version.gitTreeState=clean \
   -X $HV/pkg/lint/rules.k8sVersionMajor=1 -X $HV/pkg/lint/rules.k8sVersionMinor=$HELM_K8S_MINOR \
   -X $HV/pkg/chartutil.k8sVersionMajor=1 -X $HV/pkg/chartutil.k8sVersionMinor=$HELM_K8S_MINOR" \
  helm helm.sh/helm/v3/cmd/helm

touch "$CACHE_ROOT/$K8S_VERSION/.built"
echo "build.sh: control plane $K8S_VERSION (kwok $KWOK_VERSION, helm $HELM_VERSION) ready in $(elapsed "$T0")s" >&2
echo "$BIN"
