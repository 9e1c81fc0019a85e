#!/usr/bin/env bash
# Build tailwarden's container images with buildah: no Docker daemon, no registry, nothing
# pulled. Each image is `FROM scratch` plus a minimal root assembled from Debian packages
# (the way distroless is made: only the shared libraries the binaries need, CA
# certificates, a `nonroot` user 65532, no shell) and is written as an OCI archive with
# its digest:
#
#   .cache/images/<name>.tar      OCI archive (import: ctr images import / skopeo copy)
#   .cache/images/<name>.ref      the image reference, e.g. ghcr.io/tailwarden/sidecar:0.1.0
#   .cache/images/<name>.digest   the manifest digest, sha256:…
#   .cache/images/images.txt      one line per image: name, reference, digest, sizes
#
# Usage: images/build.sh [IMAGE...]       default: operator sidecar (what `make images` builds)
#   operator, sidecar   the product (Containerfiles in images/), release binaries
#   pause, openai-app   for the e2e node only (e2e/images/): the pod sandbox image, built from
#                       the C source in the kubernetes Go module, and an app container whose
#                       client is the real OpenAI Python SDK
#
# Environment:
#   IMAGE_REGISTRY   registry part of the product images (default ghcr.io)
#   IMAGES_OUT       output directory (default .cache/images)
#   RELEASE_DIR      where the release binaries are (default: cargo build --release into
#                    target/release, or $CARGO_TARGET_DIR/release)
#
# An image is rebuilt only when its inputs (binary, Containerfile, packages, labels) changed:
# `images/build.sh` on an up-to-date tree takes about a second after cargo's own check.
# Needs root (apt-get download, buildah's storage); buildah and binutils are installed by
# `make system-deps`.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
OUT="${IMAGES_OUT:-$REPO/.cache/images}"
REGISTRY="${IMAGE_REGISTRY:-ghcr.io}"
DEBS="$OUT/debs"
mkdir -p "$OUT" "$DEBS"

log() { echo "images: $*" >&2; }
die() { log "$*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
for tool in buildah readelf dpkg-deb apt-get; do
  command -v "$tool" >/dev/null || die "$tool not found (make system-deps installs it)"
done

# The version the chart's images are tagged with: its appVersion, which must be the
# workspace's version (the binaries report it with --version).
APP_VERSION="$(awk -F'"' '/^appVersion:/ {print $2}' "$REPO/charts/tailwarden/Chart.yaml")"
CRATE_VERSION="$(awk -F'"' '/^version = / {print $2; exit}' "$REPO/Cargo.toml")"
[[ -n "$APP_VERSION" && "$APP_VERSION" == "$CRATE_VERSION" ]] ||
  die "chart appVersion ($APP_VERSION) and workspace version ($CRATE_VERSION) differ"
REVISION="$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
SOURCE="https://github.com/tailwarden/tailwarden"

IMAGES=("$@")
[[ ${#IMAGES[@]} -gt 0 ]] || IMAGES=(operator sidecar)

exec 9>"$OUT/.build.lock"
flock 9

# ---------------------------------------------------------------- Debian packages
# deb PKG: path of PKG's .deb in $DEBS, downloaded once. The version is the installed one
# where PKG is installed and still served (the binaries were linked against it), else apt's
# candidate (newer: Debian's stable updates keep the ABI).
APT_UPDATED=0
candidate() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}'; }
# apt-get download writes an epoch's colon as %3a.
cached_deb() { ls "$DEBS/${1}_${2/:/%3a}_"*.deb "$DEBS/${1}_${2#*:}_"*.deb 2>/dev/null | head -n 1 || true; }
deb() {
  local pkg=$1 ver f cand
  ver="$(dpkg-query -W -f='${db:Status-Abbrev} ${Version}' "$pkg" 2>/dev/null | awk '$1=="ii" {print $2}')"
  if [[ -n "$ver" ]]; then
    f="$(cached_deb "$pkg" "$ver")"
    [[ -n "$f" ]] || (cd "$DEBS" && apt-get download -qq "$pkg=$ver" >/dev/null 2>&1) || true
    f="$(cached_deb "$pkg" "$ver")"
    [[ -z "$f" ]] || { echo "$f"; return; }
  fi
  cand="$(candidate "$pkg")"
  if [[ -z "$cand" || "$cand" == "(none)" ]] && [[ $APT_UPDATED == 0 ]]; then
    apt-get update -qq >&2; APT_UPDATED=1; cand="$(candidate "$pkg")"
  fi
  [[ -n "$cand" && "$cand" != "(none)" ]] || die "no Debian package $pkg"
  f="$(cached_deb "$pkg" "$cand")"
  if [[ -z "$f" ]]; then
    (cd "$DEBS" && apt-get download -qq "$pkg=$cand" 2>&1 | grep -v 'unsandboxed' >&2 || true)
    f="$(cached_deb "$pkg" "$cand")"
    [[ -n "$f" ]] || die "apt-get download $pkg=$cand failed"
  fi
  echo "$f"
}

# stage_debs STAGE PKG...: unpack the packages into STAGE (no maintainer scripts run) and
# record, like distroless, one dpkg status stanza per package in STAGE/.status.d/ so image
# scanners can tell what is inside.
stage_debs() {
  local stage=$1 pkg f; shift
  mkdir -p "$stage/.status.d"
  for pkg in "$@"; do
    f="$(deb "$pkg")"
    dpkg-deb -x "$f" "$stage"
    { dpkg-deb -f "$f" Package Version Architecture Source Maintainer Homepage; echo "Status: install ok installed"; } \
      > "$stage/.status.d/$pkg"
    echo "$pkg=$(dpkg-deb -f "$f" Version)" >> "$stage/.packages"
  done
}

# ---------------------------------------------------------------- minimal root
# The base every image shares: /etc/passwd and /etc/group with root and nonroot (65532), an
# nsswitch.conf (glibc's files and dns lookups are built into libc.so.6 since 2.34), the
# Mozilla CA bundle from Debian's ca-certificates, an empty /tmp.
base_root() {
  local root=$1 stage=$2
  mkdir -p "$root/etc/ssl/certs" "$root/tmp" "$root/home/nonroot" "$root/var/lib/dpkg/status.d" \
    "$root/usr/share/doc"
  chmod 1777 "$root/tmp"
  chown 65532:65532 "$root/home/nonroot"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$root/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' > "$root/etc/group"
  printf 'passwd: files\ngroup: files\nhosts: files dns\n' > "$root/etc/nsswitch.conf"
  # What update-ca-certificates would write: every certificate Debian ships, in name order.
  find "$stage/usr/share/ca-certificates/mozilla" -name '*.crt' | LC_ALL=C sort | xargs cat \
    > "$root/etc/ssl/certs/ca-certificates.crt"
  [[ -s "$root/etc/ssl/certs/ca-certificates.crt" ]] || die "empty CA bundle"
  local p
  for p in "$stage"/.status.d/*; do
    cp "$p" "$root/var/lib/dpkg/status.d/"
    p="$(basename "$p")"
    if [[ -f "$stage/usr/share/doc/$p/copyright" ]]; then
      mkdir -p "$root/usr/share/doc/$p"; cp "$stage/usr/share/doc/$p/copyright" "$root/usr/share/doc/$p/"
    fi
  done
}

# copy_from_stage ROOT STAGE PATH: copy PATH (absolute, inside STAGE) into ROOT, following
# a symlink chain and recreating each link.
copy_from_stage() {
  local root=$1 stage=$2 path=$3 target
  while :; do
    mkdir -p "$root$(dirname "$path")"
    if [[ -L "$stage$path" ]]; then
      target="$(readlink "$stage$path")"
      ln -sfn "$target" "$root$path"
      [[ "$target" == /* ]] || target="$(dirname "$path")/$target"
      path="$(realpath -m -s "$target")"
    else
      [[ -e "$root$path" ]] || cp -a "$stage$path" "$root$path"
      return
    fi
  done
}

# find_lib STAGE NAME: the library NAME in STAGE's library directories
find_lib() {
  local stage=$1 name=$2 d
  for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib; do
    if [[ -e "$stage$d/$name" ]]; then echo "$d/$name"; return 0; fi
  done
  return 1
}

# add_libs ROOT STAGE OPTIONAL_DIR: copy into ROOT, from STAGE, every shared library the
# ELF files in ROOT need (transitively) and their program interpreter. An ELF file under
# OPTIONAL_DIR (Python's extension modules) whose libraries are not staged is removed
# instead: it is a module the image does not ship; anywhere else that is an error.
add_libs() {
  local root=$1 stage=$2 optional=${3:-} f need lib interp missing info
  local -A seen=()
  local todo=1
  while [[ $todo == 1 ]]; do
    todo=0
    while IFS= read -r f; do
      [[ -z "${seen[$f]:-}" ]] || continue
      seen[$f]=1
      [[ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" == '177ELF' ]] || continue
      info="$(readelf -l -d "$f" 2>/dev/null || true)"
      interp="$(sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p' <<<"$info")"
      if [[ -n "$interp" && ! -e "$root$interp" ]]; then
        copy_from_stage "$root" "$stage" "$interp"; todo=1
      fi
      missing=""
      for need in $(sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' <<<"$info"); do
        [[ -n "$(find_lib "$root" "$need" || true)" ]] && continue
        if lib="$(find_lib "$stage" "$need")"; then
          copy_from_stage "$root" "$stage" "$lib"; todo=1
        else
          missing+=" $need"
        fi
      done
      if [[ -n "$missing" ]]; then
        if [[ -n "$optional" && "$f" == "$root$optional"/* ]]; then
          rm -f "$f"
        else
          die "$(basename "$f") needs${missing}, which no staged package provides"
        fi
      fi
    done < <(find "$root" -type f \( -perm -u+x -o -name '*.so*' \))
  done
}

# ---------------------------------------------------------------- build
# build NAME REF CONTAINERFILE CONTEXT: buildah build CONTAINERFILE in CONTEXT, tagged REF,
# into a throwaway store; writes NAME.tar / .digest / .ref. Reproducible: every file and
# the image config carry the epoch as their time, so the same inputs give the same digest.
build() {
  local name=$1 ref=$2 file=$3 ctx=$4 store t
  t="$(now)"
  store="$(mktemp -d "$OUT/.store-$name.XXXXXX")"
  local B=(buildah --storage-driver vfs --root "$store/root" --runroot "$store/run")
  "${B[@]}" build --quiet --timestamp 0 --format oci --layers=false --pull=never \
    --build-arg "VERSION=$APP_VERSION" --build-arg "REVISION=$REVISION" --build-arg "SOURCE=$SOURCE" \
    --build-arg "PACKAGES=$(tr '\n' ' ' < "$ctx/packages.txt" | sed 's/ $//')" \
    -f "$file" -t "$ref" "$ctx" >/dev/null
  rm -f "$OUT/$name.tar.tmp"
  "${B[@]}" push --quiet --digestfile "$OUT/$name.digest" "$ref" "oci-archive:$OUT/$name.tar.tmp:$ref"
  "${B[@]}" rmi --all >/dev/null 2>&1 || true
  rm -rf "$store"
  mv -f "$OUT/$name.tar.tmp" "$OUT/$name.tar"
  echo "$ref" > "$OUT/$name.ref"
  log "built $ref ($(du -k "$OUT/$name.tar" | cut -f1) KiB archive, $(cat "$OUT/$name.digest")) in $(since "$t")s"
}

# fresh NAME PKGS FILE...: whether NAME's archive was built from exactly these inputs (the
# files, the installed versions of the Debian packages, this script, the labels). Sets STAMP
# for `stamp NAME` after a build. Checked before anything is assembled, so an up-to-date
# image costs a few hashes.
fresh() {
  local name=$1 pkgs=$2; shift 2
  STAMP="$({ sha256sum "$@" "${BASH_SOURCE[0]}"
    # shellcheck disable=SC2086
    dpkg-query -W -f='${Package}=${Version}\n' $pkgs 2>/dev/null || true
    echo "$APP_VERSION $REVISION $REGISTRY"; } | sha256sum | cut -d' ' -f1)"
  [[ -f "$OUT/$name.tar" && -f "$OUT/$name.digest" && -f "$OUT/$name.stamp" &&
     "$(cat "$OUT/$name.stamp")" == "$STAMP" ]]
}
stamp() { echo "$STAMP" > "$OUT/$1.stamp"; }

# The release binaries, built once for both product images (one cargo invocation: they share
# most of their dependency graph), unless RELEASE_DIR points at binaries built elsewhere.
RELEASE="${RELEASE_DIR:-${CARGO_TARGET_DIR:-$REPO/target}/release}"
build_release() {
  [[ -z "${RELEASE_DIR:-}" ]] || return 0
  local t; t="$(now)"
  (cd "$REPO" && cargo build --release --locked -p tailwarden-operator -p tailwarden-sidecar) >&2
  log "release binaries ready in $(since "$t")s"
}
release_bin() { # release_bin NAME: path of a release binary of the workspace
  [[ -x "$RELEASE/$1" ]] || die "$RELEASE/$1 not built"
  echo "$RELEASE/$1"
}

# product IMAGE BINARY: operator or sidecar, from images/IMAGE/Containerfile
BASE_PKGS="libc6 libgcc-s1 gcc-12-base ca-certificates"
product() {
  local name=$1 bin=$2 ctx="$OUT/context/$1" stage="$OUT/stage/$1" ref binary
  ref="$REGISTRY/tailwarden/$name:$APP_VERSION"
  binary="$(release_bin "$bin")"
  if fresh "$name" "$BASE_PKGS" "$binary" "$HERE/$name/Containerfile"; then
    log "$ref up to date ($(cat "$OUT/$name.digest"))"; return
  fi
  rm -rf "$ctx" "$stage"; mkdir -p "$ctx/rootfs/usr/bin"
  # shellcheck disable=SC2086
  stage_debs "$stage" $BASE_PKGS
  base_root "$ctx/rootfs" "$stage"
  # No debug line tables or symbols: a panic message still names the file and line, and
  # the binary is a fraction of the size.
  strip --strip-all -o "$ctx/rootfs/usr/bin/$bin" "$binary"
  add_libs "$ctx/rootfs" "$stage"
  cp "$stage/.packages" "$ctx/packages.txt"
  build "$name" "$ref" "$HERE/$name/Containerfile" "$ctx"
  stamp "$name"
  rm -rf "$stage"
}

# pause: kubernetes' own pause.c from the Go module cache (the module build.sh pins), built
# static as its Makefile does.
pause() {
  local ctx="$OUT/context/pause" mod tag ref
  mod="$(cd "$REPO/e2e/controlplane" && GOFLAGS=-mod=readonly go list -m -f '{{.Dir}}' k8s.io/kubernetes 2>/dev/null || true)"
  [[ -f "$mod/build/pause/linux/pause.c" ]] ||
    die "k8s.io/kubernetes not in the Go module cache (e2e/controlplane/build.sh downloads it)"
  tag="$(awk '/^TAG \?=/ {print $3}' "$mod/build/pause/Makefile")"
  ref="localhost/tailwarden-e2e/pause:$tag"
  if fresh pause "" "$mod/build/pause/linux/pause.c" "$REPO/e2e/images/pause/Containerfile"; then
    log "$ref up to date"; return
  fi
  rm -rf "$ctx"; mkdir -p "$ctx/rootfs"
  gcc -Os -Wall -Werror -static -DVERSION="v$tag-tailwarden" -o "$ctx/rootfs/pause" "$mod/build/pause/linux/pause.c"
  strip "$ctx/rootfs/pause"
  echo "pause.c=$tag" > "$ctx/packages.txt"
  build pause "$ref" "$REPO/e2e/images/pause/Containerfile" "$ctx"
  stamp pause
}

# openai-app: Debian's python3.11 (interpreter, standard library, the libraries its modules
# link) plus the OpenAI SDK pinned in e2e/sdk/requirements.txt, installed as wheels.
APP_PKGS="libc6 libgcc-s1 gcc-12-base ca-certificates python3.11-minimal libpython3.11-minimal
  libpython3.11-stdlib libssl3 libffi8 zlib1g libexpat1 libbz2-1.0 liblzma5 libuuid1 libcrypt1
  media-types"
openai_app() {
  local ctx="$OUT/context/openai-app" stage="$OUT/stage/openai-app" root ver ref t app="$REPO/e2e/images/openai-app"
  t="$(now)"
  ver="$(awk -F'==' '$1=="openai" {print $2}' "$REPO/e2e/sdk/requirements.txt")"
  ref="localhost/tailwarden-e2e/openai-app:$ver"
  if fresh openai-app "$APP_PKGS" "$app/app.py" "$app/Containerfile" "$REPO/e2e/sdk/requirements.txt"; then
    log "$ref up to date"; return
  fi
  rm -rf "$ctx" "$stage"; mkdir -p "$ctx/rootfs"; root="$ctx/rootfs"
  # The wheels download while the packages unpack.
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-conflicts \
    --root-user-action=ignore --no-compile --target "$ctx/site-packages" \
    --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "openai==$ver" >&2 &
  local pip=$!
  # shellcheck disable=SC2086
  stage_debs "$stage" $APP_PKGS
  base_root "$root" "$stage"
  mkdir -p "$root/usr/bin" "$root/usr/lib" "$root/etc" "$root/app"
  cp -a "$stage/usr/bin/python3.11" "$root/usr/bin/"
  cp -a "$stage/usr/lib/python3.11" "$root/usr/lib/"
  [[ -f "$stage/etc/mime.types" ]] && cp "$stage/etc/mime.types" "$root/etc/"
  rm -rf "$root/usr/lib/python3.11/"{test,idlelib,tkinter,turtledemo,ensurepip,lib2to3,pydoc_data,config-3.11-x86_64-linux-gnu}
  find "$root" -name __pycache__ -prune -exec rm -rf {} +
  wait "$pip" || die "pip install openai==$ver failed"
  rm -rf "$ctx/site-packages/bin"
  mv "$ctx/site-packages" "$root/app/site-packages"
  cp "$app/app.py" "$root/app/app.py"
  add_libs "$root" "$stage" /usr/lib/python3.11/lib-dynload
  { cat "$stage/.packages"; echo "openai=$ver"; } > "$ctx/packages.txt"
  log "openai-app root assembled in $(since "$t")s"
  build openai-app "$ref" "$app/Containerfile" "$ctx"
  stamp openai-app
  rm -rf "$stage"
}

T0="$(now)"
case " ${IMAGES[*]} " in *" operator "*|*" sidecar "*) build_release ;; esac
for image in "${IMAGES[@]}"; do
  case "$image" in
    operator) product operator tailwarden-operator ;;
    sidecar) product sidecar tailwarden-sidecar ;;
    pause) pause ;;
    openai-app) openai_app ;;
    *) die "unknown image $image (operator, sidecar, pause, openai-app)" ;;
  esac
done

# The summary: compressed archive size and the root's size on disk.
{
  for name in operator sidecar pause openai-app; do
    [[ -f "$OUT/$name.tar" ]] || continue
    printf '%-11s %-45s %s archive=%sKiB root=%sKiB\n' "$name" "$(cat "$OUT/$name.ref")" \
      "$(cat "$OUT/$name.digest")" "$(du -k "$OUT/$name.tar" | cut -f1)" \
      "$(du -sk "$OUT/context/$name/rootfs" 2>/dev/null | cut -f1)"
  done
} > "$OUT/images.txt"
log "done in $(since "$T0")s; $OUT/images.txt:"
cat "$OUT/images.txt" >&2
