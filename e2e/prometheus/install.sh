#!/usr/bin/env bash
# Installs Debian's `prometheus` package (prometheus and promtool) when either is missing,
# without starting its system service: the tests run the binary themselves, on loopback,
# with a temporary storage folder. Idempotent.
set -euo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
sudo=
if [ "$(id -u)" != 0 ]; then sudo=sudo; fi

# invoke-rc.d and deb-systemd-invoke ask policy-rc.d before starting a service; 101 means
# "not now". Leave an existing policy alone, remove ours afterwards.
policy=/usr/sbin/policy-rc.d
made=
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  made=1
fi
cleanup() { if [ -n "$made" ]; then $sudo rm -f "$policy"; fi; }
trap cleanup EXIT

$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
prometheus --version 2>&1 | head -n 1
