#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with the server, gateway, mooncake and test extras
# (what the tests need; a prefill node needs none: `pip install encoder-service` is the receiver alone),
# and Debian's libibverbs1, which the Mooncake transfer engine loads (scripts/setup_mooncake.sh).
# torch and torchvision are installed explicitly first, as a pair that loads together, so that pip
# never picks a torch for us. The server needs torchvision: it runs the checkpoint's processor with
# transformers' torchvision backend, as vLLM and SGLang do. The package index has no CPU build of
# torchvision, and its torchvision does not load beside the CPU-only torch wheel
# ("operator torchvision::nms does not exist"), so the pair is the index's regular torch build (it
# runs on the CPU) with the torchvision made for it. Set TORCH_SPEC (e.g. "torch==2.14.1
# torchvision==0.29.1") or PIP_TORCH_ARGS (e.g. an --index-url for CPU wheels) to change that.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# pip's own output (this machine's index notices, the build backend's warnings) goes to a log that is
# shown only when an install fails, so that the demo's and the suite's output start with their own.
pip_quietly() {
  if ! .venv/bin/python -m pip install -q "$@" >> .venv/install.log 2>&1; then
    cat .venv/install.log >&2
    exit 1
  fi
}
: > .venv/install.log
pip_quietly --upgrade pip
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  # The `!=` keeps the local CPU-only wheel of the same version out.
  # shellcheck disable=SC2086
  pip_quietly ${TORCH_SPEC:-"torch==2.13.0,!=2.13.0+cpu" torchvision==0.28.0} ${PIP_TORCH_ARGS:-}
fi
./scripts/setup_mooncake.sh
pip_quietly -e ".[server,gateway,mooncake,test]"
