"""Starts SGLang's whole server (`python -m sglang.launch_server`, from .venv-sglang) on a checkpoint, on
this machine's CPU: alone with its own vision tower, or as a language-only prefill server on encoder pods.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from testkit import REPO_ROOT
from testkit.vllm_server import engine_scratch_env, free_port, serving

SGLANG_PYTHON = REPO_ROOT / ".venv-sglang" / "bin" / "python"

# SGLang's load-report slot files (sglang/srt/managers/load_snapshot.py): its processes die on a signal
# without unlinking them, so each stopped server would leave its own in /dev/shm.
SGLANG_SHM = Path("/dev/shm")
SGLANG_SHM_FILES = "sglang_loads_*"

# SGLang's flags that run its model code on a CPU without SGLang's CPU kernels: the platform stays
# generic (no SGLANG_USE_CPU_ENGINE), attention in plain torch, no CUDA graphs, a small KV cache
# (a large one takes seconds to allocate), float32 for exact comparisons.
CPU_ARGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
    "--mem-fraction-static", "0.3", "--max-total-tokens", "8192", "--dtype", "float32",
)  # fmt: skip


def sglang_env(**extra: str) -> dict[str, str]:
    """SGLang's environment: no hub, all of its ZMQ traffic on loopback, its IPC sockets' files in
    `engine_scratch_env`'s directory."""
    loopback = {"HF_HUB_OFFLINE": "1", "SGLANG_HOST_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    return {**os.environ, **engine_scratch_env(), **loopback, **extra}


def language_only_args(encoder_urls: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Flags and environment of a language-only prefill server that takes images from `encoder_urls`
    (grpc://host:port), over SGLang's gRPC receiver pushing to its tokenizer process.

    SGLang 0.5.23 probes each encoder's health with an HTTP GET on the grpc:// URL, which always fails
    and evicts every gRPC encoder within ~30 s: the probe is turned off. Its default transfer
    backend (zmq_to_scheduler) passes an argument MMReceiverGrpc.encode() does not take: the
    tokenizer backend is named. Its encoder bootstrap server gets a free port instead of its fixed default.
    """
    args = [
        "--language-only", "--encoder-urls", *encoder_urls, "--encoder-transfer-backend", "zmq_to_tokenizer",
        "--encoder-bootstrap-port", str(free_port()),
    ]  # fmt: skip
    env = {"SGLANG_ENCODER_MM_RECEIVER_MODE": "grpc", "SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_INTERVAL": "0"}
    return args, env


@contextlib.contextmanager
def launch_sglang(
    model_dir: str | Path,
    *,
    log_path: Path,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    timeout: float = 600.0,
) -> Iterator[str]:
    """SGLang's server on 127.0.0.1 with CPU_ARGS, logging to `log_path`; gives its URL once /health
    answers 200; stopped (its whole process group) on exit, and the shared-memory files it made
    (SGLANG_SHM_FILES) removed."""
    before = set(SGLANG_SHM.glob(SGLANG_SHM_FILES))
    port = free_port()
    args = [
        str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model_dir),
        *CPU_ARGS, "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, env=sglang_env(**(extra_env or {})),
            cwd=log_path.parent, start_new_session=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            with serving(process, url, log_path, timeout=timeout, name="SGLang"):
                yield url
        finally:
            for left in set(SGLANG_SHM.glob(SGLANG_SHM_FILES)) - before:
                left.unlink(missing_ok=True)
