"""Everything an `encoder-gateway` is started with: the CLI builds its flags from these fields (defaults
and help), and `app.build_app` takes it whole. The receiver's settings are a ReceiverConfig of their own."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from encoder_common.env_flags import comma_separated, flag, section
from encoder_common.sources import SourcePolicy
from receiver.config import ReceiverConfig

# Seconds an idle HTTP connection to vLLM stays pooled: under vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
# 5 s), so a connection is dropped here before the engine closes it and no request goes out on a connection
# the engine is closing (aiohttp's default, 15 s, races that close and answers ServerDisconnectedError).
ENGINE_KEEPALIVE_S = 4.0


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    engine_url: str = field(metadata=flag("the vLLM OpenAI server, e.g. http://127.0.0.1:8000"))
    encoders: tuple[str, ...] = field(
        metadata=flag(
            "encoder URLs, comma-separated: grpc://host:port, grpcs://host:port, or dns:///name:port",
            type=comma_separated,
        )
    )
    host: str = field(default="0.0.0.0", metadata=flag("address to listen on"))
    port: int = field(default=9000, metadata=flag("port to listen on (0: any free port)"))
    receiver: ReceiverConfig = field(default_factory=ReceiverConfig, metadata=section())
    engine_timeout_s: float | None = field(  # the whole engine call; None: as long as the engine takes
        default=None,
        metadata=flag("deadline of one engine call, seconds (default: none)", name="--engine-timeout", type=float),
    )
    engine_keepalive_s: float = field(
        default=ENGINE_KEEPALIVE_S,
        metadata=flag(
            "seconds an idle connection to the engine stays pooled; keep it under the engine's own keep-alive "
            "(vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s)",
            name="--engine-keepalive",
            type=float,
        ),
    )
    # The gateway fronts OpenAI clients, who send http(s) image URLs: fetched by default, from public
    # addresses only.
    sources: SourcePolicy = field(
        default_factory=functools.partial(SourcePolicy, http_urls="public"),
        metadata=section(settings=SourcePolicy),
    )
    pass_non_image: bool = field(
        default=False, metadata=flag("forward video/audio parts to the engine untouched instead of answering 400")
    )
    retry_after_s: int = field(
        default=1, metadata=flag("Retry-After seconds of a 503 for overloaded encoders", name="--retry-after")
    )
    handoff: str = field(
        default="inline",
        metadata=flag(
            "how embeddings reach vLLM: inline (image_embeds parts in the request) or connector (vLLM runs "
            "receiver.vllm.connector as ec_consumer and fetches them from the encoders)",
            choices=("inline", "connector"),
        ),
    )
    lease_ttl_s: float = field(
        default=60.0,
        metadata=flag(
            "with --handoff connector: seconds encoders keep an item for the engine's fetch", name="--lease-ttl"
        ),
    )
