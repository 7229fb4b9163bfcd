#!/usr/bin/env bash
# The test command: installs what the tests need into .venv, then runs the suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sharding).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
