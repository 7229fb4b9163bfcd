#!/usr/bin/env bash
# Installs Debian packages (the arguments) with apt-get, as root or through sudo: what
# scripts/setup_prometheus.sh and scripts/setup_redis.sh share.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "$(basename "$0"): not root and no sudo; install Debian's $* by hand" >&2
    exit 1
  fi
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "$@"
