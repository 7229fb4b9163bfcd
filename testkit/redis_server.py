"""A real redis-server for the tests and benchmarks of the fleet-wide embedding store: Debian's
`redis-server` (scripts/setup_redis.sh installs it) on 127.0.0.1 and a free port, bounded in memory and
evicting least recently used keys as a deployment runs it, with no persistence; it can be killed
(SIGKILL), stopped (SIGSTOP: a store that hangs) and started again on the same port."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from testkit.vllm_server import free_port


class RedisServer:
    """One redis-server process; `url` stays the same across `kill` and `start`."""

    def __init__(self, log_dir: Path, maxmemory: str = "256mb"):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is missing: run ./scripts/setup_redis.sh (scripts/test.sh does)")
        self.port = free_port()
        self.maxmemory = maxmemory
        self.log_path = log_dir / f"redis-{self.port}.log"
        self.process: subprocess.Popen | None = None
        self.extra_args: list[str] = []  # given after the defaults: they win

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        argv = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--logfile", str(self.log_path),
            *self.extra_args,
        ]  # fmt: skip
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log[-2000:]}")
            time.sleep(0.05)

    def answers(self) -> bool:
        """Whether it answers PING now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: what it held is gone."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a stopped process dies only once continued
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing is answered."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def running_redis(log_dir: Path, maxmemory: str = "256mb") -> Iterator[RedisServer]:
    server = RedisServer(log_dir, maxmemory)
    server.start()
    try:
        yield server
    finally:
        server.kill()
