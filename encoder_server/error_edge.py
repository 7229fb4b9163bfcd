"""Where a servicer's call (of either service on the port) meets gRPC statuses: the raw request parsed,
the call made, a domain error answered with its status (encoder_common.errors), anything else a bare
INTERNAL; every answer carries the encoder's load in its trailing metadata (encoder_common.load_report)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from encoder_common.errors import EncoderError, status_for

log = logging.getLogger(__name__)

Result = TypeVar("Result")
INTERNAL_MESSAGE = "internal error while encoding; see the server log"


def error_edge(method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Result]]) -> Callable[..., Awaitable[Result]]:
    """Wraps a servicer method taking a parsed request: the wrapper takes the raw bytes and parses them
    with the servicer's `parse_<method name>`, so that undecodable bytes get INVALID_ARGUMENT like any
    other bad request."""

    @functools.wraps(method)
    async def wrapper(self, raw: bytes, context: grpc.aio.ServicerContext) -> Result:
        request = None
        try:
            try:
                request = getattr(self, f"parse_{method.__name__}")(raw)
                return await method(self, request, context)
            finally:  # every answer, refusals included, carries the encoder's load (receiver placement)
                context.set_trailing_metadata(self.pipeline.batcher.load_report().metadata())
        except EncoderError as exc:
            await context.abort(status_for(exc), str(exc))
        except grpc.aio.AbortError:
            raise  # the call already has its status
        except Exception:
            request_id = getattr(request, "request_id", None) or getattr(request, "req_id", "?")
            log.exception("%s of request %r failed", method.__qualname__, request_id)
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        raise AssertionError("context.abort returned")  # it raises AbortError

    return wrapper
