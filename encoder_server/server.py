"""Builds and runs the gRPC server: the encoder service, grpc.health.v1, reflection, graceful drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from PIL import Image

from encoder_common import tracing
from encoder_common.collector import freeze_startup_objects
from protos import encoder_pb2 as pb

from .auth import BearerTokenInterceptor, read_token_file
from .batcher import Batcher
from .cache import EmbeddingCache, cache_namespace
from .config import ServerConfig
from .drain import DrainGate
from .leases import LeaseStore
from .metrics import MeteredEncoder, ServerMetrics
from .models import VisionEncoder, load_vision_encoder
from .models.loading import has_random_weights
from .pipeline import ItemPipeline
from .profiles import PROFILES, SGLANG_PROFILE
from .servicer import EncoderServicer, method_handlers, model_info
from .sglang import servicer as sglang_servicer
from .store import EmbeddingStore
from .streams import StreamBudget
from .transports import ServerTransports

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name
# Over the servicer's own limit, so that requests a little too large get its INVALID_ARGUMENT that
# names the limit; far larger ones get gRPC's RESOURCE_EXHAUSTED "Received message larger than max".
REQUEST_SIZE_MARGIN = 1 << 20


class LoadReportingHealth(health.aio.HealthServicer):
    """grpc.health.v1 whose Check answers also carry the encoder's load in their trailing metadata
    (encoder_common.load_report): a receiver's probe learns it without sending work."""

    def __init__(self) -> None:
        super().__init__()
        self.batcher: Batcher | None = None  # set once the forward worker exists

    async def Check(self, request, context):
        if self.batcher is not None:
            context.set_trailing_metadata(self.batcher.load_report().metadata())
        return await super().Check(request, context)


class EncoderServer:
    """One encoder server: `await start()` loads and warms the model and binds; `await stop()` drains."""

    def __init__(self, config: ServerConfig, encoder: VisionEncoder | None = None):
        self.config = config
        self.encoder = encoder
        self.port: int | None = None
        self.metrics = ServerMetrics()
        self.metrics_port: int | None = None
        self.health = LoadReportingHealth()
        self.gate = DrainGate()
        self._server: grpc.aio.Server | None = None
        self._batcher: Batcher | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stopping = False
        self.transports = ServerTransports(config)  # besides the stream, which every call has
        self.cache: EmbeddingCache | None = None
        self.store: EmbeddingStore | None = None
        self.sglang: sglang_servicer.SglangEncoderServicer | None = None
        self.leases: LeaseStore | None = None
        self.streams = StreamBudget(config.streams)

    @property
    def address(self) -> str:
        return _join_host_port(self.config.host, self.port)

    async def start(self) -> int:
        """Life cycle: NOT_SERVING until the model is loaded, a warm-up forward passed and the port is
        bound; then SERVING. Returns the bound port."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        interceptors = self._interceptors()  # reads the token file: a bad one fails before the model loads
        random_weights = await self._load_model()
        await self._start_forward_worker()
        await self.transports.start()  # shared memory also removes what dead encoder processes left in /dev/shm
        if self.config.store.url:
            self.store = EmbeddingStore(self.config.store)
            self.metrics.registry.register(self.store.collector())
            await self.store.check()  # a store that does not answer is only a warning: it costs forwards
        self.streams.start()
        self._server = self._build_grpc_server(interceptors, model_info(self.encoder.spec, self.config, random_weights))
        await self._server.start()
        self._serve_metrics()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._log_ready()
        return self.port

    async def _load_model(self) -> bool:
        """Loads the vision tower unless one was handed over; returns whether its weights are random."""
        config = self.config
        if self.encoder is None:
            self.encoder = await asyncio.get_running_loop().run_in_executor(
                None, load_encoder, config.model, config.device, config.dtype, config.backend
            )
        random_weights = has_random_weights(config.model)
        if random_weights:
            log.warning("%s has random weights: its embeddings are meaningless test outputs", config.model)
        return random_weights

    async def _start_forward_worker(self) -> None:
        """Starts the batcher's thread, runs the warm-up forward and watches the thread from then on."""
        loop = asyncio.get_running_loop()
        self._batcher = Batcher(MeteredEncoder(self.encoder, self.metrics), self.config.batching)
        self.metrics.watch_queue(lambda: self._batcher.queue_depth)
        self.metrics.watch_load(self._batcher)
        self.health.batcher = self._batcher
        self._batcher.start()
        if self.config.warmup:
            try:
                await loop.run_in_executor(None, self._warmup)
            except BaseException:
                self._stopping = True
                await loop.run_in_executor(None, self._batcher.stop)
                raise
        threading.Thread(target=self._watch_forward_worker, args=(loop,), name="forward-watch", daemon=True).start()

    def _build_grpc_server(self, interceptors: list[grpc.aio.ServerInterceptor], info: pb.ModelInfo) -> grpc.aio.Server:
        """Wiring: the pipeline and servicer, SGLang's contract and reflection behind the drain gate (and
        the interceptors), health, the bound port."""
        config = self.config
        self._pool = ThreadPoolExecutor(config.preprocess_workers, thread_name_prefix="preprocess")
        if config.cache_bytes:
            namespace = cache_namespace(self.encoder.spec, PROFILES[config.preprocess_profile])
            self.cache = EmbeddingCache(config.cache_bytes, namespace, self.store)
            self.metrics.watch_cache(self.cache.stats)
        for transport in self.transports:
            self.metrics.watch_transport(transport.collector())
        if config.leases.max_bytes > 0:
            self.leases = LeaseStore(config.leases)
        pipeline = ItemPipeline(
            self.encoder, self._batcher, self._pool, config, self.cache, keys=self.leases is not None
        )
        servicer = EncoderServicer(pipeline, config, info, self.metrics, self.transports, self.leases, self.streams)
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", config.max_request_bytes + REQUEST_SIZE_MARGIN),
                ("grpc.so_reuseport", 0),
            ],
        )
        gated = self.gate.behind(server)
        gated.add_generic_rpc_handlers([method_handlers(servicer)])
        if config.sglang.serve:
            # SGLang's contract gets what SGLang's own encoder makes of the bytes (its own cache keys).
            sglang_pipeline = ItemPipeline(
                self.encoder, self._batcher, self._pool, config, self.cache, profile=PROFILES[SGLANG_PROFILE]
            )
            self.sglang = sglang_servicer.SglangEncoderServicer(sglang_pipeline, config, self.metrics, self.streams)
            gated.add_generic_rpc_handlers([sglang_servicer.method_handlers(self.sglang)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)  # probes answer while draining
        names = (*self._services(), health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(names), gated)
        bind = f"{_bind_host(config.host)}:{config.port}"
        if config.tls is not None:
            self.port = server.add_secure_port(bind, config.tls.server_credentials())
        else:
            self.port = server.add_insecure_port(bind)
        return server

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The encoding services' spans while tracing is on, and the bearer-token check, when configured
        (the drain gate guards the handlers themselves)."""
        config = self.config
        traced = tracing.server_interceptors(self._services())
        if not config.auth_token_file:
            return traced
        tokens = read_token_file(config.auth_token_file)
        return [*traced, BearerTokenInterceptor(tokens, protect_health=config.auth_protect_health)]

    def _serve_metrics(self) -> None:
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
            log.info("metrics on http://%s/metrics", _join_host_port(self.config.host, self.metrics_port))

    def _log_ready(self) -> None:
        config, spec = self.config, self.encoder.spec
        log.info(
            "encoder server ready on %s: %s (%s on %s %s, hidden %d, %s on %s; %s%s)",
            self.address,
            config.model,
            spec.family,
            spec.backend,
            spec.backend_version,
            spec.hidden_size,
            str(spec.dtype).removeprefix("torch."),
            spec.device,
            "plaintext" if config.tls is None else ("mTLS" if config.tls.mutual else "TLS"),
            ", bearer token" if config.auth_token_file else "",
        )

    def _warmup(self) -> None:
        """One real forward before SERVING, so the first caller does not pay for lazy initialization."""
        assert self.encoder is not None
        prepared = self.encoder.preprocess(Image.new("RGB", (64, 64), (127, 127, 127)))
        self.encoder.encode([prepared])

    def _services(self) -> tuple[str, ...]:
        """The encoding services served: encoder.v1, and SGLang's contract unless turned off."""
        return (SERVICE_NAME,) + ((sglang_servicer.SERVICE_NAME,) if self.config.sglang.serve else ())

    async def _set_health(self, status: int) -> None:
        for service in ("", *self._services()):
            await self.health.set(service, status)

    def _watch_forward_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        """Turns health NOT_SERVING when the forward worker dies: the server can no longer encode."""
        assert self._batcher is not None
        self._batcher.join()
        if self._stopping:
            return
        log.error("the forward worker died: health is NOT_SERVING")
        try:
            asyncio.run_coroutine_threadsafe(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING), loop)
        except RuntimeError:  # the event loop is already closed
            pass

    async def stop(self, grace: float | None = None) -> None:
        """Drains: health NOT_SERVING and new calls refused with UNAVAILABLE at once, running calls
        finish within the grace period (then are cancelled), then the server stops."""
        grace = self.config.grace_seconds if grace is None else grace
        deadline = time.monotonic() + grace
        self._stopping = True
        self.gate.close()
        await self.health.enter_graceful_shutdown()
        if not await self.gate.wait_idle(grace):
            log.warning("%d calls still running after the %.1f s grace period: cancelling them", self.gate.running, grace)
        if self._server is not None:
            await self._server.stop(max(0.0, deadline - time.monotonic()))
        self.streams.stop()
        await self.transports.stop()
        if self.sglang is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.sglang.close)
        if self._batcher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._batcher.stop)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            await self.store.close()
        self.metrics.close()

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


def load_encoder(model_dir: str, device: str | None, dtype: torch.dtype, backend: str) -> VisionEncoder:
    """The checkpoint's vision encoder on the configured backend; vLLM is imported only for its own."""
    if backend == "vllm":
        from .models.vllm_backend import load_vllm_encoder

        return load_vllm_encoder(model_dir, device, dtype)
    return load_vision_encoder(model_dir, device, dtype)


def _join_host_port(host: str, port: int | None) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve(config: ServerConfig) -> None:
    """Runs a server until SIGTERM or SIGINT, then drains it."""
    server = EncoderServer(config)
    await server.start()
    log.debug("%d start-up objects frozen out of the garbage collector's full passes", freeze_startup_objects())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (grace %.0f s)", config.grace_seconds)
    await server.stop()
    log.info("stopped")
