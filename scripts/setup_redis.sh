#!/usr/bin/env bash
# Installs Debian's redis-server package, which the fleet-wide embedding store's tests and
# scripts/bench_affinity.py run (each starts its own server on a free loopback port; the package's
# service is not started). Does nothing when redis-server is installed. Needs root (CI runs as root) or sudo.
set -euo pipefail
if command -v redis-server >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "setup_redis.sh: not root and no sudo; install Debian's redis-server package by hand" >&2
    exit 1
  fi
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends redis-server
