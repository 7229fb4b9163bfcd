"""Server interceptors that decide before the servicer runs: the drain gate, and the refusal handler
that it and the bearer-token check answer refused calls with."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


def refusal_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `code` at once.

    It leaves the request bytes unparsed, so a refused call costs no protobuf work.
    """

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts running calls and, once closed, refuses new ones (health probes excepted) with UNAVAILABLE.

    gRPC's own `server.stop(grace)` closes the listener at once, so probes could no longer see
    NOT_SERVING and a caller could not tell draining from a dead server. Closing this gate first
    keeps the port open while running calls finish.
    """

    def __init__(self) -> None:
        self.closed = False
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def running(self) -> int:
        return self._running

    def close(self) -> None:
        self.closed = True

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no call runs, up to `timeout` seconds; True when none is left."""
        if self._idle.is_set():  # wait_for with a zero timeout would not even look
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        if self.closed:
            return refusal_handler(handler, grpc.StatusCode.UNAVAILABLE, "the encoder server is shutting down")
        if handler.request_streaming:  # reflection: not counted, it carries no encoding work
            return handler
        return self._counted(handler)

    def _enter(self) -> None:
        self._running += 1
        self._idle.clear()

    def _exit(self) -> None:
        self._running -= 1
        if self._running == 0:
            self._idle.set()

    def _counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if handler.response_streaming:
            behavior = handler.unary_stream

            async def stream(request, context):
                self._enter()
                try:
                    async for message in behavior(request, context):
                        yield message
                finally:
                    self._exit()

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        behavior = handler.unary_unary

        async def unary(request, context):
            self._enter()
            try:
                return await behavior(request, context)
            finally:
                self._exit()

        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
