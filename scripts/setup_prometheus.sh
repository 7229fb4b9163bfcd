#!/usr/bin/env bash
# Installs Debian's prometheus package (the server and promtool), which tests/project/test_autoscaling.py runs:
# `promtool check rules` / `promtool test rules` on deploy/autoscaling/, and a real Prometheus on
# loopback scraping live encoder servers. Does nothing when both are installed. Needs root (CI runs as
# root) or sudo; the package's service is not started (the tests start their own server).
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "setup_prometheus.sh: not root and no sudo; install Debian's prometheus package by hand" >&2
    exit 1
  fi
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends prometheus
