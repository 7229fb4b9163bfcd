"""Everything an `encoder-gateway` is started with: the CLI builds it, `app.build_app` takes it whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from receiver import ClientTls

from .sources import SourcePolicy


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    engine_url: str  # the vLLM OpenAI server, e.g. http://127.0.0.1:8000
    encoders: tuple[str, ...]  # grpc://, grpcs:// or dns:/// encoder URLs
    host: str = "0.0.0.0"
    port: int = 9000
    encode_timeout_s: float = 60.0  # deadline of one request's encode, retries included
    engine_timeout_s: float | None = None  # whole engine call; None: as long as the engine takes
    sources: SourcePolicy = field(default_factory=SourcePolicy)
    pass_non_image: bool = False  # forward video/audio parts untouched instead of refusing them
    retry_after_s: int = 1  # Retry-After of a 503 for overloaded encoders
    tls: ClientTls | None = None  # for grpcs:// encoders
    auth_token: str | None = None  # bearer token sent to the encoders
    transfer: str = "auto"  # "auto", "shm" or "grpc": how embeddings come back from encoders on this host
