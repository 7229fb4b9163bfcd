#!/usr/bin/env bash
# The test command: installs what the tests need into .venv, the engines into .venv-engines and SGLang's
# whole server into .venv-sglang, then runs the suite, engine tests included. Extra arguments go to pytest
# (e.g. scripts/test.sh -k sharding; a quick local run skips the engine tests with
# scripts/test.sh -m "not engine").
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
./scripts/setup_engines.sh
./scripts/setup_sglang.sh
exec .venv/bin/python -m pytest "$@"
