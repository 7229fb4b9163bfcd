"""The drain gate on a real server: running calls counted, and once it is closed every service but
health refused with UNAVAILABLE (encoder.v1, SGLang's contract, reflection), with no interceptor."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from encoder_server.drain import SHUTTING_DOWN
from encoder_server.server import SERVICE_NAME
from protos import encoder_pb2 as pb
from protos import encoder_pb2_grpc as pb_grpc
from protos import sglang_encoder_pb2 as sglang_pb
from protos import sglang_encoder_pb2_grpc as sglang_grpc
from testkit import REPO_ROOT
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.servers import running_server, wait_until


@pytest.fixture
async def server():
    # 16 MiB a call: more than flow control lets through, so an unread call stays open
    encoder = EncoderDouble(tokens=4096, hidden_size=1024, dtype=torch.float32)
    async with running_server(REPO_ROOT / "no-checkpoint", encoder=encoder) as running:
        yield running


def encode_request(request_id: str) -> pb.EncodeRequest:
    item = pb.ImageItem(index=0, modality=pb.IMAGE, data=image_bytes(32, 32))
    return pb.EncodeRequest(request_id=request_id, items=[item])


async def test_a_call_is_counted_while_it_streams_and_not_after(server):
    async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
        call = pb_grpc.EncoderServiceStub(channel).Encode(encode_request("held"))
        assert (await call.read()).WhichOneof("kind") == "header"  # not read further: the call stays open
        assert server.gate.running == 1
        call.cancel()
        assert await wait_until(lambda: server.gate.running == 0, timeout=10)
        assert not server.gate.closed


async def test_a_closed_gate_refuses_every_service_but_health(server):
    server.gate.close()
    async with grpc.aio.insecure_channel(server.url.removeprefix("grpc://")) as channel:
        native = pb_grpc.EncoderServiceStub(channel)
        refused = {
            "Encode": lambda: _drain(native.Encode(encode_request("late"))),
            "GetModelInfo": lambda: native.GetModelInfo(pb.GetModelInfoRequest()),
            "SGLang Encode": lambda: sglang_grpc.SglangEncoderStub(channel).Encode(sglang_pb.EncodeRequest()),
            "reflection": lambda: _drain(
                reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            ),
        }
        for name, call in refused.items():
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call()
            refusal = (error.value.code(), error.value.details())
            assert refusal == (grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN), name
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
        # The gate alone leaves health as it is: stop() turns it NOT_SERVING first.
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert server.gate.running == 0


async def _drain(call) -> None:
    async for _ in call:
        pass
