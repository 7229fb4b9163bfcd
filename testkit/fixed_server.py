"""An encoder server process whose tower is an EncoderDouble returning one precomputed item of a chosen
size for every image, shared memory on (and the transfer engine, when asked): the real server path the
transport benchmarks measure.

    with fixed_server(num_tokens, hidden_size) as url: ...   # SIGTERM at the end lets it clean up
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from testkit import REPO_ROOT
from testkit.launcher import start_process


def serve(
    num_tokens: int, hidden_size: int, *, shm: bool = True, mooncake: bool = False, deepstack: int = 0
) -> None:
    """The server process: the real server and servicer, the stand-in tower (with `deepstack` layers),
    --shm-transfer unless `shm` is False, --mooncake-transfer with `mooncake`."""
    import logging

    import torch

    from encoder_common import tracing
    from encoder_common.collector import freeze_startup_objects
    from encoder_common.malloc import tune_server_malloc
    from encoder_server.server import EncoderServer
    from encoder_server.transports.mooncake import MooncakeConfig
    from encoder_server.transports.shm import ShmConfig
    from testkit.encoders import EncoderDouble
    from testkit.servers import server_config

    logging.basicConfig(level=logging.WARNING)
    tune_server_malloc()  # as the encoder-server CLI does
    tracing.configure("encoder-server")  # as the CLI does: on when an OTEL endpoint variable names a collector

    async def run() -> None:
        config = server_config(
            REPO_ROOT / "no-checkpoint",
            dtype=torch.bfloat16,
            shm=ShmConfig(max_bytes=1 << 30) if shm else None,
            mooncake=MooncakeConfig() if mooncake else None,
        )
        encoder = EncoderDouble(
            tokens=num_tokens, hidden_size=hidden_size, dtype=torch.bfloat16, num_deepstack_layers=deepstack
        )
        server = EncoderServer(config, encoder=encoder)
        await server.start()
        freeze_startup_objects()  # as encoder_server.server.serve does
        stopping = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
        print(f"ready on 127.0.0.1:{server.port}", flush=True)
        await stopping.wait()  # the launcher's SIGTERM
        await server.stop(grace=0)  # removes its shared-memory files

    asyncio.run(run())


@contextlib.contextmanager
def fixed_server(num_tokens: int, hidden_size: int, *flags: str) -> Iterator[str]:
    """The server process, its log in a temporary directory; yields its grpc:// URL."""
    with tempfile.TemporaryDirectory() as log_dir:
        argv = [sys.executable, "-m", "testkit.fixed_server", str(num_tokens), str(hidden_size), *flags]
        server = start_process(argv, Path(log_dir) / "server.log")
        try:
            yield server.url
        finally:
            server.stop(grace_s=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="serve EncoderDouble items of a fixed size until SIGTERM")
    parser.add_argument("num_tokens", type=int)
    parser.add_argument("hidden_size", type=int)
    parser.add_argument("--no-shm", action="store_true", help="shared memory off")
    parser.add_argument("--mooncake", action="store_true", help="the transfer engine on")
    parser.add_argument("--deepstack", type=int, default=0, help="deepstack layers after each embedding")
    args = parser.parse_args()
    serve(
        args.num_tokens,
        args.hidden_size,
        shm=not args.no_shm,
        mooncake=args.mooncake,
        deepstack=args.deepstack,
    )
