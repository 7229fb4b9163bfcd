#!/usr/bin/env bash
# Installs Debian's redis-server package, which the fleet-wide embedding store's tests and
# scripts/bench_affinity.py run (each starts its own server on a free loopback port; the package's
# service is not started). Does nothing when redis-server is installed. Needs root (CI runs as root) or sudo.
set -euo pipefail
if command -v redis-server >/dev/null; then
  exit 0
fi
exec "$(dirname "$0")/apt_install.sh" redis-server
