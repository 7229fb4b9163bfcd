"""The transfer-engine path: real Mooncake engines (TCP on loopback) in an encoder server process and the
receiver's. The stream's bytes for every payload layout; every call answered (through the engine, as
chunks, or with a typed error) whatever fails; no slot reused under a result or while a write may
land; the pool's memory bounded."""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
import pytest
import torch

from encoder_common.mooncake_engine import unavailable
from encoder_server.batcher import BatchingConfig
from encoder_server.transports.mooncake import MooncakeConfig
from protos import encoder_pb2 as pb
from protos import wire
from receiver import EncoderReceiver, ShardError
from receiver.config import MooncakeReceiverConfig, ReceiverConfig
from receiver.transports import Placement
from receiver.transports.mooncake import MooncakeReceiver
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.launcher import start_process
from testkit.results import assert_same_bytes
from testkit.servers import running_server, wait_until

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no transfer engine here: {unavailable()}")

# 600 tokens x 2048 bf16 and one deepstack layer: 4.9 MB an item.
TOKENS, HIDDEN = 600, 2048
ITEM_BYTES = 2 * TOKENS * HIDDEN * 2
ENCODE = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name


def items(n: int, first_width: int = 8) -> list[dict]:
    """Images of distinct widths: the server's stand-in tower gives each its own embedding."""
    return [{"modality": "image", "data": image_bytes(first_width + i, 8, seed=i)} for i in range(n)]


def engine_receiver(urls: list[str], **pool) -> EncoderReceiver:
    return EncoderReceiver(urls, transfer="mooncake", mooncake=MooncakeReceiverConfig(**pool))


def start_fixed(tmp_path, *flags: str, tokens: int = TOKENS, env: dict[str, str] | None = None):
    """A server process whose stand-in tower answers `tokens` x HIDDEN bf16 rows (and one deepstack layer)."""
    fixed = [sys.executable, "-m", "testkit.fixed_server", str(tokens), str(HIDDEN), "--deepstack", "1"]
    return start_process([*fixed, *flags], tmp_path / f"fixed-{len(list(tmp_path.iterdir()))}.log", env=env)


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    server = start_fixed(tmp_path_factory.mktemp("engine"), "--mooncake", "--no-shm")
    yield server
    server.stop(grace_s=10)


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    server = start_fixed(tmp_path_factory.mktemp("plain"), "--no-shm")
    yield server
    server.stop(grace_s=10)


async def test_items_arrive_through_the_engine_with_the_streams_bytes(engine_server):
    async with EncoderReceiver([engine_server.url], transfer="grpc") as rx:
        over_grpc = await rx.encode("grpc", items(5))
        wanted = [await rx.encode(f"g{i}", items(2, first_width=20 + 2 * i)) for i in range(6)]
    async with engine_receiver([engine_server.url]) as rx:
        over_engine = await rx.encode("engine", items(5))
        concurrent = await asyncio.gather(
            *(rx.encode(f"c{i}", items(2, first_width=20 + 2 * i)) for i in range(6))
        )
        stats = rx.transfer_stats
    assert_same_bytes(over_engine, over_grpc)
    for got, want in zip(concurrent, wanted):
        assert_same_bytes(got, want)
    placed = 5 + 12 - stats.fallbacks["mooncake_pool_full"] - stats.fallbacks["mooncake_no_slot"]
    assert stats.items_mooncake == placed >= 8 and stats.bytes_mooncake == placed * ITEM_BYTES
    assert set(stats.fallbacks) <= {"mooncake_pool_full", "mooncake_no_slot"}  # 8 slots for 17 results held


# Every family's payload has one layout: the embedding [tokens, hidden] and, for Qwen3-VL and Qwen3.5,
# deepstack layers of the same shape after it, in the served dtype (bf16, fp16 or fp32); token counts
# and widths vary (LLaVA's 577 rows keep the CLS token).
LAYOUTS = [
    pytest.param(torch.bfloat16, 0, 600, 2048, id="qwen2_5_vl-bf16"),
    pytest.param(torch.bfloat16, 3, 600, 2048, id="qwen3_vl-deepstack-bf16"),
    pytest.param(torch.float16, 0, 577, 4096, id="llava-fp16"),
    pytest.param(torch.float32, 3, 64, 1536, id="qwen3_5-deepstack-fp32"),
]


@pytest.mark.parametrize(("dtype", "deepstack", "tokens", "hidden"), LAYOUTS)
async def test_every_payload_layout_arrives_as_the_streams_bytes(
    default_model_dir, dtype, deepstack, tokens, hidden
):
    encoder = EncoderDouble(tokens=tokens, hidden_size=hidden, dtype=dtype, num_deepstack_layers=deepstack)
    async with running_server(
        default_model_dir, encoder=encoder, dtype=dtype, mooncake=MooncakeConfig(min_bytes=0)
    ) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            over_grpc = await rx.encode("grpc", items(3))
        async with engine_receiver([server.url]) as rx:
            over_engine = await rx.encode("engine", items(3))
            assert rx.transfer_stats.items_mooncake == 3 and not rx.transfer_stats.fallbacks
    assert_same_bytes(over_engine, over_grpc)
    assert over_engine.items[0].embedding.dtype == dtype and (over_engine.items[0].deepstack is None) == (
        deepstack == 0
    )


async def test_a_real_towers_items_arrive_as_the_streams_bytes(default_model_dir):
    # One image per forward, so both runs compute each item alike; 700x700 is 625 tokens x 2048 fp32 = 5.1 MB.
    images = [{"data": image_bytes(w, h, seed=w)} for w, h in [(28, 28), (640, 480), (700, 700)]]
    async with running_server(
        default_model_dir, mooncake=MooncakeConfig(min_bytes=0), batching=BatchingConfig(max_batch_images=1)
    ) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            over_grpc = await rx.encode("grpc", images)
        async with engine_receiver([server.url]) as rx:
            over_engine = await rx.encode("engine", images)
            assert rx.transfer_stats.items_mooncake == 3 and not rx.transfer_stats.fallbacks
    assert over_engine.items[-1].embedding.numel() * 4 > 4 << 20
    assert_same_bytes(over_engine, over_grpc)


async def test_leased_items_fetch_through_the_engine_into_the_callers_tensor_freeing_the_slot(
    default_model_dir,
):
    """Fetch (the vLLM connector's path) offers the engine too; a caller's own tensor takes a copy."""
    images = [{"data": image_bytes(64, 48, seed=1)}, {"data": image_bytes(96, 64, seed=2)}]
    async with (
        running_server(default_model_dir, mooncake=MooncakeConfig(min_bytes=0)) as server,
        engine_receiver([server.url], slots=2) as rx,
    ):
        encoded = await rx.encode("r", images, lease_ms=30_000)
        # Both slots are under `encoded`'s items: these fetches' payloads come as chunks.
        fetched = await rx.fetch("f", encoded.items[0].lease.key)
        assert torch.equal(fetched.embedding, encoded.items[0].embedding)
        given = []

        def allocate(shape, dtype):
            given.append(torch.empty(shape, dtype=dtype))
            return given[-1]

        copied = await rx.fetch("g", encoded.items[1].lease.key, allocate=allocate)
        assert copied.embedding.data_ptr() == given[0].data_ptr()
        assert torch.equal(copied.embedding, encoded.items[1].embedding)
        assert rx.transfer_stats.items_mooncake == 2 and rx.transfer_stats.fallbacks == {
            "mooncake_pool_full": 2
        }
        del encoded, fetched
        encoded = await rx.encode("r2", images[:1], lease_ms=30_000)
        copied = await rx.fetch("h", encoded.items[0].lease.key, allocate=allocate)
        assert torch.equal(copied.embedding, encoded.items[0].embedding)
        assert rx.transfer_stats.items_mooncake == 4  # through a slot, copied out and freed at once
        del encoded
        assert rx._transport.pool.counts() == (2, 0)


async def test_a_full_pool_sends_the_rest_as_chunks_and_slots_under_results_are_never_rewritten(
    engine_server,
):
    async with EncoderReceiver([engine_server.url], transfer="grpc") as rx:
        want = await rx.encode("grpc", items(4))
        later = [await rx.encode(f"g{i}", items(1, first_width=30 + i)) for i in range(6)]
    async with engine_receiver([engine_server.url], slots=2) as rx:
        kept = await rx.encode("kept", items(4))  # 2 slots for 4 items: 2 through the engine, 2 as chunks
        assert (
            rx.transfer_stats.fallbacks == {"mooncake_no_slot": 2} and rx.transfer_stats.items_mooncake == 2
        )
        assert rx._transport.pool.counts() == (0, 0)  # both under `kept`'s tensors
        blocked = await rx.encode("blocked", items(1, first_width=30))
        assert rx.transfer_stats.fallbacks["mooncake_pool_full"] == 1
        assert_same_bytes(blocked, later[0])
        del blocked
        held = kept.items[0].embedding.clone()
        kept.items = kept.items[:1]  # frees the second item's slot, whose tensor was the only one on it
        for i in range(6):  # each call writes the freed slot again, never the one under `kept`'s item 0
            assert_same_bytes(await rx.encode(f"again-{i}", items(1, first_width=30 + i)), later[i])
        assert torch.equal(kept.items[0].embedding, held) and torch.equal(held, want.items[0].embedding)
        del kept
        assert await wait_until(lambda: rx._transport.pool.counts() == (2, 0))


class Interposer:
    """A gRPC server in front of an encoder that forwards Encode and changes what crosses it: `wrong_token`
    replaces the offer's token with another one before the encoder sees it (the encoder then writes with a
    key the receiver never gave), `replay` answers a call with the headers of the call before it (whose
    payloads the encoder wrote under that call's token)."""

    def __init__(self, target: str):
        self.channel = grpc.aio.insecure_channel(target)
        self.forward = self.channel.unary_stream(f"/{ENCODE}/Encode")
        self.mode = "wrong_token"
        self.last: list[bytes] = []
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    ENCODE, {"Encode": grpc.unary_stream_rpc_method_handler(self.encode)}
                )
            ]
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def encode(self, raw: bytes, context):
        request = pb.EncodeRequest.FromString(raw)
        if self.mode == "wrong_token" and request.HasField("mooncake"):
            request.mooncake.token = bytes(32)
        messages = [message async for message in self.forward(request.SerializeToString())]
        if self.mode == "replay" and request.HasField("mooncake") and self.last:
            messages, self.last = self.last, messages
        else:
            self.last = messages
        for message in messages:
            yield message


@pytest.fixture
async def interposer(engine_server):
    proxy = Interposer(f"127.0.0.1:{engine_server.port}")
    await proxy.server.start()
    yield proxy
    await proxy.server.stop(0)
    await proxy.channel.close()


@pytest.mark.parametrize("mode", ["wrong_token", "replay"])
async def test_a_placement_under_another_token_is_refused_and_the_item_fetched_over_the_stream(
    engine_server, interposer, mode
):
    interposer.mode = mode
    url = f"grpc://127.0.0.1:{interposer.port}"
    async with EncoderReceiver([engine_server.url], transfer="grpc") as rx:
        want = await rx.encode("grpc", items(2))
    async with engine_receiver([url], slots=4, late_write_s=0.5) as rx:
        if mode == "replay":  # the call whose headers the next one gets
            first = await rx.encode("first", items(2))
            assert rx.transfer_stats.items_mooncake == 2
            assert_same_bytes(first, want)
        got = await rx.encode("refused", items(2))
        assert rx.transfer_stats.fallbacks == {"mooncake_bad_placement": 2}
        assert_same_bytes(got, want)  # fetched again over the stream
        if mode == "replay":
            assert_same_bytes(first, want)  # the replayed slots were not the refused call's
            del first
        # The refused call's slots may have been written by whoever holds their token: out of use a while.
        assert rx._transport.pool.counts()[1] == 2
        del got
        assert await wait_until(lambda: rx._transport.pool.counts() == (4, 0), timeout=10)


async def test_strict_against_a_server_without_the_engine_is_a_typed_error_and_auto_uses_the_stream(
    plain_server,
):
    async with engine_receiver([plain_server.url]) as rx:
        with pytest.raises(ShardError, match="without --mooncake-transfer") as raised:
            await rx.encode("strict", items(2))
    assert raised.value.encoder_url == plain_server.url
    transport = MooncakeReceiver(strict=False, config=ReceiverConfig())
    try:
        request = pb.EncodeRequest(
            request_id="r", items=[pb.ImageItem(index=0, modality=pb.IMAGE, data=items(1)[0]["data"])]
        )
        reader = transport.open_call(request, plain_server.url, 1)
        assert len(request.mooncake.slots) == 1 and transport.pool.counts() == (7, 0)
        (header,) = await headers_of(plain_server.url, request)
        assert header.mooncake.fallback == pb.MOONCAKE_DISABLED
        assert reader(header) == (Placement.CHUNKS, None)
        transport.end_call(reader, complete=True)
        assert transport.pool.counts() == (8, 0)
        again = pb.EncodeRequest(request_id="r2")
        assert transport.open_call(again, plain_server.url, 1) is None and not again.HasField(
            "mooncake"
        )  # declined lately
        assert transport.stats.fallbacks == {"mooncake_disabled": 1}
    finally:
        transport.close()


async def headers_of(url: str, request: pb.EncodeRequest) -> list[pb.ItemHeader]:
    """The item headers of one Encode call (chunks skipped)."""
    async with grpc.aio.insecure_channel(url.removeprefix("grpc://")) as channel:
        call = channel.unary_stream(f"/{ENCODE}/Encode")(request.SerializeToString())
        return [
            part async for message in call if not isinstance(part := wire.parse_response(message), memoryview)
        ]


@pytest.mark.parametrize(
    ("field", "value"),
    [("protocol", "rdma"), ("session", "127.0.0.2:{port}"), ("token", b"short"), ("session", "no-port")],
)
async def test_an_offer_the_server_cannot_take_is_refused_and_served_as_chunks(engine_server, field, value):
    transport = MooncakeReceiver(strict=False, config=ReceiverConfig())
    try:
        request = pb.EncodeRequest(
            request_id="r", items=[pb.ImageItem(index=0, modality=pb.IMAGE, data=items(1)[0]["data"])]
        )
        reader = transport.open_call(request, engine_server.url, 1)
        port = request.mooncake.session.rpartition(":")[2]
        setattr(request.mooncake, field, value.format(port=port) if isinstance(value, str) else value)
        (header,) = await headers_of(engine_server.url, request)
        assert header.mooncake.fallback == pb.MOONCAKE_OFFER_REFUSED and not header.mooncake.mac
        assert reader(header) == (Placement.CHUNKS, None) and transport.stats.fallbacks == {
            "mooncake_offer_refused": 1
        }
        transport.end_call(reader, complete=True)
        assert transport.pool.counts() == (8, 0)  # nothing was written: the slot is free at once
    finally:
        transport.close()


async def test_auto_offers_the_engine_once_an_encoder_shows_it_is_on_another_host(tmp_path):
    elsewhere = tmp_path / "another-hosts-shm"  # the server's shared memory is not this receiver's
    elsewhere.mkdir()
    server = start_fixed(tmp_path, "--mooncake", env={"ENCODER_SHM_DIR": str(elsewhere)})
    try:
        async with EncoderReceiver([server.url]) as rx:  # transfer="auto"
            first = await rx.encode("first", items(2))
            assert (
                rx.transfer_stats.fallbacks == {"probe_unreadable": 2}
                and rx.transfer_stats.items_mooncake == 0
            )
            second = await rx.encode("second", items(2))
            assert rx.transfer_stats.items_mooncake == 2 and rx.transfer_stats.fallbacks == {
                "probe_unreadable": 2
            }
        assert_same_bytes(second, first)
    finally:
        server.stop(grace_s=10)


async def test_auto_offers_nothing_for_a_while_to_an_encoder_on_this_host_without_shared_memory(plain_server):
    async with EncoderReceiver([plain_server.url]) as rx:  # transfer="auto"
        first = await rx.encode("first", items(2))
        assert rx.transfer_stats.fallbacks == {"disabled": 2}
        second = await rx.encode("second", items(2))
        assert rx.transfer_stats.fallbacks == {"disabled": 2}  # no offer this time, so no header says no
    assert_same_bytes(second, first)


async def test_a_server_killed_mid_write_fails_over_and_its_slots_come_back_later(tmp_path):
    big = 4 * TOKENS  # 9.8 MB items: a call of 4 spends a while writing
    doomed, survivor = (
        start_fixed(tmp_path, "--mooncake", tokens=big),
        start_fixed(tmp_path, "--mooncake", tokens=big),
    )
    try:
        async with EncoderReceiver(
            [survivor.url], transfer="grpc"
        ) as rx:  # one item a call: the stream's budget
            want = [(await rx.encode(f"g{i}", [item])).items[0] for i, item in enumerate(items(8))]
        async with engine_receiver([doomed.url, survivor.url], slots=8, late_write_s=1.0) as rx:
            arrived = asyncio.Event()
            original = rx._transport.open_call

            def watch(request, url, n):
                reader = original(request, url, n)

                def read(header):
                    placed = reader(header)
                    if url == doomed.url:
                        arrived.set()
                    return placed

                return read if url == doomed.url else reader

            rx._transport.open_call = watch
            call = asyncio.create_task(rx.encode("killed", items(8), timeout=60))  # 4 items on each
            await asyncio.wait_for(arrived.wait(), 60)
            doomed.process.send_signal(signal.SIGKILL)  # mid-call: its next items are being written
            got = await call
            for item, wanted in zip(got.items, want):  # the killed encoder's unfinished items re-placed
                assert torch.equal(item.embedding, wanted.embedding) and torch.equal(
                    item.deepstack, wanted.deepstack
                )
            assert {result.encoder_url for result in got.items} >= {survivor.url}
            del got, item, call  # the task keeps its result
            assert rx._transport.pool.quarantines >= 1  # the killed call's open slots, for late_write_s
            assert await wait_until(lambda: rx._transport.pool.counts() == (8, 0), timeout=20), (
                rx._transport.pool.counts()
            )
    finally:
        doomed.stop()
        survivor.stop(grace_s=10)


@pytest.mark.xfail(
    strict=False,
    reason="on the merged main, now and then the first write never lands (within 60 s under load; the engine logged "
    "'Local segment descriptor not found'); open in issue 52",
)
async def test_a_receiver_closing_while_writes_are_in_flight_leaves_the_server_serving(tmp_path):
    server = start_fixed(tmp_path, "--mooncake", tokens=8 * TOKENS)
    try:
        rx = engine_receiver([server.url], slots=8)
        call = asyncio.create_task(rx.encode("closing", items(6)))
        assert await wait_until(lambda: rx.transfer_stats.items_mooncake >= 1, timeout=20)  # ~1 s when it lands
        call.cancel()
        await rx.close()  # the engine stops while the server may still be writing into it
        with pytest.raises(asyncio.CancelledError):
            await call
        async with EncoderReceiver([server.url], transfer="grpc") as grpc_rx:
            want = await grpc_rx.encode("grpc", items(2, first_width=40))
        async with engine_receiver([server.url]) as again:
            assert_same_bytes(await again.encode("again", items(2, first_width=40)), want)
            assert again.transfer_stats.items_mooncake == 2
        assert server.process.poll() is None
    finally:
        server.stop(grace_s=10)


async def test_the_engine_also_writes_from_registered_staging_memory(default_model_dir):
    """The RDMA path's staging copy (NICs read registered memory only), run here over TCP."""
    encoder = EncoderDouble(tokens=TOKENS, hidden_size=HIDDEN, num_deepstack_layers=1)
    config = MooncakeConfig(staging=True, write_threads=2)
    async with running_server(
        default_model_dir, encoder=encoder, mooncake=config, batching=BatchingConfig()
    ) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            want = await rx.encode("grpc", items(6))
        async with engine_receiver([server.url]) as rx:
            got = await asyncio.gather(*(rx.encode(f"s{i}", [items(6)[i]]) for i in range(6)))
            assert rx.transfer_stats.items_mooncake == 6
    for i, result in enumerate(got):
        assert torch.equal(result.items[0].embedding, want.items[i].embedding)
        assert torch.equal(result.items[0].deepstack, want.items[i].deepstack)
    assert len(server.transports["mooncake"]._staged) <= 2  # one buffer per write thread
