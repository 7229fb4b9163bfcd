#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with the server, gateway and test extras (what
# the tests need; a prefill node needs none: `pip install encoder-service` is the receiver alone).
# torch: the CPU build is installed explicitly first, so that no CUDA build is pulled in on a
# machine without a GPU. Set TORCH_SPEC (e.g. "torch==2.13.0") or PIP_TORCH_ARGS (e.g. an
# --index-url for CPU wheels) to change that; the Dockerfile installs the CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" ${PIP_TORCH_ARGS:-}
fi
.venv/bin/python -m pip install -q -e ".[server,gateway,test]"
