#!/usr/bin/env bash
# Installs Debian's prometheus package (the server and promtool), which tests/project/test_autoscaling.py runs:
# `promtool check rules` / `promtool test rules` on deploy/autoscaling/, and a real Prometheus on
# loopback scraping live encoder servers. Does nothing when both are installed. Needs root (CI runs as
# root) or sudo; the package's service is not started (the tests start their own server).
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
exec "$(dirname "$0")/apt_install.sh" prometheus
