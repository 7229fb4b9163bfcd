"""An encoder server process whose tower is FixedSizeEncoder (every image: one precomputed item of a chosen
size), shared memory on: what the transport benchmarks measure the real server path against.

    with fixed_server(num_tokens, hidden_size) as url: ...      # the process lives until the block ends
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def serve(num_tokens: int, hidden_size: int) -> None:
    """The server process: the real server and servicer, the stand-in tower, --shm-transfer on; it
    stops when its stdin closes."""
    import logging

    import torch

    from encoder_server.cli import tune_malloc
    from encoder_server.server import EncoderServer
    from encoder_server.shm import ShmConfig
    from testkit.support import FixedSizeEncoder, server_config

    logging.basicConfig(level=logging.WARNING)
    tune_malloc()  # as the encoder-server CLI does

    async def run() -> None:
        config = server_config(REPO_ROOT / "no-checkpoint", dtype=torch.bfloat16, shm=ShmConfig(max_bytes=1 << 30))
        server = EncoderServer(config, encoder=FixedSizeEncoder(num_tokens, hidden_size, torch.bfloat16))
        await server.start()
        print(f"ready {server.port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
        await server.stop(grace=0)

    asyncio.run(run())


@contextlib.contextmanager
def fixed_server(num_tokens: int, hidden_size: int) -> Iterator[str]:
    """Starts the server process and yields its grpc:// URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "testkit.fixed_server", str(num_tokens), str(hidden_size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        line = process.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError("the fixed-size encoder server did not start")
        yield f"grpc://127.0.0.1:{line[1]}"
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="serve FixedSizeEncoder items until stdin closes")
    parser.add_argument("num_tokens", type=int)
    parser.add_argument("hidden_size", type=int)
    args = parser.parse_args()
    serve(args.num_tokens, args.hidden_size)
