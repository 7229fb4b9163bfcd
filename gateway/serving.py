"""What the chat-completions endpoint does: encode the request's images on the encoder pods through
`EncoderReceiver`, put their embedding parts where the images were, and forward the request to the engine.

Transport-free: the HTTP binding (`app.py`) turns GatewayError into a response and streams the engine's reply.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import grpc

from encoder_common import tracing
from encoder_common.errors import EncoderError, InvalidItemError, http_status_for_code
from encoder_common.families import family_of
from encoder_common.sources import SourceReader
from receiver import EncodeFailedError, EncoderReceiver

from .handoff import Handoff
from .metrics import GatewayMetrics
from .protocol import ImagePart, image_parts, replace_parts


class GatewayError(Exception):
    """A request the gateway answers itself: the HTTP status, an OpenAI-style error body, extra headers."""

    def __init__(self, status: int, message: str, *, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        kind = {
            400: "BadRequestError",
            502: "BadGatewayError",
            503: "ServiceUnavailableError",
            504: "TimeoutError",
        }
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "InternalServerError"),
                "param": None,
                "code": self.status,
            }
        }


_ITEM_IN_MESSAGE = re.compile(r"\bitem (\d+): ")


def encode_error(error: EncoderError, parts: list[ImagePart], retry_after_s: int) -> GatewayError:
    """The HTTP answer for a failed encode: the status from the error table (encoder_common.errors),
    a bad image's message naming its part, and 502 for an encoder failing on its own."""
    if isinstance(error, InvalidItemError):  # refused before any call: the message names the part
        return GatewayError(400, str(error))
    if not isinstance(error, EncodeFailedError):
        return GatewayError(502, f"encoding the images failed: {error}")
    status = http_status_for_code(error.code, error.message)
    if status == 400:
        return GatewayError(400, _bad_item_message(error, parts))
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GatewayError(
            status,
            f"the encoders are overloaded; retry later ({error.message})",
            headers={"Retry-After": str(retry_after_s)},
        )
    if error.code == grpc.StatusCode.UNAVAILABLE:
        return GatewayError(status, f"no encoder is reachable ({error.message})")
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(status, f"encoding the images took longer than the deadline ({error.message})")
    # Anything else is the encoders' own failure, which a gateway reports as a bad upstream.
    return GatewayError(502, f"encoding the images failed: {error}")


def _bad_item_message(error: EncodeFailedError, parts: list[ImagePart]) -> str:
    """The encoder's reason, with its item index translated into the request's message and part."""
    for tries in error.attempts.values():
        for attempt in tries:
            if attempt.status == "INVALID_ARGUMENT":
                match = _ITEM_IN_MESSAGE.search(attempt.message)
                if match and int(match.group(1)) < len(parts):
                    part = parts[int(match.group(1))]
                    return f"{part.where}: invalid image: {attempt.message[match.end() :]}"
                return f"invalid image: {attempt.message}"
    return f"invalid image: {error.message}"


class ChatCompletionsService:
    """Encodes, rewrites and forwards chat-completions requests; one per gateway, shared by all requests."""

    def __init__(
        self,
        *,
        receiver: EncoderReceiver,
        handoff: Handoff,
        engine_url: str,
        session: aiohttp.ClientSession,
        sources: SourceReader,
        metrics: GatewayMetrics,
        pass_non_image: bool = False,
        retry_after_s: int = 1,
    ):
        self.receiver = receiver
        self.handoff = handoff
        self.engine_url = engine_url.rstrip("/")
        self.session = session
        self.sources = sources
        self.metrics = metrics
        self.pass_non_image = pass_non_image
        self.retry_after_s = retry_after_s

    async def _part_bytes(self, part: ImagePart) -> bytes:
        """The encoded image bytes an image part names; InvalidItemError names the part on any refusal."""
        try:
            return await self.sources.read(part.url)
        except InvalidItemError as exc:
            raise InvalidItemError(f"{part.where}: {exc}") from None

    async def prepare(self, body: Any) -> dict[str, Any]:
        """The request to send the engine: every image part replaced by its embedding part.

        Raises GatewayError for what the gateway answers itself (bad request, encoders failing).
        Cancelling it (the client went away) cancels the fetches' waits and the encode calls.
        """
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        try:
            parts = image_parts(body, pass_non_image=self.pass_non_image)
        except InvalidItemError as exc:
            raise GatewayError(400, str(exc)) from None
        if not parts:
            return body
        request_id = f"gw-{uuid.uuid4().hex}"
        handoff = self.handoff.for_request(body)
        started = time.perf_counter()
        try:
            with tracing.span("gateway.read_images", attributes={"encoder.items": len(parts)}):
                images = await asyncio.gather(*(self._part_bytes(part) for part in parts))
            result = await self.receiver.encode(
                request_id,
                [{"modality": "image", "data": data} for data in images],
                **handoff.encode_options,
            )
            served = (await self.receiver.served_model()).family  # asked once per receiver
        except EncoderError as exc:
            error = encode_error(exc, parts, self.retry_after_s)
            self.metrics.encode_failed(error.status)
            raise error from None
        encoded = time.perf_counter()
        family = family_of(served)
        if family is None:  # the start-up check did not run (encoders down then) and would have refused it
            raise GatewayError(502, f"the encoders serve family {served!r}, which this gateway does not know")
        with tracing.span("gateway.handoff", attributes={"encoder.family": served}):
            new_parts = await handoff.content_parts(request_id, result, family=family, images=images)
        self.metrics.encoded(len(parts), encoded - started, time.perf_counter() - encoded)
        return replace_parts(body, dict(zip(parts, new_parts)))

    def engine_request(self, path: str, body: Mapping[str, Any] | None = None, method: str = "POST"):
        """The engine call: awaiting it gives the engine's response once its headers arrive."""
        return self.session.request(method, f"{self.engine_url}{path}", json=body, headers=tracing.http_headers())


def engine_unreachable(engine_url: str, exc: BaseException) -> GatewayError:
    """The answer when the engine cannot be reached (refused, reset before its headers, timed out)."""
    return GatewayError(502, f"the engine at {engine_url} is unreachable: {exc.__class__.__name__}: {exc}")
