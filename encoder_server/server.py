"""Builds and runs the gRPC server: the encoder service, grpc.health.v1, reflection, graceful drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from PIL import Image

from protos import encoder_pb2 as pb

from .batcher import Batcher
from .cache import EmbeddingCache, cache_namespace
from .config import ServerConfig
from .default_model import has_random_weights
from .models import VisionEncoder, load_vision_encoder
from .servicer import EncoderServicer, method_handlers

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name


class EncoderServer:
    """One encoder server: `await start()` loads and warms the model and binds; `await stop()` drains."""

    def __init__(self, config: ServerConfig, encoder: VisionEncoder | None = None):
        self.config = config
        self.encoder = encoder
        self.port: int | None = None
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._batcher: Batcher | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.cache: EmbeddingCache | None = None

    @property
    def address(self) -> str:
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def start(self) -> int:
        config = self.config
        loop = asyncio.get_running_loop()
        if self.encoder is None:
            self.encoder = await loop.run_in_executor(
                None, load_vision_encoder, config.model, config.device, config.dtype
            )
        random_weights = has_random_weights(config.model)
        if random_weights:
            log.warning("%s has random weights: its embeddings are meaningless test outputs", config.model)
        self._pool = ThreadPoolExecutor(config.preprocess_workers, thread_name_prefix="preprocess")
        self._batcher = Batcher(self.encoder, config.batching)
        self._batcher.start()
        if config.warmup:
            await loop.run_in_executor(None, self._warmup)

        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", config.max_request_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        if config.cache_bytes:
            self.cache = EmbeddingCache(config.cache_bytes, cache_namespace(self.encoder.spec))
        servicer = EncoderServicer(self.encoder, self._batcher, self._pool, config, random_weights, self.cache)
        self._server.add_generic_rpc_handlers([method_handlers(servicer)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server,
        )
        self.port = self._server.add_insecure_port(f"{_bind_host(config.host)}:{config.port}")
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        spec = self.encoder.spec
        log.info(
            "encoder server ready on %s: %s (%s, hidden %d, %s on %s)",
            self.address,
            config.model,
            spec.family,
            spec.hidden_size,
            str(spec.dtype).removeprefix("torch."),
            spec.device,
        )
        return self.port

    def _warmup(self) -> None:
        """One real forward before SERVING, so the first caller does not pay for lazy initialization."""
        assert self.encoder is not None
        prepared = self.encoder.preprocess(Image.new("RGB", (64, 64), (127, 127, 127)))
        self.encoder.encode([prepared])

    async def stop(self, grace: float | None = None) -> None:
        """Flips health to NOT_SERVING, lets running calls finish within the grace period, then stops."""
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config.grace_seconds if grace is None else grace)
        if self._batcher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._batcher.stop)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve(config: ServerConfig) -> None:
    """Runs a server until SIGTERM or SIGINT, then drains it."""
    server = EncoderServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (grace %.0f s)", config.grace_seconds)
    await server.stop()
    log.info("stopped")
