"""Image references (encoder.v1 revision 3): an image the server said it keeps is named by its sha256
alone; one it no longer holds is answered not_held and sent again with its bytes. Through real servers."""

from __future__ import annotations

import hashlib

import grpc
import pytest
import torch

from encoder_server.transports.shm import ShmConfig
from protos import encoder_pb2 as pb
from protos import wire
from receiver import EncoderReceiver
from receiver.embeddings.assembly import ShardAssembler, StreamProtocolError
from receiver.fleet.affinity import content_key
from receiver.fleet.channels import EncoderEndpoint
from receiver.fleet.held_images import HeldImages
from testkit.images import image_bytes
from testkit.servers import running_server
from tests.encoder_server.test_cache import encoder, server  # noqa: F401  (fixtures)


def reference(index: int, digest: bytes) -> pb.ImageItem:
    return pb.ImageItem(index=index, modality=pb.IMAGE, content_sha256=digest)


async def messages(endpoint: EncoderEndpoint, request_id: str, items: list[pb.ImageItem]) -> list:
    return [m async for m in endpoint.encode(pb.EncodeRequest(request_id=request_id, items=items))]


async def test_the_server_gives_the_digest_of_what_it_keeps_and_answers_a_reference_from_its_cache(
    server, encoder
):
    image = image_bytes(70, 50, seed=41)
    digest = hashlib.sha256(image).digest()
    endpoint = EncoderEndpoint.connect(server.url)
    try:
        unknown = await messages(endpoint, "unknown", [reference(3, digest)])
        sent = await messages(endpoint, "bytes", [pb.ImageItem(index=3, modality=pb.IMAGE, data=image)])
        forwarded = encoder.items_forwarded
        named = await messages(endpoint, "named", [reference(3, digest)])
    finally:
        await endpoint.close()
    # Not held yet: the header alone, with only its index set.
    assert len(unknown) == 1 and unknown[0] == pb.ItemHeader(index=3, not_held=True)
    assert sent[0].content_sha256 == digest and not sent[0].cache_hit
    assert named[0].content_sha256 == digest and named[0].cache_hit and not named[0].not_held
    assert [bytes(m) for m in named[1:]] == [bytes(m) for m in sent[1:]]  # the same payload
    assert encoder.items_forwarded == forwarded
    assert server.cache.not_held >= 1


async def test_a_reference_of_the_wrong_length_is_refused_naming_the_item(server):
    endpoint = EncoderEndpoint.connect(server.url)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await messages(endpoint, "short", [reference(2, b"12345")])
        with pytest.raises(grpc.aio.AioRpcError) as bare:
            await messages(endpoint, "nothing", [pb.ImageItem(index=4, modality=pb.IMAGE)])
        assert (await endpoint.get_model_info(pb.GetModelInfoRequest())).hidden_size > 0  # still serving
    finally:
        await endpoint.close()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "item 2: content_sha256 is 5 bytes; a sha256 digest has 32"
    assert bare.value.details() == "item 4: item has no data, url or content_sha256"


async def test_a_server_without_cache_gives_no_digest_and_holds_nothing(default_model_dir, encoder):
    image = image_bytes(40, 40, seed=42)
    async with running_server(default_model_dir, encoder=encoder, cache_bytes=0) as server:
        endpoint = EncoderEndpoint.connect(server.url)
        try:
            sent = await messages(endpoint, "bytes", [pb.ImageItem(index=0, modality=pb.IMAGE, data=image)])
            named = await messages(endpoint, "named", [reference(0, hashlib.sha256(image).digest())])
        finally:
            await endpoint.close()
    assert sent[0].content_sha256 == b""
    assert named == [pb.ItemHeader(index=0, not_held=True)]


async def test_the_receiver_names_a_repeated_image_by_digest_and_resends_the_bytes_of_an_evicted_one(
    default_model_dir, encoder, monkeypatch
):
    """A cache of about one item: each new image evicts the last. Items keep their slots throughout."""
    requests = []
    encode_request = wire.encode_request
    monkeypatch.setattr(
        wire, "encode_request", lambda *args: requests.append(encode_request(*args)) or requests[-1]
    )
    images = [image_bytes(64, 64, seed=50 + i) for i in range(3)]
    async with (
        running_server(default_model_dir, encoder=encoder, cache_bytes=40_000) as server,
        EncoderReceiver([server.url], cache_bytes=0) as rx,
    ):
        alone = [
            (await rx.encode(f"alone-{i}", [{"data": image}])).items[0] for i, image in enumerate(images)
        ]
        (endpoint,) = rx.endpoints
        assert endpoint.held.digest(content_key(images[2]), images[2]) == hashlib.sha256(images[2]).digest()
        repeated = (await rx.encode("repeated", [{"data": images[2]}])).items[0]
        # The image went as its digest: the request holds no image.
        request = pb.EncodeRequest.FromString(requests[-1])
        assert request.items[0] == reference(0, hashlib.sha256(images[2]).digest())
        assert repeated.cache_hit and torch.equal(repeated.embedding, alone[2].embedding)
        # Images 0 and 1 were evicted: named by digest, answered not_held, sent again with their bytes.
        not_held = server.cache.not_held
        mixed = (
            await rx.encode("mixed", [{"data": images[1]}, {"data": images[2]}, {"data": images[0]}])
        ).items
        assert server.cache.not_held > not_held
    for result, image in zip(mixed, [1, 2, 0]):
        assert torch.equal(result.embedding, alone[image].embedding), f"item {result.index}"
    assert [r.index for r in mixed] == [0, 1, 2]


async def test_references_place_payloads_in_shared_memory_too(default_model_dir, encoder):
    image = image_bytes(80, 80, seed=43)
    async with (
        running_server(default_model_dir, encoder=encoder, shm=ShmConfig(min_bytes=0)) as server,
        EncoderReceiver([server.url], cache_bytes=0, transfer="shm") as rx,
    ):
        first = (await rx.encode("first", [{"data": image}])).items[0]
        again = (await rx.encode("again", [{"data": image}])).items[0]
        assert rx.transfer_stats.items_shm == 2 and len(rx.endpoints[0].held) == 1
    assert again.cache_hit and torch.equal(again.embedding, first.embedding)


def test_an_image_is_named_by_a_digest_only_when_its_own_bytes_hash_to_it():
    """The receiver's key is a fast hash: two images under one key (a collision, crafted or not) must
    never get each other's embedding."""
    held = HeldImages(max_entries=2)
    image, other = image_bytes(30, 30, seed=44), image_bytes(30, 30, seed=45)
    held.held(b"key", hashlib.sha256(image).digest())
    assert held.digest(b"key", image) == hashlib.sha256(image).digest()
    assert held.digest(b"key", other) is None  # its bytes go instead
    held.held(b"second", hashlib.sha256(other).digest())
    held.held(b"third", b"3" * 32)  # past two entries: the least recently used ("key") goes
    assert held.digest(b"key", image) is None and held.digest(b"second", other) is not None
    held.forget(b"second")
    assert len(held) == 1 and held.digest(b"second", other) is None


def test_not_held_for_an_item_sent_with_its_bytes_breaks_the_contract():
    assembler = ShardAssembler([0, 1], "grpc://encoder", references=[1])
    assert assembler.feed(pb.ItemHeader(index=1, not_held=True)) is None and assembler.not_held == [1]
    with pytest.raises(
        StreamProtocolError, match="item 0: answered not_held, but it went with its bytes"
    ):
        assembler.feed(pb.ItemHeader(index=0, not_held=True))
    with pytest.raises(StreamProtocolError, match="unexpected item index 1"):
        assembler.feed(pb.ItemHeader(index=1, not_held=True))


def test_a_reference_is_framed_without_data():
    digest = hashlib.sha256(b"image").digest()
    raw = wire.encode_request(
        pb.EncodeRequest(request_id="r"),
        [(reference(0, digest), None), (pb.ImageItem(index=1, modality=pb.IMAGE), b"image")],
    )
    items = pb.EncodeRequest.FromString(raw).items
    assert items[0] == reference(0, digest) and items[0].WhichOneof("source") is None
    assert items[1].data == b"image"
