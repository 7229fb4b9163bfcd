"""A server interceptor recording every RPC an encoder server receives, with the items of Encode calls."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from unittest import mock

import grpc

from encoder_server.server import EncoderServer
from protos import encoder_pb2 as pb
from testkit.servers import running_server


class RpcLog(grpc.aio.ServerInterceptor):
    """`calls` holds (method name, item indices) per RPC, in arrival order; indices only for Encode."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def sent(self, method: str = "Encode") -> list[list[int]]:
        return [indices for name, indices in self.calls if name == method]

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler is None or handler.unary_stream is None:
            self.calls.append((method, []))
            return handler
        behavior = handler.unary_stream

        async def logged(request, context):
            # The servicer reads raw request bytes (it parses them itself, to refuse unknown fields), and
            # writes its stream with `context.write` (a coroutine handler, see encoder_server/sender.py).
            parsed = pb.EncodeRequest.FromString(request) if isinstance(request, bytes) else request
            self.calls.append((method, [item.index for item in parsed.items]))
            await behavior(request, context)

        return grpc.unary_stream_rpc_method_handler(
            logged,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@contextlib.asynccontextmanager
async def logged_server(model_dir: Path, **overrides) -> AsyncIterator[EncoderServer]:
    """`running_server` with an RpcLog interceptor installed on its grpc.aio server, as `server.rpc_log`."""
    log = RpcLog()
    async with contextlib.AsyncExitStack() as stack:
        # EncoderServer builds its grpc.aio server inside start(); add the interceptor to its own there.
        real_server = grpc.aio.server

        def server_with_log(*args, interceptors=(), **kwargs):
            return real_server(*args, interceptors=[log, *interceptors], **kwargs)

        with mock.patch.object(grpc.aio, "server", server_with_log):
            server = await stack.enter_async_context(running_server(model_dir, **overrides))
        server.rpc_log = log  # type: ignore[attr-defined]
        yield server
