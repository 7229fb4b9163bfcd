#!/usr/bin/env bash
# The test command: installs what the tests need into .venv and .venv-engines, then runs the suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sharding).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
./scripts/setup_engines.sh  # .venv-engines: the engine tests (pytest -m engine) drive vLLM and SGLang
exec .venv/bin/python -m pytest "$@"
