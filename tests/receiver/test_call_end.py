"""A call's items go on at their last byte: the receiver returns a request whose items have all arrived
on the stream without waiting for the call's end, which its endpoint reads after (the status, the load
report in the trailing metadata, any message past the last item). Closing the receiver waits for those
ends, so an encoder sees its finished calls complete, not cancelled. The encoder here is a real gRPC
server speaking the Encode wire format, whose handler holds its call open after the last item."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch

from encoder_common.load_report import LoadReport
from protos import encoder_pb2 as pb
from protos import wire
from receiver import EncoderReceiver
from testkit.servers import wait_until

HIDDEN, TOKENS = 64, 40
ENCODE = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name


class HeldOpenEncoder:
    """Answers each Encode item with its index as every value (bf16), then holds the call open until
    `release` is set; `extra` sends one more header after the last item. A request that offers shared
    memory is answered as a server without --shm-transfer answers it (SHM_DISABLED in each header).
    Records how each call ended, and how many offered shared memory."""

    def __init__(self, extra: bool = False):
        self.extra = extra
        self.release = asyncio.Event()
        self.ends: list[str] = []
        self.shm_offers = 0
        self.server = grpc.aio.server()
        handler = grpc.unary_stream_rpc_method_handler(self.encode)
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(ENCODE, {"Encode": handler})]
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    async def encode(self, raw: bytes, context: grpc.aio.ServicerContext):
        request = pb.EncodeRequest.FromString(raw)
        offered = request.HasField("shm")
        self.shm_offers += offered
        try:
            for item in request.items:
                yield self.header(item.index, shm_disabled=offered)
                payload = torch.full((TOKENS, HIDDEN), float(item.index), dtype=torch.bfloat16)
                for chunk in wire.chunk_messages(wire.tensor_bytes(payload)):
                    yield chunk
            if self.extra:
                yield self.header(0)
            await self.release.wait()
            context.set_trailing_metadata(LoadReport(queued_work_s=0.25, item_s=0.01).metadata())
        except asyncio.CancelledError:
            self.ends.append("cancelled")
            raise
        self.ends.append("ok")

    @staticmethod
    def header(index: int, shm_disabled: bool = False) -> bytes:
        header = pb.ItemHeader(
            index=index,
            num_tokens=TOKENS,
            hidden_size=HIDDEN,
            dtype=pb.BFLOAT16,
            payload_bytes=TOKENS * HIDDEN * 2,
        )
        if shm_disabled:
            header.shm.fallback = pb.SHM_DISABLED
        return pb.EncodeResponse(header=header).SerializeToString()


@pytest.fixture
async def held_open(request):
    encoder = HeldOpenEncoder(extra=getattr(request, "param", False))
    await encoder.server.start()
    yield encoder
    encoder.release.set()
    await encoder.server.stop(grace=None)


async def test_a_request_returns_at_its_last_byte_and_closing_waits_for_the_calls_end(held_open):
    receiver = EncoderReceiver([held_open.url], transfer="grpc")
    images = [b"image-%d" % i for i in range(3)]
    result = await asyncio.wait_for(receiver.encode("r", [{"data": data} for data in images]), timeout=3)
    assert not held_open.release.is_set() and held_open.ends == []  # the encoder still holds its call
    for index, item in enumerate(result.items):
        assert item.index == index and torch.equal(
            item.embedding, torch.full((TOKENS, HIDDEN), float(index)).bfloat16()
        )
    heard = receiver._fleet.load  # where the load report lands
    assert heard.queued_s(held_open.url) != pytest.approx(0.25, abs=0.05)  # not before the call's end
    closing = asyncio.create_task(receiver.close())
    await asyncio.sleep(0.2)
    assert not closing.done()  # waits for the call the encoder still holds
    held_open.release.set()
    await asyncio.wait_for(closing, timeout=5)
    assert held_open.ends == ["ok"]


async def test_a_call_whose_shared_memory_offer_was_declined_returns_at_its_last_byte(held_open):
    """transfer="auto" offers shared memory to an encoder that may share this host (a loopback address,
    or any name); one that declines streams every payload, so the call's items are whole at their last
    byte as on the stream alone."""
    receiver = EncoderReceiver([held_open.url])
    result = await asyncio.wait_for(
        receiver.encode("r", [{"data": b"image-%d" % i} for i in range(2)]), timeout=3
    )
    assert held_open.shm_offers == 1 and not held_open.release.is_set() and held_open.ends == []
    assert receiver.transfer_stats.fallbacks == {"disabled": 2} and receiver.transfer_stats.items_shm == 0
    for index, item in enumerate(result.items):
        assert torch.equal(item.embedding, torch.full((TOKENS, HIDDEN), float(index)).bfloat16())
    held_open.release.set()
    await asyncio.wait_for(receiver.close(), timeout=5)
    assert held_open.ends == ["ok"]


async def test_the_load_report_of_a_calls_end_is_heard_after_the_result(held_open):
    async with EncoderReceiver([held_open.url], transfer="grpc") as receiver:
        await receiver.encode("r", [{"data": b"image"}])
        held_open.release.set()
        load = receiver._fleet.load
        await wait_until(lambda: load.queued_s(held_open.url) > 0.1, timeout=2.0)
        assert load.queued_s(held_open.url) == pytest.approx(0.25, abs=0.1)
    assert held_open.ends == ["ok"]


@pytest.mark.parametrize("held_open", [True], indirect=True)
async def test_a_message_past_the_last_item_is_logged_and_ends_the_call(held_open, caplog):
    caplog.set_level(logging.WARNING, logger="receiver.channels")
    async with EncoderReceiver([held_open.url], transfer="grpc") as receiver:
        (item,) = (await receiver.encode("r", [{"data": b"image"}])).items
        assert torch.equal(item.embedding, torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16))
        await wait_until(lambda: bool(held_open.ends), timeout=2.0)
    assert held_open.ends == ["cancelled"]
    assert "a message after every item of its call had arrived" in caplog.text
