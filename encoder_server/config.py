"""The server's settings, built whole by the CLI (or a test) and handed to the server. Each field's
metadata says how it shows on the command line, so its default is written here only."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from encoder_common.env_flags import Flag, flag, section
from encoder_common.sources import SourcePolicy
from protos import encoder_pb2 as pb

from .batcher import BatchingConfig
from .images import DEFAULT_MAX_ASPECT_RATIO
from .leases import LeaseConfig
from .profiles import DEFAULT_PROFILE, PROFILES
from .sglang.config import SglangConfig
from .store import StoreConfig
from .streams import StreamLimits
from .tls import TlsConfig
from .transports.mooncake import MooncakeConfig
from .transports.shm import ShmConfig

if TYPE_CHECKING:  # torch is imported once a config is built, not to build the parser (--help stays fast)
    import torch

# The dtypes an embedding can be served in, by name: those the wire carries.
DTYPE_CHOICES = tuple(name.lower() for name, number in pb.DType.items() if number)

DEFAULT_CACHE_BYTES = 1 << 30
# Whose code runs the tower: transformers (the families of encoder_server/models, no vLLM needed) or the
# installed vLLM (any image family it serves; encoder_server/models/vllm_backend.py).
BACKENDS = ("transformers", "vllm")


def port_or_off(value: str) -> int | None:
    """A port number, or 'off' (None)."""
    if value.strip().lower() in ("off", "none", ""):
        return None
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number")
    return port


def pixels_or_engine(value: str) -> int | None:
    """A pixel count, or 'engine' (None): the limit of the engine the preprocessing profile follows."""
    if value.strip().lower() == "engine":
        return None
    return int(value)


def dtype_flag(help: str) -> dict:
    """The metadata of a dtype setting, given on the command line by name."""
    return flag(help, choices=DTYPE_CHOICES)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    model: str = field(metadata=flag("checkpoint directory (Hugging Face layout)"))
    host: str = field(default="0.0.0.0", metadata=flag("address to listen on ('::' for all IPv6)"))
    port: int = field(default=50051, metadata=flag("port to listen on (0: any free port)"))
    device: str | None = field(default=None, metadata=flag("cuda when present, else cpu", choices=("cuda", "cpu")))
    dtype: torch.dtype | str = field(default="bfloat16", metadata=dtype_flag("served dtype"))  # a name becomes its torch.dtype
    backend: str = field(
        default="transformers",
        metadata=flag(
            "whose code runs the tower and its processor: transformers, or the installed vLLM "
            "(any image family it serves; docs/architecture.md)",
            choices=BACKENDS,
        ),
    )
    batching: BatchingConfig = field(default_factory=BatchingConfig, metadata=section())
    preprocess_workers: int = field(default=4, metadata=flag("threads decoding and preprocessing images"))
    max_items_per_request: int = field(default=64, metadata=flag("items one Encode call may carry"))
    max_request_bytes: int = field(default=256 << 20, metadata=flag("largest Encode request accepted"))
    preprocess_profile: str = field(
        default=DEFAULT_PROFILE,
        metadata=flag(
            "whose image loading and processor backend Encode reproduces (docs/parity.md); "
            "the SglangEncoder service always follows sglang",
            choices=tuple(PROFILES),
        ),
    )
    max_image_pixels: int | None = field(  # None: the profile's engine's own limit
        default=None,
        metadata=flag(
            "refuse larger images before decoding ('engine': the profile's engine's own limit)",
            type=pixels_or_engine,
            shown=lambda limit: "engine" if limit is None else str(limit),
        ),
    )
    max_aspect_ratio: float = field(
        default=DEFAULT_MAX_ASPECT_RATIO, metadata=flag("refuse images thinner than 1:N before decoding")
    )
    sources: SourcePolicy = field(default_factory=SourcePolicy, metadata=section())
    tls: TlsConfig | None = field(default=None, metadata=section(settings=TlsConfig, prefix="tls-"))
    auth_token_file: str | None = field(  # None: no authentication
        default=None, metadata=flag("file of bearer tokens, one per line: calls must carry one")
    )
    auth_protect_health: bool = field(default=False, metadata=flag("require the token on health probes too"))
    cache_bytes: int = field(default=DEFAULT_CACHE_BYTES, metadata=flag("embedding cache size in bytes (0: no cache)"))
    store: StoreConfig = field(default_factory=StoreConfig, metadata=section(prefix="store-"))  # the cache's second tier
    leases: LeaseConfig = field(default_factory=LeaseConfig, metadata=section(prefix="lease-"))  # items kept for Fetch
    # Payload bytes held for Encode streams in progress, beside the cache's own budget.
    streams: StreamLimits = field(default_factory=StreamLimits, metadata=section(prefix="stream-"))
    grace_seconds: float = field(default=30.0, metadata=flag("drain time for running calls on SIGTERM"))
    metrics_port: int | None = field(  # Prometheus /metrics over HTTP; None: not served
        default=None,
        metadata=flag(
            "HTTP port of Prometheus /metrics ('off': none, 0: any free port)",
            type=port_or_off,
            shown=lambda port: "off" if port is None else str(port),
        ),
    )
    warmup: bool = field(default=True, metadata=flag("skip the warm-up forward before SERVING"))
    shm: ShmConfig | None = field(  # the same-host shared-memory path; None: off
        default=None,
        metadata=section(
            settings=ShmConfig,
            prefix="shm-",
            switch=Flag(help="hand payloads to receivers on this host through /dev/shm", name="--shm-transfer"),
        ),
    )
    mooncake: MooncakeConfig | None = field(  # the transfer engine, across hosts; None: off
        default=None,
        metadata=section(
            settings=MooncakeConfig,
            prefix="mooncake-",
            switch=Flag(
                help="write payloads into receivers' memory with the Mooncake transfer engine when they offer it",
                name="--mooncake-transfer",
            ),
        ),
    )
    sglang: SglangConfig = field(default_factory=SglangConfig, metadata=section(prefix="sglang-"))  # docs/sglang.md

    def __post_init__(self) -> None:
        if self.store.url and not self.cache_bytes:
            raise ValueError("the fleet-wide store is the embedding cache's second tier: --store-url needs --cache-bytes above 0")
        if isinstance(self.dtype, str):
            from protos.wire import DTYPE_NAMES

            object.__setattr__(self, "dtype", DTYPE_NAMES[self.dtype])
