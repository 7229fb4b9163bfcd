#!/usr/bin/env bash
# The demo command: installs what is needed into .venv, then runs scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"
