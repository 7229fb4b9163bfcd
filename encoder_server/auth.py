"""Optional bearer-token authentication: calls without `authorization: Bearer <token>` get UNAUTHENTICATED.
Tokens come from a file, one per line (a new one rolls out beside the old), compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc

from .drain import HEALTH_PREFIX, Continuation, refusal_handler

AUTH_HEADER = "authorization"
SCHEME = "bearer "


def read_token_file(path: str | Path) -> list[bytes]:
    """The tokens in `path`, one per non-empty line; raises ValueError (not naming any token) if none."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the auth token file {path}: {exc.__class__.__name__}") from None
    tokens = [line.strip().encode() for line in lines if line.strip()]
    if not tokens:
        raise ValueError(f"the auth token file {path} holds no token")
    return tokens


def _digest(token: bytes) -> bytes:
    # Comparing fixed-length digests keeps even the token's length out of the timing.
    return hashlib.sha256(token).digest()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry one of the configured tokens; no token is ever logged.

    Health probes stay open unless `protect_health` is set: load balancers and orchestrators
    probe without credentials.
    """

    def __init__(self, tokens: list[bytes], *, protect_health: bool = False):
        if not tokens:
            raise ValueError("BearerTokenInterceptor needs at least one token")
        self._digests = [_digest(t) for t in tokens]
        self.protect_health = protect_health

    def authorized(self, metadata) -> bool:
        presented = next((value for key, value in metadata or () if key == AUTH_HEADER), None)
        if not isinstance(presented, str) or presented[: len(SCHEME)].lower() != SCHEME:
            return False
        digest = _digest(presented[len(SCHEME) :].strip().encode())
        matched = False
        for expected in self._digests:  # no early exit: every token costs the same
            matched |= hmac.compare_digest(digest, expected)
        return matched

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        if not self.protect_health and details.method.startswith(HEALTH_PREFIX):
            return handler
        if self.authorized(details.invocation_metadata):
            return handler
        return refusal_handler(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
