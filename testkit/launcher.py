"""The one launcher of child processes for the tests, the benchmarks and the demo: encoder servers
(`python -m encoder_server`) and any other process that prints `ready on <host>:<port>` once serving."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit import REPO_ROOT

# The encoder server logs "encoder server ready on host:port"; other children print "ready on host:port".
READY = re.compile(r"ready on \S+:(\d+)")


@dataclass
class LaunchedProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, grace_s: float = 0.0) -> None:
        """SIGTERM and up to `grace_s` to exit when given (a server drains), then SIGKILL."""
        if self.process.poll() is None and grace_s > 0:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def start_process(
    argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None, timeout: float = 180.0
) -> LaunchedProcess:
    """Starts `argv` in the checkout, its output in `log_path`, and waits for its ready line."""
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            list(argv),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    launched = LaunchedProcess(process, 0, log_path)
    deadline = time.monotonic() + timeout
    while not (match := READY.search(launched.log())):
        if process.poll() is not None or time.monotonic() > deadline:
            launched.stop()
            raise RuntimeError(f"{argv[0]} {' '.join(argv[1:4])} did not start:\n{launched.log()[-4000:]}")
        time.sleep(0.1)
    launched.port = int(match.group(1))
    return launched


def server_argv(model_dir: str | Path, *flags: str) -> list[str]:
    """`python -m encoder_server` on 127.0.0.1 and an OS-chosen port."""
    return [sys.executable, "-m", "encoder_server", "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0", *flags]


@contextlib.contextmanager
def launch_server(
    model_dir: str | Path, *flags: str, log_dir: Path, env: Mapping[str, str] | None = None, timeout: float = 180.0
) -> Iterator[LaunchedProcess]:
    """An encoder server process on 127.0.0.1, its log under `log_dir`; killed on exit."""
    log_path = log_dir / f"server-{time.monotonic_ns()}.log"
    server = start_process(server_argv(model_dir, *flags), log_path, env=env, timeout=timeout)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def launch_servers(model_dir: str | Path, count: int, *flags: str, log_dir: Path) -> Iterator[list[LaunchedProcess]]:
    """`count` encoder server processes, started side by side (each takes seconds to load)."""
    with side_by_side(*(launch_server(model_dir, *flags, log_dir=log_dir) for _ in range(count))) as servers:
        yield servers


@contextlib.contextmanager
def side_by_side(*launches: contextlib.AbstractContextManager[Any]) -> Iterator[list[Any]]:
    """Enters several launches (servers, engines) at once and gives what each gives, in order; exits them all,
    and those that started when another fails to. A start-up mostly waits: two vLLM start-ups side by side
    take about 1.1x one's time on a 2-core machine, four 2.4x."""
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = [pool.submit(launch.__enter__) for launch in launches]
    with contextlib.ExitStack() as stack:
        for launch, future in zip(launches, futures):
            if future.exception() is None:
                stack.push(launch.__exit__)
        yield [future.result() for future in futures]
