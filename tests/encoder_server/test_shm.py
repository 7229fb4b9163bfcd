"""The same-host shared-memory path: identical bytes, bounded, no leaks whoever dies, private, and
refused when it does not match the stream."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import stat
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch

import encoder_server.transports.shm.pool
from encoder_common.copies import SPLIT_FROM, copy_bytes, copy_parts
from encoder_common.shm_files import create_locked, shm_dir, sweep_stale
from encoder_server.batcher import BatchingConfig
from encoder_server.transports.shm import ShmConfig, ShmSegments
from protos import encoder_pb2 as pb
from protos import wire
from protos.shm import SERVER_KIND, item_proof, new_instance, random_name, segment_header
from receiver import EncoderReceiver, ShardError, SharedMemoryUnavailableError
from receiver.buffers import BufferPool
from receiver.fleet.channels import EncoderEndpoint
from receiver.transports import Placement
from receiver.transports.shm import ShmReceiver
from receiver.transports.stream import StreamTransport
from testkit import REPO_ROOT
from testkit.encoders import EncoderDouble
from testkit.images import image_bytes
from testkit.results import assert_same_bytes
from testkit.launcher import launch_server
from testkit.servers import running_server, wait_until
from testkit.shm_dirs import small_shm_dir

# 600 tokens x 2048 bf16, plus one deepstack layer: 4.9 MB, over gRPC's 4 MiB message limit.
NUM_TOKENS = 600
ITEM_BYTES = 2 * NUM_TOKENS * 2048 * 2
NOBODY = 65534
# Long enough for an unheld forward's item to arrive on a loaded machine; what must miss it is held.
DEADLINE_S = 8.0


def fixed_encoder(**kwargs) -> EncoderDouble:
    return EncoderDouble(tokens=NUM_TOKENS, num_deepstack_layers=1, **kwargs)


def items(n: int, first_width: int = 8) -> list[dict]:
    """Images of distinct widths: the double gives each its own embedding."""
    return [{"modality": "image", "data": image_bytes(first_width + i, 8, seed=i)} for i in range(n)]


def files_of(instance: str) -> list[str]:
    return sorted(name for name in os.listdir(shm_dir()) if name.startswith(instance + "."))


def segments_of(instance: str) -> list[str]:
    return [name for name in files_of(instance) if ".seg." in name]


def offer_request(request_id: str, shm: ShmReceiver, n: int, width: int = 8) -> pb.EncodeRequest:
    return pb.EncodeRequest(
        request_id=request_id,
        items=[
            pb.ImageItem(index=i, modality=pb.IMAGE, data=image_bytes(width + i, width)) for i in range(n)
        ],
        shm=shm.offer(),
    )


@pytest.fixture(scope="module")
async def shm_server(default_model_dir):
    async with running_server(
        default_model_dir, encoder=fixed_encoder(), shm=ShmConfig(release_timeout_s=5.0)
    ) as server:
        yield server


@pytest.fixture(scope="module")
async def slow_server(default_model_dir):
    """One item per forward, each waiting for the test's leave: calls are still running when a test
    cuts them off, however slow the machine."""
    held = fixed_encoder()
    batching = BatchingConfig(max_batch_images=1)
    async with running_server(default_model_dir, encoder=held, shm=ShmConfig(), batching=batching) as server:
        server.forwards = held
        yield server


async def cache_first_item(endpoint: EncoderEndpoint, request: pb.EncodeRequest) -> None:
    """Encodes `request`'s item 0 alone, so that the server's cache answers it at once: forwards held
    next hold the other items only. (Holding forwards by item cannot do that: a call's items reach the one
    forward worker in the order their preprocessing ends, and a held forward stops the worker.)"""
    async for _ in endpoint.encode(pb.EncodeRequest(request_id="warm", items=[request.items[0]]), timeout=60):
        pass


async def settle(server) -> None:
    """Lets every held forward finish and waits until the server has nothing queued or running."""
    server.forwards.release()
    assert await wait_until(lambda: server._batcher.queue_depth == 0 and server.forwards.running == 0)


@pytest.fixture(scope="module")
async def plain_server(default_model_dir):
    async with running_server(default_model_dir, encoder=fixed_encoder()) as server:
        yield server


async def test_real_model_results_are_byte_identical_to_the_grpc_stream(default_model_dir):
    # One image per forward, so both runs compute each item alike; 700x700 is 625 tokens x 2048 fp32 = 5.1 MB.
    images = [{"data": image_bytes(w, h, seed=w)} for w, h in [(28, 28), (640, 480), (700, 700)]]
    async with running_server(  # min_bytes=0: the 32 KiB item through a segment too
        default_model_dir, shm=ShmConfig(min_bytes=0), batching=BatchingConfig(max_batch_images=1)
    ) as server:
        async with EncoderReceiver([server.url], transfer="shm") as rx:
            over_shm = await rx.encode("shm", images)
            stats = rx.transfer_stats
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            over_grpc = await rx.encode("grpc", images)
        assert server.transports["shm"].stats.items == 3 and len(server.transports["shm"].outstanding()) == 3  # under the results
        assert stats.items_shm == 3 and stats.items_grpc == 0
        assert over_shm.items[-1].embedding.numel() * 4 > 4 << 20
        assert_same_bytes(over_shm, over_grpc)
        del over_shm
        assert server.transports["shm"].outstanding() == []


async def test_bf16_with_deepstack_is_byte_identical_and_lands_in_each_items_slot(shm_server):
    encoder = shm_server.encoder
    async with EncoderReceiver([shm_server.url], transfer="grpc") as rx:
        over_grpc = await rx.encode("grpc", items(5))
    async with EncoderReceiver([shm_server.url]) as rx:  # "auto"
        over_shm = await rx.encode("auto", items(5))
        concurrent = await asyncio.gather(
            *(rx.encode(f"c{i}", items(3, first_width=20 + i)) for i in range(6))
        )
        stats = rx.transfer_stats
    assert_same_bytes(over_shm, over_grpc)
    assert over_shm.items[0].deepstack.shape == (1, NUM_TOKENS, 2048)
    for i, result in enumerate(concurrent):
        for k, item in enumerate(result.items):
            want = encoder.output(20 + i + k)
            assert torch.equal(item.embedding, want.embedding) and torch.equal(item.deepstack, want.deepstack)
    assert stats.items_shm == 5 + 18 and stats.bytes_shm == 23 * ITEM_BYTES and not stats.fallbacks


async def test_results_are_views_of_their_segments_that_outlive_the_call_and_free_them_when_gone(
    default_model_dir,
):
    """The zero-copy result is an ordinary tensor: kept, changed in place, pickled, kept past the
    receiver's close; its segment is never rewritten while it lives, and released when it goes."""
    async with running_server(default_model_dir, encoder=fixed_encoder(), shm=ShmConfig()) as server:
        instance = server.transports["shm"].instance
        async with EncoderReceiver([server.url], transfer="shm") as rx:
            kept = (await rx.encode("kept", items(1))).items[0]
            assert len(segments_of(instance)) == 1  # held by `kept`
            want = server.encoder.output(8)
            for i in range(4):  # every later item needs another segment: `kept`'s is not reused
                (other,) = (await rx.encode(f"other-{i}", items(1, first_width=30 + i))).items
                assert torch.equal(other.embedding, server.encoder.output(30 + i).embedding)
            del other
            assert len(segments_of(instance)) == 1 and server.transports["shm"].outstanding() == [segments_of(instance)[0]]
        assert torch.equal(kept.embedding, want.embedding) and torch.equal(kept.deepstack, want.deepstack)
        assert torch.equal(pickle.loads(pickle.dumps(kept.embedding)), want.embedding)
        kept.embedding.mul_(2)  # in place, like any tensor
        assert torch.equal(kept.embedding, want.embedding * 2)
        del kept
        assert await wait_until(lambda: segments_of(instance) == [] and server.transports["shm"].outstanding() == [])
        assert server.transports["shm"].stats.reclaimed_timeout == 0 and server.transports["shm"].stats.reclaimed_cancel == 0


async def test_a_segment_held_past_the_release_timeout_leaves_the_pool_and_stays_intact(default_model_dir):
    async with running_server(
        default_model_dir, encoder=fixed_encoder(), shm=ShmConfig(release_timeout_s=0.5)
    ) as server:
        async with EncoderReceiver([server.url], transfer="shm") as rx:
            kept = (await rx.encode("kept", items(1))).items[0]
            assert await wait_until(lambda: server.transports["shm"].stats.reclaimed_timeout == 1)
            assert segments_of(server.transports["shm"].instance) == [] and server.transports["shm"].pool_bytes == 0
            for i in range(3):  # new segments for these: the timed-out one is never written again
                await rx.encode(f"other-{i}", items(1, first_width=40 + i))
        assert torch.equal(kept.embedding, server.encoder.output(8).embedding)


async def test_no_segment_left_after_normal_use_and_nothing_after_stop(default_model_dir):
    async with running_server(default_model_dir, encoder=fixed_encoder(), shm=ShmConfig()) as server:
        instance = server.transports["shm"].instance
        async with EncoderReceiver([server.url], transfer="shm") as rx:
            for n in (1, 4):
                await rx.encode(f"n{n}", items(n))
            probe = rx._transport.probe
            assert probe in os.listdir(shm_dir())
            assert segments_of(instance) == [] and server.transports["shm"].outstanding() == []
            assert server.transports["shm"].stats.released == 5
            assert any(".pool." in name for name in files_of(instance))  # kept warm for reuse
        assert probe not in os.listdir(shm_dir())
    assert files_of(instance) == []


async def test_budget_bounds_segments_and_items_beyond_it_go_over_grpc(default_model_dir):
    # One item's segment is 6 MiB (rounded up): a 7 MiB budget holds one at a time, 1 MiB none.
    async with running_server(
        default_model_dir, encoder=fixed_encoder(), shm=ShmConfig(max_bytes=7 << 20)
    ) as server:
        async with EncoderReceiver([server.url], transfer="grpc") as rx:
            want = await rx.encode("grpc", items(6))
        async with EncoderReceiver(
            [server.url], transfer="shm"
        ) as rx:  # proven per-item fallback is no error
            got = await rx.encode("shm", items(6))
            stats = rx.transfer_stats
        assert server.transports["shm"].stats.peak_bytes <= 7 << 20 and server.transports["shm"].pool_bytes <= 7 << 20
    assert_same_bytes(got, want)
    assert stats.items_shm >= 1 and stats.items_shm + stats.fallbacks["budget_full"] == 6
    assert set(stats.fallbacks) <= {"budget_full"}

    async with running_server(
        default_model_dir, encoder=fixed_encoder(), shm=ShmConfig(max_bytes=1 << 20)
    ) as server:
        async with EncoderReceiver([server.url]) as rx:
            got = await rx.encode("tiny", items(6))
            stats = rx.transfer_stats
        assert server.transports["shm"].stats.peak_bytes == 0 and server.transports["shm"].stats.fallbacks == {"budget_full": 6}
    assert_same_bytes(got, want)
    assert stats.items_shm == 0 and stats.fallbacks == {"budget_full": 6}


async def test_shm_mode_fails_and_auto_falls_back_when_the_server_lacks_shm_transfer(
    plain_server, shm_server
):
    async with EncoderReceiver([plain_server.url], transfer="shm") as rx:
        with pytest.raises(ShardError) as raised:
            await rx.encode("strict", items(2))
    assert "without --shm-transfer" in str(raised.value) and raised.value.encoder_url == plain_server.url
    async with EncoderReceiver([plain_server.url]) as rx:
        got = await rx.encode("auto", items(2))
        assert rx.transfer_stats.fallbacks == {"disabled": 2} and rx.transfer_stats.items_shm == 0
    async with EncoderReceiver([shm_server.url], transfer="grpc") as rx:
        assert_same_bytes(got, await rx.encode("grpc", items(2)))
        assert isinstance(rx._transport, StreamTransport)
    with pytest.raises(ValueError, match="transfer must be one of"):
        EncoderReceiver([plain_server.url], transfer="tcp")


async def test_a_server_that_cannot_see_the_probe_is_not_used(default_model_dir, tmp_path):
    # The server's segments live elsewhere than the receiver's probe: as if on another host.
    elsewhere = tmp_path / "other-host-shm"
    elsewhere.mkdir()
    config = ShmConfig(directory=elsewhere)
    async with running_server(default_model_dir, encoder=fixed_encoder(), shm=config) as server:
        async with EncoderReceiver([server.url]) as rx:
            await rx.encode("auto", items(2))
            assert rx.transfer_stats.fallbacks == {"probe_unreadable": 2}
        async with EncoderReceiver([server.url], transfer="shm") as rx:
            with pytest.raises(ShardError, match="cannot read this receiver's probe"):
                await rx.encode("strict", items(2))
        assert server.transports["shm"].stats.items == 0


async def test_segments_are_owner_only_and_unguessable_and_the_offer_hides_the_token(shm_server):
    shm = ShmReceiver(strict=True)
    endpoint = EncoderEndpoint.connect(shm_server.url)
    request = offer_request("private", shm, 3)
    assert shm._token not in request.SerializeToString()  # the offer names the probe, never the token
    assert stat.S_IMODE(os.stat(shm_dir() / shm.probe).st_mode) == 0o600
    try:
        headers = [message async for message in endpoint.encode(request, timeout=30)]
        names = [header.shm.segment for header in headers]
        instance = shm_server.transports["shm"].instance
        assert len(set(names)) == 3
        for name in names:
            path = shm_dir() / name
            st = os.stat(path)
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
            random_part = name.removeprefix(f"{instance}.seg.")
            assert len(random_part) == 32 and int(random_part, 16) >= 0
            if os.geteuid() == 0:  # another user cannot read it
                other = subprocess.run(["cat", str(path)], user=NOBODY, capture_output=True, timeout=30)
                assert other.returncode != 0 and b"Permission denied" in other.stderr
            path.unlink()  # what a receiver does once it has the bytes
        assert shm_server.transports["shm"].outstanding() == []
    finally:
        await endpoint.close()
        shm.close()


async def test_segments_are_taken_back_when_the_client_cancels(slow_server):
    shm = ShmReceiver(strict=True)
    endpoint = EncoderEndpoint.connect(slow_server.url)
    request = offer_request("cancel", shm, 3)
    await cache_first_item(endpoint, request)
    slow_server.forwards.hold()  # item 0 comes from the cache, items 1 and 2 are held
    try:
        call = endpoint.encode(request, timeout=60)
        first = await call.read()  # the next item is held in its forward
        assert first.shm.segment in os.listdir(shm_dir())
        before = slow_server.transports["shm"].stats.reclaimed_cancel
        call.cancel()
        assert await wait_until(lambda: segments_of(slow_server.transports["shm"].instance) == [])
        assert slow_server.transports["shm"].stats.reclaimed_cancel - before >= 1 and slow_server.transports["shm"].outstanding() == []
    finally:
        await settle(slow_server)
        await endpoint.close()
        shm.close()


async def test_segments_are_taken_back_when_the_deadline_passes(slow_server):
    server = slow_server
    shm = ShmReceiver(strict=True)
    endpoint = EncoderEndpoint.connect(server.url)
    request = offer_request("deadline", shm, 4, width=16)  # images the cancel test did not send
    await cache_first_item(endpoint, request)
    server.forwards.hold()  # item 0 comes from the cache at once, the others are held past the deadline
    try:
        call = endpoint.encode(request, timeout=DEADLINE_S)
        first = await call.read()
        assert first.shm.segment in os.listdir(shm_dir())
        before = server.transports["shm"].stats.reclaimed_cancel
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            while await call.read() is not grpc.aio.EOF:  # headers only: nobody reads their segments
                pass
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await wait_until(lambda: segments_of(server.transports["shm"].instance) == [])
        assert server.transports["shm"].stats.reclaimed_cancel - before >= 1
    finally:
        await settle(server)
        await endpoint.close()
        shm.close()
    try:
        async with EncoderReceiver([server.url], transfer="shm") as rx:  # and through the receiver
            await rx.encode("warm", items(1, first_width=24))
            server.forwards.hold()
            with pytest.raises(ShardError) as raised:
                await rx.encode("deadline", items(4, first_width=24), timeout=DEADLINE_S)
    finally:
        await settle(server)
    assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await wait_until(lambda: segments_of(server.transports["shm"].instance) == [] and server.transports["shm"].outstanding() == [])


RECEIVER_SCRIPT = """
import asyncio, io, sys
from PIL import Image
from protos import encoder_pb2 as pb
from receiver.buffers import BufferPool
from receiver.fleet.channels import EncoderEndpoint
from receiver.transports.shm import ShmReceiver

def image_bytes(width, height):
    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, "PNG")
    return buf.getvalue()

async def main(url):
    shm = ShmReceiver(strict=True)
    endpoint = EncoderEndpoint.connect(url)
    def request(request_id, n):
        items = [pb.ImageItem(index=i, modality=pb.IMAGE, data=image_bytes(8 + i, 8)) for i in range(n)]
        return pb.EncodeRequest(request_id=request_id, items=items, shm=shm.offer())
    # A call read to its end whose segment is never read: only the server's timeout takes it back.
    whole = [m async for m in endpoint.encode(request("whole", 1))]
    print("segment", whole[0].shm.segment, flush=True)
    # A call that the SIGKILL cuts off mid-stream.
    call = endpoint.encode(request("cut", 3))
    print("segment", (await call.read()).shm.segment, flush=True)
    print("probe", shm.probe, flush=True)
    await asyncio.sleep(120)

asyncio.run(main(sys.argv[1]))
"""


async def test_receiver_sigkill_mid_transfer_server_reclaims_after_its_timeout(default_model_dir):
    # Long enough that the cut call's segment is still outstanding when the kill lands on a loaded machine.
    config = ShmConfig(release_timeout_s=5.0)
    held = fixed_encoder()
    async with running_server(
        default_model_dir, encoder=held, shm=config, batching=BatchingConfig(max_batch_images=1)
    ) as server:
        server.forwards = held
        # The whole call's forward passes; the cut call's item 0 is the same image, from the cache, and
        # its items 1 and 2 are held: the cut call is mid-stream.
        held.hold()
        held.release(forwards=1)
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", RECEIVER_SCRIPT, server.url, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
        )
        try:
            lines = []
            while not lines or lines[-1][0] != "probe":
                line = await asyncio.wait_for(child.stdout.readline(), timeout=60)
                assert line, "receiver process exited early"
                lines.append(line.decode().split())
            segments = [name for kind, name in lines if kind == "segment"]
            probe = lines[-1][1]
            assert all(name in os.listdir(shm_dir()) for name in [*segments, probe])
            child.send_signal(signal.SIGKILL)
            await child.wait()
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
        await settle(server)
        # The cut call's segment goes at once, the whole call's after 5 s, the probe at the next sweep.
        gone = lambda: not set([*segments, probe]) & set(os.listdir(shm_dir()))  # noqa: E731
        assert await wait_until(gone)
        stats = server.transports["shm"].stats
        assert stats.reclaimed_timeout >= 1 and stats.reclaimed_cancel >= 1
        assert server.transports["shm"].outstanding() == []


async def test_server_sigkill_leaves_files_that_receivers_and_the_next_server_remove(
    default_model_dir, tmp_path
):
    async def leave_segment_behind(launched) -> str:
        """An announced segment nobody reads, then SIGKILL: returns the dead server's instance."""
        shm = ShmReceiver(strict=True)
        endpoint = EncoderEndpoint.connect(launched.url)
        try:
            # 224x224 is 64 tokens x 2048 bf16: 256 KiB, well over the server's min_bytes
            header = await endpoint.encode(offer_request("left", shm, 2, width=224), timeout=60).read()
            launched.process.send_signal(signal.SIGKILL)
            launched.process.wait(timeout=30)
        finally:
            await endpoint.close()
            shm.close()
        instance = header.shm.segment.split(".seg.")[0]
        left = files_of(instance)
        assert f"{instance}.lock" in left and header.shm.segment in left and any(".pool." in n for n in left)
        return instance

    with launch_server(default_model_dir, "--shm-transfer", log_dir=tmp_path) as first:
        dead = await leave_segment_behind(first)
    ShmReceiver(strict=True).close()  # a receiver starting up removes a dead server's files
    assert files_of(dead) == []

    with launch_server(default_model_dir, "--shm-transfer", log_dir=tmp_path) as second:
        dead = await leave_segment_behind(second)
    async with running_server(default_model_dir, encoder=fixed_encoder(), shm=ShmConfig()):
        assert files_of(dead) == []  # the next server's start removed them


def mapped_files(instance: str) -> set[str]:
    """This process's mappings of the instance's files, by name (" (deleted)" once unlinked)."""
    with open("/proc/self/maps") as maps:
        return {line.split("/")[-1].strip() for line in maps if f"/{instance}." in line}


async def test_a_call_unmaps_what_a_gone_server_left_mapped_in_the_receiver(default_model_dir, monkeypatch):
    # The receiver keeps a server's segments mapped for reuse. Once their server is gone, that mapping alone
    # holds their memory on the shared-memory filesystem: on a small /dev/shm, enough for the next server
    # to find no room for a segment, so that no segment would come through again to free it.
    monkeypatch.setattr("receiver.transports.shm._FORGET_DROPPED_S", 0.0)
    shm = ShmReceiver(strict=True)

    async def one_item(url: str, request_id: str) -> Placement:
        """A call for one item, its header read as EncoderReceiver reads it."""
        item = pb.ImageItem(index=0, modality=pb.IMAGE, data=image_bytes(224, 224))
        request = pb.EncodeRequest(request_id=request_id, items=[item])
        take = shm.open_call(request, url, 1)
        endpoint = EncoderEndpoint.connect(url)
        try:
            responses = [message async for message in endpoint.encode(request, timeout=60)]
        finally:
            await endpoint.close()
        placement, payload = take(responses[0])
        del payload  # released to the server; the receiver keeps the segment mapped for the next item
        return placement

    try:
        async with running_server(default_model_dir, encoder=fixed_encoder(), shm=ShmConfig()) as first:
            instance = first.transports["shm"].instance
            assert await one_item(first.url, "first") is Placement.FILLED
        assert files_of(instance) == [] and mapped_files(instance)  # its files are gone, not their memory
        # The next server places nothing (as when it finds no room): the call alone must let go of them.
        no_room = ShmConfig(min_bytes=1 << 30)
        async with running_server(default_model_dir, encoder=fixed_encoder(), shm=no_room) as second:
            assert await one_item(second.url, "second") is Placement.CHUNKS
        assert mapped_files(instance) == set()
    finally:
        shm.close()


def test_sweep_removes_dead_instances_only(tmp_path):
    live = new_instance(SERVER_KIND)
    dead = new_instance(SERVER_KIND)
    live_fd = create_locked(tmp_path / f"{live}.lock")
    os.close(create_locked(tmp_path / f"{dead}.lock"))  # closing the fd drops the lock, as dying does
    for instance in (live, dead):
        (tmp_path / random_name(instance, "seg")).write_bytes(b"x")
    stranger = tmp_path / "someone-elses-file"
    stranger.write_bytes(b"y")
    before = set(os.listdir(tmp_path))
    try:
        removed = sweep_stale(tmp_path)
        remaining = set(os.listdir(tmp_path))
    finally:
        os.close(live_fd)
    assert len(removed) == 2 and set(removed) == {name for name in before if name.startswith(dead + ".")}
    assert remaining == before - set(removed) and len(remaining) == 3


class TestRefusal:
    """A receiver reads a segment only when it matches what the stream announced."""

    PAYLOAD = bytes(range(256)) * 2

    @pytest.fixture
    def shm(self):
        receiver = ShmReceiver(strict=False)
        yield receiver
        receiver.close()

    def announce(self, shm: ShmReceiver, *, mode: int = 0o600, payload: bytes = PAYLOAD, **segment_fields):
        """Item 3's header as the stream would send it, and its segment as a server would write it,
        with `segment_fields` of the segment's own header changed."""
        header = pb.ItemHeader(index=3, num_tokens=16, hidden_size=8, dtype=pb.FLOAT32, payload_bytes=512)
        name = random_name(new_instance(SERVER_KIND), "seg")
        proof = item_proof(shm._token, "req", 3, name, 512)
        header.shm.segment, header.shm.proof = name, proof
        written = pb.ItemHeader()
        written.CopyFrom(header)
        for key, value in segment_fields.items():
            setattr(written, key, value)
        path = shm_dir() / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        os.fchmod(fd, mode)
        os.write(fd, segment_header(written, proof) + payload)
        os.close(fd)
        return header, path

    def test_a_matching_segment_is_viewed_and_unlinked_once_its_tensor_is_gone(self, shm):
        header, path = self.announce(shm)
        placement, payload = shm.take("req", header)
        assert placement is Placement.FILLED and payload.numpy().tobytes() == self.PAYLOAD
        half = payload[256:]
        del payload
        assert path.exists()  # a view still uses the segment
        del half
        assert not path.exists()

    @pytest.mark.parametrize(
        "change, reason",
        [
            ({"payload": PAYLOAD[:300]}, "size_mismatch"),
            ({"index": 4}, "header_mismatch"),
            ({"num_tokens": 32}, "header_mismatch"),
            ({"payload_bytes": 511}, "header_mismatch"),
            ({"mode": 0o644}, "not_private"),
        ],
    )
    def test_a_mismatching_segment_is_refused_unread(self, shm, change, reason):
        header, path = self.announce(shm, **change)
        assert shm.take("req", header) == (Placement.REFETCH, None)
        assert shm.stats.fallbacks == {reason: 1} and not path.exists()  # released at once

    def test_a_missing_segment_or_a_wrong_proof_is_refused(self, shm):
        header, path = self.announce(shm)
        path.unlink()
        assert shm.take("req", header) == (Placement.REFETCH, None)
        header, path = self.announce(shm)
        assert shm.take("another request", header) == (Placement.REFETCH, None)  # the proof binds the request
        assert path.exists()  # an unproven name is not touched
        assert shm.stats.fallbacks == {"missing": 1, "bad_proof": 1}
        shm.strict = True
        with pytest.raises(SharedMemoryUnavailableError, match="proof does not match"):
            shm.take("another request", header)
        path.unlink()


async def test_refused_segments_are_fetched_again_over_the_stream(shm_server, monkeypatch):
    real = encoder_server.transports.shm.pool.segment_header

    def wrong_index(header, proof):
        shifted = pb.ItemHeader()
        shifted.CopyFrom(header)
        shifted.index += 1
        return real(shifted, proof)

    async with EncoderReceiver([shm_server.url], transfer="grpc") as rx:
        want = await rx.encode("grpc", items(3))
    monkeypatch.setattr(encoder_server.transports.shm.pool, "segment_header", wrong_index)
    async with EncoderReceiver([shm_server.url], transfer="shm") as rx:
        got = await rx.encode("refused", items(3))
        stats = rx.transfer_stats
    assert_same_bytes(got, want)
    assert stats.items_shm == 0 and stats.fallbacks == {"header_mismatch": 3}
    assert await wait_until(lambda: segments_of(shm_server.transports["shm"].instance) == [])


@pytest.mark.parametrize("nbytes", [SPLIT_FROM - 1, 3 * SPLIT_FROM + 7])
def test_a_payload_copy_split_across_threads_lands_every_byte_in_place(nbytes):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 2, dtype=np.uint8)
    copy_bytes(dst[1:-1], src)
    assert np.array_equal(dst[1:-1], src) and dst[0] == 0 and dst[-1] == 0


@pytest.mark.parametrize("sizes", [[1 << 20] * 7 + [5], [3, SPLIT_FROM + 1, 7, SPLIT_FROM // 2, 1]])
def test_parts_copied_back_to_back_across_threads_land_every_byte_in_place(sizes):
    """A cached payload's 1 MiB chunks, or parts of any sizes, split into shares across their edges."""
    src = np.random.default_rng(len(sizes)).integers(0, 256, sum(sizes), dtype=np.uint8)
    parts = np.split(src, np.cumsum(sizes)[:-1])
    dst = np.zeros(len(src) + 2, dtype=np.uint8)
    copy_parts(dst[1:-1], parts)
    assert np.array_equal(dst[1:-1], src) and dst[0] == 0 and dst[-1] == 0
    with pytest.raises(ValueError, match="copy of"):
        copy_parts(dst, parts)


def test_a_forked_child_copies_with_threads_of_its_own():
    src = np.random.default_rng(0).integers(0, 256, 2 * SPLIT_FROM, dtype=np.uint8)
    copy_bytes(np.empty_like(src), src)  # the parent's helper threads exist now
    pid = os.fork()
    if pid == 0:  # the child: a copy that waited on its parent's threads would never finish
        dst = np.empty_like(src)
        copy_bytes(dst, src)
        os._exit(0 if np.array_equal(dst, src) else 1)
    deadline = time.monotonic() + 30
    while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if waited == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert waited[0] == pid and os.waitstatus_to_exitcode(waited[1]) == 0


def test_receive_buffers_are_reused_only_once_every_view_is_gone():
    pool = BufferPool(max_idle_bytes=12 << 20)
    small = pool.empty((4, 8), torch.bfloat16)
    assert pool.idle_bytes == 0 and small.numel() == 32  # small ones are left to malloc
    shape = (2, 600, 2048)  # 4.9 MB of bf16
    tensor = pool.empty(shape, torch.bfloat16)
    tensor.fill_(1.5)
    address = tensor.data_ptr()
    embedding, deepstack = tensor[0], tensor[1:]  # what an ItemResult keeps
    del tensor, embedding
    assert pool.idle_bytes == 0  # deepstack still uses the memory
    other = pool.empty(shape, torch.bfloat16)
    assert other.data_ptr() != address and bool((deepstack == 1.5).all())
    del deepstack
    assert pool.idle_bytes == 6 << 20  # rounded up to whole huge pages
    again = pool.empty(shape, torch.bfloat16)
    assert again.data_ptr() == address and pool.idle_bytes == 0
    del other, again
    assert pool.idle_bytes == 12 << 20
    extra = [pool.empty(shape, torch.bfloat16) for _ in range(3)]
    del extra
    assert pool.idle_bytes == 12 << 20  # the third buffer over the bound is unmapped


@pytest.mark.skipif(os.geteuid() != 0, reason="giving segments to another user needs root")
async def test_a_root_server_gives_each_user_its_own_segments_never_one_anothers(tmp_path):
    segments = ShmSegments(ShmConfig(directory=tmp_path, min_bytes=0))
    await segments.start()
    payload = torch.arange(1024, dtype=torch.float32)
    try:

        def place(owner: int) -> tuple[int, int]:
            header = pb.ItemHeader(
                index=0, num_tokens=1, hidden_size=1024, dtype=pb.FLOAT32, payload_bytes=4096
            )
            assert segments.place(header, [wire.tensor_bytes(payload)], b"t" * 32, owner, "req") is not None
            st = os.stat(tmp_path / header.shm.segment)
            (tmp_path / header.shm.segment).unlink()  # released, as a receiver does
            return st.st_ino, st.st_uid

        first = place(NOBODY)
        assert first[1] == NOBODY
        assert place(0) != first  # a free segment of nobody's is not handed to root
        assert place(NOBODY) == first  # but is reused for nobody
    finally:
        await segments.stop()
    assert os.listdir(tmp_path) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 12 MiB tmpfs, as a small /dev/shm is (skipped where this process may not mount one)."""
    with small_shm_dir(tmp_path, 12 << 20) as (path, mounted):
        if not mounted:
            pytest.skip("cannot mount a tmpfs here")
        yield path


async def test_a_full_filesystem_takes_the_pools_own_free_segments_before_an_item_goes_as_chunks(small_tmpfs):
    segments = ShmSegments(ShmConfig(directory=small_tmpfs, min_bytes=0))
    await segments.start()

    def place(nbytes: int) -> pb.ItemHeader:
        payload = torch.zeros(nbytes // 4, dtype=torch.float32)
        header = pb.ItemHeader(
            index=0, num_tokens=nbytes // 4096, hidden_size=1024, dtype=pb.FLOAT32, payload_bytes=nbytes
        )
        segments.place(header, [wire.tensor_bytes(payload)], b"t" * 32, os.geteuid(), "req")
        return header

    try:
        small = [place(1 << 20) for _ in range(3)]  # three 2 MiB segments, all announced at once
        for header in small:
            (small_tmpfs / header.shm.segment).unlink()  # released: free, too small for what follows
        free = os.statvfs(small_tmpfs)
        (small_tmpfs / "another-tenant").write_bytes(bytes(free.f_bavail * free.f_frsize))
        large = place(3 << 20)  # a 4 MiB segment: no room left but the pool's own free segments
        assert large.shm.segment and not segments.stats.fallbacks, segments.stats.fallbacks
        # Two of the free ones, the oldest, made room: the third and the new segment are what the pool holds.
        assert (segments.pool().segments, segments.pool().bytes) == (2, 6 << 20)
    finally:
        await segments.stop()


async def test_small_payloads_go_as_chunks(default_model_dir):
    tiny = EncoderDouble(tokens=4)  # 16 KiB
    async with running_server(default_model_dir, encoder=tiny, shm=ShmConfig()) as server:
        async with EncoderReceiver([server.url], transfer="shm") as rx:  # proven, so no error
            result = await rx.encode("tiny", items(2))
            assert rx.transfer_stats.fallbacks == {"small_item": 2}
        assert server.transports["shm"].stats.items == 0 and server.transports["shm"].pool_bytes == 0
    assert torch.equal(result.items[1].embedding, tiny.output(9).embedding)


def leave_a_dead_instance(directory) -> set[str]:
    """Files of an encoder process that died: what a sweep removes."""
    dead = new_instance(SERVER_KIND)
    os.close(create_locked(directory / f"{dead}.lock"))
    (directory / random_name(dead, "seg")).write_bytes(b"x")
    return set(os.listdir(directory))


async def test_a_receiver_touches_shared_memory_only_when_a_call_can_use_it(
    plain_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("ENCODER_SHM_DIR", str(tmp_path))  # read when a receiver is made, not at import
    left = leave_a_dead_instance(tmp_path)
    async with EncoderReceiver([plain_server.url], transfer="grpc") as rx:
        await rx.encode("grpc", items(1))
        assert isinstance(rx._transport, StreamTransport) and set(os.listdir(tmp_path)) == left
    remote = "grpc://192.0.2.1:50051"  # TEST-NET-1: an address of no machine here
    async with EncoderReceiver([remote]) as rx:
        assert rx._transport.shm.offer(remote) is None  # "auto" offers no shared memory to another machine
        assert set(os.listdir(tmp_path)) == left
    async with EncoderReceiver([plain_server.url]) as rx:
        assert set(os.listdir(tmp_path)) == left  # "auto": nothing swept, no probe, until a call
        await rx.encode("auto", items(1))  # loopback: the encoder could share this host
        assert set(os.listdir(tmp_path)) == {rx._transport.shm.probe}  # the dead instance swept, the probe made
    assert os.listdir(tmp_path) == []
