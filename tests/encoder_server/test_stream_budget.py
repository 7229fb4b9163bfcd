"""Streams nobody reads cannot take the server's memory: payload bytes held for streams in progress stay
within the stream buffer budget, stalled streams are cut, and readers keep being served."""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import subprocess
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_common.errors import OverloadedError
from encoder_server.payload import FIRST_CHUNKS_BYTES, ItemPayload
from encoder_server.streams import (
    CALL_BYTES,
    CALL_STATE_BYTES,
    CONNECTION_SHARE,
    EVICT_AFTER_S,
    StreamBudget,
    StreamCut,
    StreamLimits,
)
from protos import encoder_pb2 as pb
from protos import wire
from receiver import EncoderReceiver
from testkit import REPO_ROOT
from testkit.bare_grpc import NEVER_READS, OWN_CONNECTION
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.servers import running_server, wait_until

NUM_TOKENS = 1792  # x 2048 bf16: a 7 MiB item
ITEM_BYTES = NUM_TOKENS * 2048 * 2
MiB = 1 << 20


def encode_request(request_id: str, width: int = 8) -> pb.EncodeRequest:
    item = pb.ImageItem(index=0, modality=pb.IMAGE, data=image_bytes(width, 8))
    return pb.EncodeRequest(request_id=request_id, items=[item])


async def open_unread(channels: list[grpc.aio.Channel], widths: range) -> tuple[list, collections.Counter]:
    """Starts an Encode call per image width that reads the first message only; returns the calls and
    how each began."""
    calls = [
        channels[i % len(channels)].unary_stream(
            "/encoder.v1.EncoderService/Encode",
            request_serializer=pb.EncodeRequest.SerializeToString,
            response_deserializer=pb.EncodeResponse.FromString,
        )(encode_request(f"unread-{width}", width), timeout=120)
        for i, width in enumerate(widths)
    ]

    async def first(call) -> str:
        try:
            return "header" if (await call.read()).HasField("header") else "chunk"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    return calls, collections.Counter(await asyncio.gather(*(first(call) for call in calls)))


# What a never-reading receiver's cut stream leaves inside gRPC: the call's state and the message it
# was sending, the item's second chunk (the header and the first fit the 64 KiB window, that one does
# not), or the rest of the first 1 MiB chunk after it where the client's window update let that one
# through. Which of the two depends on when the update lands, so the test allows either for each call.
CUT_RESIDUE = CALL_STATE_BYTES + len(next(wire.chunk_messages(memoryview(bytes(FIRST_CHUNKS_BYTES[1])))))
LARGER_RESIDUE = CALL_STATE_BYTES + len(
    next(wire.chunk_messages(memoryview(bytes(wire.CHUNK_BYTES - sum(FIRST_CHUNKS_BYTES)))))
)


def small_budget_server_at(model_dir, stall_timeout_s: float = 4.0, **overrides):
    # Room for three calls computing a 7 MiB item each (the output and its chunks: twice its size).
    limits = StreamLimits(max_bytes=3 * (2 * ITEM_BYTES + CALL_BYTES) + MiB, stall_timeout_s=stall_timeout_s)
    double = EncoderDouble(tokens=NUM_TOKENS)
    return running_server(model_dir, encoder=double, dtype=torch.bfloat16, streams=limits, **overrides)


@pytest.fixture
async def small_budget_server(default_model_dir):
    async with small_budget_server_at(default_model_dir) as server:
        yield server


async def test_stalled_streams_are_cut_and_charged_for_what_they_leave_in_grpc_until_their_call_is_over(
    small_budget_server,
):
    server = small_budget_server
    budget = server.streams
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READS) for _ in range(8)]
    calls, admitted = [], 0
    try:
        # Waves of never-reading callers of distinct items: each wave takes the room of the one before
        # (whose receivers have read nothing for EVICT_AFTER_S), and the streams cut stay charged.
        for wave in range(6):
            opened, began = await open_unread(channels, range(100 + 10 * wave, 106 + 10 * wave))
            calls += opened
            assert set(began) <= {"header", "RESOURCE_EXHAUSTED"} and 1 <= began["header"] <= 3, began
            admitted += began["header"]
            await asyncio.sleep(EVICT_AFTER_S + 0.3)
        # A reader takes the room of the last wave, and is served in full.
        async with EncoderReceiver([server.url]) as rx:
            result = await rx.encode("reader", [{"data": image_bytes(9, 8)}])
        assert torch.equal(result.items[0].embedding, server.encoder.output(9).embedding)
        assert budget.stalled == budget.cut_calls == admitted >= 6
        # Every cut call holds its state and the chunk it left inside gRPC: nothing else.
        larger, rest = divmod(budget.held - admitted * CUT_RESIDUE, LARGER_RESIDUE - CUT_RESIDUE)
        assert rest == 0 and 0 <= larger <= admitted, (budget.held, admitted)
        assert budget.peak <= budget.limits.max_bytes
        # Unread streams left alone are cut after the stall timeout, with no call needing their room.
        more, began = await open_unread(channels, range(200, 202))
        calls += more
        assert began == {"header": 2}
        assert await wait_until(lambda: budget.stalled == admitted + 2, timeout=30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # Once their receivers go, their calls are over and give back what they held.
        for call in calls:
            call.cancel()
        assert await wait_until(lambda: budget.held == 0 and budget.cut_calls == 0, timeout=30), budget.held
    finally:
        for channel in channels:
            await channel.close()


async def test_a_cut_stream_lets_its_payload_go_while_its_last_message_stays_inside_grpc(default_model_dir):
    """Cut streams give their payloads back in memory too, not only in the budget's count: with no cache
    to keep them, nothing holds the payload of an item whose stream was cut, though the message gRPC
    was sending stays there until the receiver goes."""
    async with small_budget_server_at(default_model_dir, stall_timeout_s=1.0, cache_bytes=0) as server:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READS) for _ in range(2)]
        try:
            calls, began = await open_unread(channels, range(100, 102))
            cut = began["header"]
            assert cut >= 1 and set(began) <= {"header", "RESOURCE_EXHAUSTED"}, began
            assert await wait_until(lambda: server.streams.cut_calls == cut, timeout=30)
            await asyncio.sleep(0.1)  # the cut handlers unwind
            gc.collect()
            assert [o for o in gc.get_objects() if type(o) is ItemPayload] == []
            # Still charged: each call's state and the message it left inside gRPC (either of the two).
            larger, rest = divmod(server.streams.held - cut * CUT_RESIDUE, LARGER_RESIDUE - CUT_RESIDUE)
            assert rest == 0 and 0 <= larger <= cut, server.streams.held
            for call in calls:
                call.cancel()
            assert await wait_until(lambda: server.streams.held == 0, timeout=30)
        finally:
            for channel in channels:
                await channel.close()


async def test_a_connection_that_reads_is_served_from_the_quarter_never_readers_cannot_take(
    default_model_dir, monkeypatch
):
    # No stream is cut in this test, for room or by the watchdog, however slow the machine: only the
    # reserved quarter can let the reader in, and the unread calls hold the rest until they are cancelled.
    monkeypatch.setattr("encoder_server.streams.EVICT_AFTER_S", 3600.0)
    async with small_budget_server_at(default_model_dir, stall_timeout_s=3600.0) as server:
        budget = server.streams
        target = f"127.0.0.1:{server.port}"
        channels = [grpc.aio.insecure_channel(target, options=NEVER_READS) for _ in range(4)]
        try:
            async with EncoderReceiver([server.url]) as rx:
                await rx.encode("first", [{"data": image_bytes(9, 8)}])  # its connection has read a call
                calls, began = await open_unread(channels, range(100, 104))
                assert began == {"header": 2, "RESOURCE_EXHAUSTED": 2}  # three quarters: two 15 MiB calls
                result = await rx.encode("reader", [{"data": image_bytes(10, 8)}])
                assert torch.equal(result.items[0].embedding, server.encoder.output(10).embedding)
                assert rx.metrics.snapshot()["retries"] == {}
            # A connection of its own that has read nothing yet (gRPC would otherwise share the receiver's).
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=OWN_CONNECTION) as fresh:
                _, began = await open_unread([fresh], range(11, 12))
            assert budget.stalled == 0 and began == {"RESOURCE_EXHAUSTED": 1}, (budget.stalled, began)
            for call in calls:
                call.cancel()
            assert await wait_until(lambda: budget.held == 0, timeout=30), budget.held
        finally:
            for channel in channels:
                await channel.close()


async def test_a_reader_with_more_items_in_flight_than_its_share_waits_for_room_and_is_never_refused(
    small_budget_server,
):
    # Three quarters of this budget hold two computed 7 MiB items: eight at once from one prefill node
    # wait for the room the earlier ones give back as they are read.
    server = small_budget_server
    budget = server.streams
    async with EncoderReceiver([server.url]) as rx:
        await rx.encode("first", [{"data": image_bytes(9, 8)}])  # its connection has read a call
        widths = range(20, 28)
        results = await asyncio.gather(
            *(rx.encode(f"burst-{width}", [{"data": image_bytes(width, 8)}]) for width in widths)
        )
        assert rx.metrics.snapshot()["retries"] == {}
    for width, result in zip(widths, results):
        assert torch.equal(result.items[0].embedding, server.encoder.output(width).embedding)
    assert budget.refused == 0 and budget.waited >= 1, (budget.refused, budget.waited)
    assert budget.peak <= budget.limits.max_bytes
    assert await wait_until(lambda: budget.held == 0, timeout=30), budget.held


async def never_reading_waves(channels: list[grpc.aio.Channel], waves: int, per_wave: int) -> list:
    """Waves of never-reading calls for distinct items, each wave once the one before has read nothing for
    EVICT_AFTER_S (so a call needing room may cut them); returns the calls."""
    calls = []
    for wave in range(waves):
        opened, _ = await open_unread(channels, range(1000 + per_wave * wave, 1000 + per_wave * (wave + 1)))
        calls += opened
        await asyncio.sleep(EVICT_AFTER_S + 0.2)
    return calls


async def served_afresh(server, width: int) -> float:
    """Seconds a reader on a connection of its own (one that has read nothing yet) takes to be served
    one item in full, back-offs after RESOURCE_EXHAUSTED included."""
    started = time.perf_counter()
    async with EncoderReceiver([server.url], timeout=30) as rx:
        result = await rx.encode(f"fresh-{width}", [{"data": image_bytes(width, 8)}])
    assert torch.equal(result.items[0].embedding, server.encoder.output(width).embedding)
    return time.perf_counter() - started


@pytest.mark.parametrize("connections", [1, 200], ids=["on-one-connection", "on-200-connections"])
async def test_never_reading_streams_do_not_lock_a_fresh_connection_out(default_model_dir, connections):
    """200 never-reading streams, on one connection or each on its own, left open: every fresh reader is
    served within seconds, one connection never holds more than its share, the budget never passes."""
    async with small_budget_server_at(default_model_dir, stall_timeout_s=3600.0) as server:
        budget, full = server.streams, server.streams.limits.max_bytes
        target = f"127.0.0.1:{server.port}"
        channels = [grpc.aio.insecure_channel(target, options=NEVER_READS) for _ in range(connections)]
        try:
            calls = await never_reading_waves(channels, waves=5, per_wave=40)
            assert budget.stalled >= 3 and budget.leftover > 0  # the unread streams were cut, and left their chunks
            if connections == 1:
                (peer,) = [p for p in budget._by_peer if budget.held_by(p) >= budget.leftover]
                assert budget.held_by(peer) <= full // CONNECTION_SHARE, (budget.held_by(peer), full)
            for width in (11, 12, 13):  # each on a connection of its own that has read nothing
                assert await served_afresh(server, width) < 10.0
                calls += (await open_unread(channels, range(2000 + width * 40, 2000 + width * 40 + 40)))[0]
            assert budget.peak <= full
            for call in calls:
                call.cancel()
            assert await wait_until(lambda: budget.held == budget.leftover == 0, timeout=30), budget.held
        finally:
            for channel in channels:
                await channel.close()


async def test_one_connection_holds_half_the_budget_and_cut_leftovers_leave_the_rest_to_fresh_connections():
    budget = StreamBudget(StreamLimits(max_bytes=8 * CALL_BYTES))
    pending: list[asyncio.Future] = []

    async def call(peer: str, cut_after: asyncio.Event | None = None) -> None:
        async with budget.call(peer):
            if cut_after is None:
                await asyncio.Event().wait()  # a call in progress, until cancelled
            await cut_after.wait()
            # Cut while a 1 MiB chunk was pending inside gRPC: the call keeps holding it until the chunk goes.
            pending.append(asyncio.get_running_loop().create_future())
            raise StreamCut(pending[-1], wire.CHUNK_BYTES, "cut in a test")

    async def admitted(peer: str, n: int, cut_after: asyncio.Event | None = None) -> list[asyncio.Task]:
        tasks = [asyncio.ensure_future(call(peer, cut_after)) for _ in range(n)]
        await asyncio.sleep(0.05)
        return [task for task in tasks if not task.done() or task.exception() is None]

    # A never-reading connection with any number of streams holds half the budget at most.
    cut = asyncio.Event()
    stalled = await admitted("ipv4:10.0.0.1:1000", 20, cut)
    cut_calls = list(stalled)
    assert len(stalled) == 8 // CONNECTION_SHARE and budget.held_by("ipv4:10.0.0.1:1000") == 4 * CALL_BYTES
    # Cut, its streams hold what they left in gRPC and no more calls of it fit, but a fresh connection's do.
    cut.set()
    await asyncio.sleep(0.05)
    assert budget.leftover == budget.held == 4 * (CALL_STATE_BYTES + wire.CHUNK_BYTES)
    assert not await admitted("ipv4:10.0.0.1:1000", 1)
    # Many connections' leftovers past three quarters of the budget: a fresh one is admitted while the whole has room.
    more = asyncio.Event()
    for port in range(1001, 1004):
        cut_calls += await admitted(f"ipv4:10.0.0.1:{port}", 1, more)
    more.set()
    await asyncio.sleep(0.05)
    assert budget.leftover > 6 * CALL_BYTES  # three quarters
    (fresh,) = await admitted("ipv4:10.0.0.2:2000", 1)
    assert not await admitted("ipv4:10.0.0.2:2001", 1)  # and once the whole budget is held, nobody
    with pytest.raises(OverloadedError, match="this one holds 0"):
        async with budget.call("ipv4:10.0.0.2:2002"):
            pass
    fresh.cancel()
    for write in pending:
        write.set_result(None)  # the chunks go: the cut calls end with RESOURCE_EXHAUSTED
    await asyncio.sleep(0.05)
    # A connection that reads holds three quarters at most, so even once all its streams are cut, what
    # they leave inside gRPC lets a fresh connection in.
    budget._read_to_the_end("ipv4:10.0.0.3:3000")
    late_cut = asyncio.Event()
    reading = await admitted("ipv4:10.0.0.3:3000", 8, late_cut)
    # Six hold their room; the other two wait for room (a connection that reads is not refused at once).
    assert budget.held_by("ipv4:10.0.0.3:3000") == 6 * CALL_BYTES and budget.waiting == 2
    assert len(reading) == 8 and not any(task.done() for task in reading)
    for waiting in reading[6:]:
        waiting.cancel()
    cut_calls += reading[:6]
    late_cut.set()
    await asyncio.sleep(0.05)
    assert budget.leftover == budget.held == 6 * (CALL_STATE_BYTES + wire.CHUNK_BYTES)
    (fresh,) = await admitted("ipv4:10.0.0.2:2003", 1)
    fresh.cancel()
    for write in pending[-6:]:
        write.set_result(None)
    ended = await asyncio.gather(*cut_calls, return_exceptions=True)
    assert all(isinstance(end, OverloadedError) and "the stream was cut" in str(end) for end in ended)
    assert budget.held == budget.leftover == budget.waiting == 0 and not budget._by_peer


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
        assert len(headers) == 10  # a header, chunks of 32 KiB and 64 KiB, and seven more up to 1 MiB


def test_the_stalled_clients_script_holds_its_checks_on_a_small_run(default_model_dir):
    """scripts/stalled_clients.py, the full-size check of docs/reliability-security.md, on two dozen clients."""
    run = subprocess.run(
        [sys.executable, "scripts/stalled_clients.py", "--clients", "24", "--wave", "12", "--hold-s", "1",
         "--encoder", "made-up", "--model", str(default_model_dir), "--max-growth-gib", "1"],  # fmt: skip
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert sum(summary["stalled_began"].values()) == 24 and summary["reader_served"] >= 1
    assert not summary["reader_failed"] and not summary["health_not_serving"]


def test_a_payload_starts_with_small_chunks_for_a_connection_not_known_to_read_and_one_left_half_sent_keeps_chunks_only():
    tensor = torch.arange(3 * MiB // 4, dtype=torch.int32)  # 3 MiB
    payload = ItemPayload(pb.ItemHeader(), [tensor])
    reader = payload.chunks(small_first=True)
    sizes = [len(wire.parse_response(next(reader))) for _ in range(3)]
    assert sizes == [*FIRST_CHUNKS_BYTES, MiB - sum(FIRST_CHUNKS_BYTES)]
    payload.finish_framing()  # the stream stopped after three chunks
    assert payload._parts is None  # the tensor is let go: the chunks hold the payload, once
    rest = list(reader)  # a caller still streaming it gets the remaining chunks all the same
    sizes += [len(wire.parse_response(chunk)) for chunk in rest]
    assert sizes == [32 << 10, 64 << 10, MiB - (96 << 10), MiB, MiB]
    # A connection that reads gets the kept 1 MiB chunks from the first; both carry the same bytes.
    assert [len(wire.parse_response(c)) for c in payload.chunks()] == [MiB] * 3
    for small_first in (True, False):
        data = b"".join(bytes(wire.parse_response(c)) for c in payload.chunks(small_first=small_first))
        assert data == tensor.numpy().tobytes()


async def test_every_release_wakes_a_waiting_reader_at_once_however_releases_and_wake_ups_interleave():
    # A reader holds twelve calls' worth (its share of a sixteen-call budget); as many more of its calls
    # as may wait do. The holders end together and each admitted waiter ends as soon as it starts, so
    # releases land while other waiters are waking up: each waiter must be admitted by a release, never
    # by the EVICT_AFTER_S timer that also wakes waiters.
    budget = StreamBudget(StreamLimits(max_bytes=16 * CALL_BYTES))
    peer = "ipv4:10.0.0.4:4000"
    budget._read_to_the_end(peer)
    end = asyncio.Event()

    async def held() -> None:
        async with budget.call(peer):
            await end.wait()

    async def waiter() -> float:
        async with budget.call(peer):
            return time.monotonic()

    holders = [asyncio.ensure_future(held()) for _ in range(12)]
    await asyncio.sleep(0.01)
    waiters = [asyncio.ensure_future(waiter()) for _ in range(16)]
    await asyncio.sleep(0.01)
    assert budget.waiting == 16
    released = time.monotonic()
    end.set()
    admitted = await asyncio.gather(*waiters)
    await asyncio.gather(*holders)
    assert max(admitted) - released < EVICT_AFTER_S / 4, max(admitted) - released
    assert budget.held == budget.waiting == budget.refused == 0 and budget.waited == 16


async def test_a_forward_is_charged_before_it_runs_and_goes_on_uncharged_for_a_call_that_joined_it_once_its_own_went(
    default_model_dir, monkeypatch
):
    """A computed item's forward waits for room (its connection reads) or is refused (it does not) with no
    forward run; when the call it was computed for goes away while another call waits for the same image,
    it runs for that one, and nothing stays charged for the call that went."""
    monkeypatch.setattr("encoder_server.streams.EVICT_AFTER_S", 3600.0)  # no stream is cut for room
    async with small_budget_server_at(default_model_dir, stall_timeout_s=3600.0) as server:
        budget, double = server.streams, server.encoder
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READS) as reading,
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READS) as fresh,
        ):
            encode, encode_fresh = (
                channel.unary_stream(
                    "/encoder.v1.EncoderService/Encode",
                    request_serializer=pb.EncodeRequest.SerializeToString,
                    response_deserializer=pb.EncodeResponse.FromString,
                )
                for channel in (reading, fresh)
            )
            assert len([m async for m in encode(encode_request("first", 9), timeout=60)]) > 1  # it reads
            # Two unread calls of that connection hold 30 MiB: the last few MiB of its 35 MiB share are left.
            holders = [encode(encode_request(f"hold-{width}", width), timeout=120) for width in (20, 21)]
            for holder in holders:
                assert (await holder.read()).HasField("header")
            forwarded, preprocessed = double.items_forwarded, double.preprocessed
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await encode_fresh(encode_request("refused", 22), timeout=60).read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (double.items_forwarded, double.preprocessed) == (forwarded, preprocessed + 1)
            own = encode(encode_request("own", 30), timeout=120)
            assert await wait_until(lambda: budget.waiting == 1, timeout=30)  # its forward waits for room
            hits = server.cache.hits
            joined = encode(encode_request("joined", 30), timeout=120)
            assert await wait_until(lambda: server.cache.hits == hits + 1, timeout=30)  # it waits for that forward
            assert double.items_forwarded == forwarded
            own.cancel()
            assert await wait_until(lambda: double.items_forwarded == forwarded + 1, timeout=30)
            for holder in holders:
                holder.cancel()
            messages = [m async for m in joined]
            assert messages[0].header.cache_hit and sum(len(m.chunk) for m in messages[1:]) == ITEM_BYTES
            assert double.preprocessed == preprocessed + 2
        assert await wait_until(lambda: budget.held == 0 and budget.open_calls == 0, timeout=30), budget.held
