#!/usr/bin/env bash
# The test command. Without arguments (what CI runs): installs .venv, the engine venvs (.venv-engines,
# .venv-sglang, .venv-engines-prev) and the Debian services the tests run (Prometheus, Redis), runs the whole
# suite, then the connector's engine tests again on the previous vLLM release.
#   scripts/test.sh --quick [pytest args]   installs .venv only and runs every test that needs neither an
#                                           engine nor a Debian service (-m "not engine and not services")
#   scripts/test.sh [pytest args]           installs everything and runs pytest with those arguments
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
if [ "${1:-}" = "--quick" ]; then
  shift
  exec .venv/bin/python -m pytest -m "not engine and not services" "$@"
fi
# The engines' venvs install side by side (pip mostly waits on the index and the disk); the Debian
# services one after another (apt's lock).
./scripts/setup_engines.sh & engines=$!
./scripts/setup_sglang.sh & sglang=$!
if [ "$#" -eq 0 ]; then
  ./scripts/setup_engines.sh --previous & previous=$!
fi
./scripts/setup_prometheus.sh
./scripts/setup_redis.sh
wait "$engines"
wait "$sglang"
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
wait "$previous"
.venv/bin/python -m pytest
echo "== the connector's engine tests again, on the previous vLLM release (.venv-engines-prev)"
ENGINES_VENV=.venv-engines-prev exec .venv/bin/python -m pytest -m engine tests/engines/test_vllm_connector.py
