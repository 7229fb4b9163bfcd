"""Starts `python -m encoder_server` as a child process and waits for its ready line (demo, bench, tests)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_READY = re.compile(r"encoder server ready on \S+:(\d+)")


@dataclass
class LaunchedServer:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def launch_server(
    model_dir: str | Path,
    *flags: str,
    log_path: Path,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
) -> Iterator[LaunchedServer]:
    """An encoder server process on 127.0.0.1 and an OS-chosen port; killed on exit."""
    args = [sys.executable, "-m", "encoder_server", "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0"]
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [*args, *flags],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        try:
            deadline = time.monotonic() + timeout
            while not (match := _READY.search(log_path.read_text(errors="replace"))):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"encoder server did not start:\n{log_path.read_text(errors='replace')}")
                time.sleep(0.1)
            yield LaunchedServer(process, int(match.group(1)), log_path)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
