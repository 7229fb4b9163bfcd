"""Encoder servers in this process, on 127.0.0.1 and an OS-chosen port, for the tests and benchmarks,
and waiting for what a server does in the background."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import torch

from encoder_server.batcher import BatchingConfig
from encoder_server.config import ServerConfig
from encoder_server.server import EncoderServer


def server_config(model_dir: Path, **overrides) -> ServerConfig:
    """A loopback config on an OS-chosen port, fp32 unless told otherwise."""
    batching = overrides.pop("batching", BatchingConfig())
    defaults = dict(model=str(model_dir), host="127.0.0.1", port=0, device="cpu", dtype=torch.float32, grace_seconds=2.0)
    defaults.update(overrides)
    return ServerConfig(batching=batching, **defaults)


@contextlib.asynccontextmanager
async def running_server(model_dir: Path, encoder=None, **overrides) -> AsyncIterator[EncoderServer]:
    """An in-process encoder server on 127.0.0.1; `server.url` is its grpc:// URL."""
    server = EncoderServer(server_config(model_dir, **overrides), encoder=encoder)
    await server.start()
    server.url = f"grpc://127.0.0.1:{server.port}"  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.stop(grace=0.5)


async def wait_until(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Polls `predicate` on the event loop until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
