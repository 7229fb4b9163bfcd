#!/usr/bin/env bash
# Installs Debian's libibverbs1, which the Mooncake transfer engine (the `mooncake` extra,
# mooncake-transfer-engine-non-cuda) loads at import, for its TCP transport as for RDMA. Does nothing when
# the library is there. Needs root (CI runs as root) or sudo; without either it says so and goes on: the
# engine then does not import, and its tests skip.
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q "libibverbs\.so\.1 "; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "setup_mooncake.sh: not root and no sudo; install Debian's libibverbs1 by hand for the transfer engine" >&2
    exit 0
  fi
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends libibverbs1
