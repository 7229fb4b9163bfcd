"""The server's settings, built whole by the CLI (or a test) and handed to the server."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .batcher import BatchingConfig
from .images import DEFAULT_MAX_ASPECT_RATIO, DEFAULT_MAX_IMAGE_PIXELS
from .shm import ShmConfig
from .sources import SourcePolicy
from .streams import StreamLimits
from .tls import TlsConfig

DEFAULT_CACHE_BYTES = 1 << 30


def default_device() -> str:
    """The GPU when there is one, else the CPU; asked when a config is made, never at import."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    model: str
    host: str = "0.0.0.0"
    port: int = 50051
    device: str = field(default_factory=default_device)
    dtype: torch.dtype = torch.bfloat16
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    preprocess_workers: int = 4
    max_items_per_request: int = 64
    max_request_bytes: int = 256 << 20
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    cache_bytes: int = DEFAULT_CACHE_BYTES  # embedding cache size; 0 turns the cache off
    grace_seconds: float = 30.0
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: not served
    warmup: bool = True
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
    sources: SourcePolicy = field(default_factory=SourcePolicy)
    tls: TlsConfig | None = None
    auth_token_file: str | None = None  # one token per line; None: no authentication
    auth_protect_health: bool = False  # also require the token on grpc.health.v1 probes
    shm: ShmConfig | None = None  # the same-host shared-memory path (--shm-transfer); None: off
    streams: StreamLimits = field(default_factory=StreamLimits)  # payload bytes held for streams in progress
