"""A call's items go on at their last byte: the receiver returns a request whose items have all arrived
on the stream without waiting for the call's end, which its endpoint reads after (the status, the load
report in the trailing metadata, any message past the last item). An item placed in shared memory is
whole at its header, and the receiver's from then on, whatever becomes of the call. Closing the
receiver waits for those ends, so an encoder sees its finished calls complete, not cancelled. The
encoder here is a real gRPC server speaking the Encode wire format, whose handler holds its call open
after the last item, and places payloads with the server's own shared-memory pool when given one."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch

from encoder_common.load_report import LoadReport
from encoder_server.payload import ItemPayload
from encoder_server.transports.shm import ShmConfig
from encoder_server.transports.shm.call import ShmCall
from encoder_server.transports.shm.pool import ShmSegments
from protos import encoder_pb2 as pb
from protos import wire
from receiver import EncoderReceiver
from testkit.servers import wait_until

HIDDEN, TOKENS = 64, 40
ENCODE = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name


class HeldOpenEncoder:
    """Answers each Encode item with 10 x (the calls before it) + its index as every value (bf16), then
    holds the call open until `release` is set, and then completes it, or fails it (`fail`); `extra`
    sends one more header after the last item. A request that offers shared memory has its payloads
    placed by `segments` (the server's pool), or without one is answered as a server without
    --shm-transfer answers it (SHM_DISABLED in each header). Records how each call ended, and how many
    offered shared memory."""

    def __init__(self, extra: bool = False, segments: ShmSegments | None = None):
        self.extra = extra
        self.segments = segments
        self.fail = False
        self.release = asyncio.Event()
        self.ends: list[str] = []
        self.shm_offers = 0
        self.calls = 0
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
        shm = ShmCall(self.segments, request) if offered and self.segments is not None else None
        first_value = 10 * self.calls
        self.calls += 1
        try:
            for item in request.items:
                header = self.header(item.index, shm_disabled=offered and shm is None)
                payload = torch.full((TOKENS, HIDDEN), float(first_value + item.index), dtype=torch.bfloat16)
                placed = shm is not None and await shm.place(header, ItemPayload(header, [payload]))
                yield pb.EncodeResponse(header=header).SerializeToString()
                if not placed:  # no chunks follow a header that announces a segment
                    for chunk in wire.chunk_messages(wire.tensor_bytes(payload)):
                        yield chunk
            if self.extra:
                yield pb.EncodeResponse(header=self.header(0)).SerializeToString()
            await self.release.wait()
            if self.fail:
                self.ends.append("failed")
                await context.abort(grpc.StatusCode.INTERNAL, "failed after its last item")
            context.set_trailing_metadata(LoadReport(queued_work_s=0.25, item_s=0.01).metadata())
            if shm is not None:
                shm.hand_over()
        except asyncio.CancelledError:
            self.ends.append("cancelled")
            raise
        finally:
            if shm is not None:
                shm.close()  # takes the segments back unless handed over
        self.ends.append("ok")

    @staticmethod
    def header(index: int, shm_disabled: bool = False) -> pb.ItemHeader:
        header = pb.ItemHeader(
            index=index,
            num_tokens=TOKENS,
            hidden_size=HIDDEN,
            dtype=pb.BFLOAT16,
            payload_bytes=TOKENS * HIDDEN * 2,
        )
        if shm_disabled:
            header.shm.fallback = pb.SHM_DISABLED
        return header


@pytest.fixture
async def held_open(request):
    encoder = HeldOpenEncoder(extra=getattr(request, "param", False))
    await encoder.server.start()
    yield encoder
    encoder.release.set()
    await encoder.server.stop(grace=None)


@pytest.fixture
async def placing():
    """A held-open encoder that places payloads in shared memory with the server's pool."""
    segments = ShmSegments(ShmConfig(min_bytes=0))
    await segments.start()
    encoder = HeldOpenEncoder(segments=segments)
    await encoder.server.start()
    yield encoder
    encoder.release.set()
    await encoder.server.stop(grace=None)
    await segments.stop(wait_s=0)


def filled(value: int) -> torch.Tensor:
    return torch.full((TOKENS, HIDDEN), float(value)).bfloat16()


async def test_a_request_returns_at_its_last_byte_and_closing_waits_for_the_calls_end(held_open):
    receiver = EncoderReceiver([held_open.url], transfer="grpc")
    images = [b"image-%d" % i for i in range(3)]
    result = await asyncio.wait_for(receiver.encode("r", [{"data": data} for data in images]), timeout=3)
    assert not held_open.release.is_set() and held_open.ends == []  # the encoder still holds its call
    for index, item in enumerate(result.items):
        assert item.index == index and torch.equal(item.embedding, filled(index))
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
        assert torch.equal(item.embedding, filled(index))
    held_open.release.set()
    await asyncio.wait_for(receiver.close(), timeout=5)
    assert held_open.ends == ["ok"]


async def test_a_call_whose_payloads_were_placed_in_shared_memory_returns_at_its_last_header(placing):
    receiver = EncoderReceiver([placing.url], transfer="shm")
    images = [{"data": b"image-%d" % i} for i in range(2)]
    result = await asyncio.wait_for(receiver.encode("r", images), timeout=3)
    assert not placing.release.is_set() and placing.ends == []  # the encoder still holds its call
    assert receiver.transfer_stats.items_shm == 2
    for index, item in enumerate(result.items):
        assert torch.equal(item.embedding, filled(index))
    placing.release.set()
    await asyncio.wait_for(receiver.close(), timeout=5)
    assert placing.ends == ["ok"] and placing.segments.stats.reclaimed_cancel == 0


async def test_placed_payloads_stay_the_receivers_when_their_call_fails_after_its_last_header(placing):
    """The encoder takes back the segments of a call that did not complete; one a result still maps is
    never written again, so the result keeps its values while later calls' items are placed."""
    placing.fail = True
    receiver = EncoderReceiver([placing.url], transfer="shm")
    images = [{"data": b"image-%d" % i} for i in range(2)]
    first = await asyncio.wait_for(receiver.encode("r1", images), timeout=3)
    placing.release.set()
    await wait_until(lambda: placing.ends == ["failed"], timeout=2.0)
    assert placing.segments.stats.reclaimed_cancel == 2
    placing.fail = False
    second = await asyncio.wait_for(receiver.encode("r2", images), timeout=3)
    assert receiver.transfer_stats.items_shm == 4
    for index in range(2):
        assert torch.equal(first.items[index].embedding, filled(index))
        assert torch.equal(second.items[index].embedding, filled(10 + index))
    await asyncio.wait_for(receiver.close(), timeout=5)


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
    caplog.set_level(logging.WARNING, logger="receiver.fleet.channels")
    async with EncoderReceiver([held_open.url], transfer="grpc") as receiver:
        (item,) = (await receiver.encode("r", [{"data": b"image"}])).items
        assert torch.equal(item.embedding, torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16))
        await wait_until(lambda: bool(held_open.ends), timeout=2.0)
    assert held_open.ends == ["cancelled"]
    assert "a message after every item of its call had arrived" in caplog.text
