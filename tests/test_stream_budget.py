"""Streams nobody reads cannot take the server's memory: payload bytes held for streams in progress stay
within the stream buffer budget, stalled streams are cut, and readers keep being served."""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_server.streams import EVICT_AFTER_S, RESIDUE_BYTES, StreamLimits
from protos import encoder_pb2 as pb
from receiver import EncoderReceiver
from testkit import REPO_ROOT
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.servers import running_server, wait_until

NUM_TOKENS = 1792  # x 2048 bf16: a 7 MiB item
ITEM_BYTES = NUM_TOKENS * 2048 * 2
MiB = 1 << 20
# A client that never reads: without BDP probing its HTTP/2 window stays at 64 KiB, so gRPC cannot
# take a 7 MiB payload off the server into the client's own buffers either.
NEVER_READS = [("grpc.http2.bdp_probe", 0)]


def encode_request(request_id: str, width: int = 8) -> pb.EncodeRequest:
    return pb.EncodeRequest(request_id=request_id, items=[pb.ImageItem(index=0, modality=pb.IMAGE, data=image_bytes(width, 8))])


async def open_unread(channels: list[grpc.aio.Channel], n: int) -> tuple[list, collections.Counter]:
    """Starts n Encode calls that read the first message only; returns them and how each began."""
    calls = [
        channels[i % len(channels)].unary_stream(
            "/encoder.v1.EncoderService/Encode",
            request_serializer=pb.EncodeRequest.SerializeToString,
            response_deserializer=pb.EncodeResponse.FromString,
        )(encode_request(f"unread-{i}"), timeout=120)
        for i in range(n)
    ]

    async def first(call) -> str:
        try:
            return "header" if (await call.read()).HasField("header") else "chunk"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    return calls, collections.Counter(await asyncio.gather(*(first(call) for call in calls)))


@pytest.fixture
async def small_budget_server(default_model_dir):
    # Room for three streams of one cached item: the call that computes it is charged twice (the
    # output and its chunks), the two that share it once each.
    limits = StreamLimits(max_bytes=4 * ITEM_BYTES + MiB, stall_timeout_s=4.0)
    async with running_server(
        default_model_dir, encoder=EncoderDouble(tokens=NUM_TOKENS), dtype=torch.bfloat16, streams=limits
    ) as server:
        yield server


async def test_unread_streams_are_bounded_refused_then_cut_and_readers_are_still_served(small_budget_server):
    server = small_budget_server
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READS) for _ in range(4)]
    try:
        calls, began = await open_unread(channels, 12)
        assert began == {"header": 3, "RESOURCE_EXHAUSTED": 9}
        assert 3 * ITEM_BYTES <= server.streams.held <= server.streams.limits.max_bytes
        # A reader arriving once those streams have waited past EVICT_AFTER_S takes their room.
        await asyncio.sleep(EVICT_AFTER_S + 0.5)
        async with EncoderReceiver([server.url]) as rx:
            result = await rx.encode("reader", [{"data": image_bytes(9, 8)}])
        assert torch.equal(result.items[0].embedding, server.encoder.output(9).embedding)
        assert server.streams.stalled == 3 and server.streams.peak <= server.streams.limits.max_bytes
        # Unread streams left alone are cut after the stall timeout.
        more, began = await open_unread(channels, 2)
        assert began == {"header": 2}
        assert await wait_until(lambda: server.streams.stalled == 5 and server.streams.held == 0)
        for call in calls + more:
            call.cancel()
    finally:
        for channel in channels:
            await channel.close()


async def test_over_long_free_text_fields_are_refused_naming_the_field(small_budget_server):
    server = small_budget_server
    request = encode_request("x" * 1_000_000)
    too_long_url = pb.EncodeRequest(
        request_id="url", items=[pb.ImageItem(index=0, modality=pb.IMAGE, url="file:///" + "a" * 10_000)]
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        encode = channel.unary_stream(
            "/encoder.v1.EncoderService/Encode", request_serializer=pb.EncodeRequest.SerializeToString
        )
        for bad, field in ((request, "request_id is 1000000 characters"), (too_long_url, "url is 10008 characters")):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await encode(bad, timeout=30).read()
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in raised.value.details()
        headers = [m async for m in encode(encode_request("ok"), timeout=30)]  # and it keeps serving
        assert len(headers) == 8  # a header and seven 1 MiB chunks


SERVER_SCRIPT = """
import asyncio, sys
import torch
from encoder_common.malloc import tune_malloc
from encoder_server.models import ImageEmbedding
from encoder_server.server import EncoderServer
from encoder_server.batcher import BatchingConfig
from encoder_server.streams import StreamLimits
from testkit.encoders import EncoderDouble
from testkit.servers import server_config

class FreshEncoder(EncoderDouble):
    # A new tensor per item, as a real forward makes: nothing is shared between calls.
    def encode(self, batch):
        return [ImageEmbedding(out.embedding.clone()) for out in super().encode(batch)]

tune_malloc()  # as the encoder-server CLI does: freed heap memory stays in the RSS, peaks show

async def main():
    config = server_config(
        sys.argv[1], dtype=torch.bfloat16, cache_bytes=0, batching=BatchingConfig(max_batch_images=4),
        streams=StreamLimits(max_bytes=int(sys.argv[2]), stall_timeout_s=5.0),
    )
    server = EncoderServer(config, encoder=FreshEncoder(tokens=int(sys.argv[3])))
    await server.start()
    print(server.port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def memory_mib(pid: int) -> dict[str, float]:
    """The process's resident set now and at its peak (VmRSS, VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


async def test_a_thousand_never_reading_clients_keep_the_server_within_its_budget(default_model_dir):
    budget = 64 * MiB
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(default_model_dir), str(budget), str(NUM_TOKENS)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        url = f"grpc://127.0.0.1:{port}"
        async with EncoderReceiver([url]) as rx:
            for i in range(8):  # the steady state of serving readers: heap, gRPC buffers, threads
                await rx.encode(f"warm-{i}", [{"data": image_bytes(8 + i, 8)}])
            before = memory_mib(server.pid)
            channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=NEVER_READS) for _ in range(20)]

            async def reader() -> int:
                served = 0
                for i in range(10):
                    result = await rx.encode(f"reader-{i}", [{"data": image_bytes(20 + i, 8)}], timeout=60)
                    served += result.items[0].embedding.numel() * 2 == ITEM_BYTES
                    await asyncio.sleep(0.3)
                return served

            (calls, began), served = await asyncio.gather(open_unread(channels, 1000), reader())
            after = memory_mib(server.pid)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            for call in calls:
                call.cancel()
            for channel in channels:
                await channel.close()
        assert sum(began.values()) == 1000 and set(began) <= {"header", "RESOURCE_EXHAUSTED"}
        assert began["RESOURCE_EXHAUSTED"] >= 900  # most were refused at once, not computed and held
        assert served == 10 and health.status == health_pb2.HealthCheckResponse.SERVING
        # Growth at the peak: the budget; gRPC's copies of the messages in flight, up to as much again;
        # what gRPC keeps of each cut stream until its client goes (RESIDUE_BYTES); one batch of fresh
        # outputs (4 x 7 MiB); 48 MiB for 1000 calls' own state. Without the budget, the thousand calls
        # held 7 GB of outputs.
        grown = after["VmHWM"] - before["VmRSS"]
        cut = began["header"]
        assert grown < (2 * budget + cut * RESIDUE_BYTES + 4 * ITEM_BYTES) / MiB + 48, (before, after, cut)
        print(f"1000 never-reading clients: {cut} admitted, server RSS grew {grown:.0f} MiB at its peak")
    finally:
        server.kill()
        server.wait()
