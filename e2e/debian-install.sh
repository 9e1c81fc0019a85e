#!/usr/bin/env bash
# Installs Debian packages (as root, with apt-get) without starting any service they ship:
# the tests start redis-server, containerd and the rest themselves, in their own
# directories and namespaces, and a system containerd would only get in the way.
#
#   e2e/debian-install.sh PKG...      (used by `make system-deps`)
set -euo pipefail
[[ $# -gt 0 ]] || exit 0
sudo=
[[ "$(id -u)" == 0 ]] || sudo=sudo
# invoke-rc.d and deb-systemd-invoke ask policy-rc.d before starting a service; 101 means
# "not now". Leave an existing policy alone, remove ours afterwards.
policy=/usr/sbin/policy-rc.d
made=
if [[ ! -e "$policy" ]]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  made=1
fi
cleanup() { if [[ -n "$made" ]]; then $sudo rm -f "$policy"; fi; }
trap cleanup EXIT
echo "installing Debian packages: $*"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
