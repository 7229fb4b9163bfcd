"""The encode path end to end: real servers on loopback, real checkpoint, real images."""

from __future__ import annotations

import asyncio
import base64
import io

import grpc
import pytest
import torch
from PIL import Image

from protos import encoder_pb2 as pb
from protos.wire import CHUNK_BYTES
from receiver import EncoderReceiver, ShardError, UnsupportedModalityError
from testkit.image_set import KIND_SIZE, image_set
from testkit.images import image_bytes
from testkit.reference import reference_features
from testkit.servers import running_server

# (width, height): from 1x1 to one whose fp32 embedding is over 4 MiB (1400x1100 -> 1950 tokens x 2048 x 4 B).
SIZES = [(1, 1), (28, 28), (640, 480), (100, 300), (1400, 1100)]


@pytest.fixture(scope="module")
async def two_servers(default_model_dir):
    async with running_server(default_model_dir) as a, running_server(default_model_dir) as b:
        yield [a, b]


async def test_embeddings_equal_in_process_get_image_features_fp32(default_model_dir, two_servers):
    images = [image_bytes(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    expected = reference_features(default_model_dir, images)
    async with EncoderReceiver([s.url for s in two_servers], seed=3) as rx:
        result = await rx.encode("parity", [{"modality": "image", "data": d} for d in images])
    assert [item.index for item in result.items] == list(range(len(images)))
    assert [item.image_size for item in result.items] == SIZES
    for item, features in zip(result.items, expected):
        (reference,) = features.pooler_output
        assert item.embedding.dtype == torch.float32
        assert item.num_tokens == reference.shape[0]
        torch.testing.assert_close(item.embedding, reference, rtol=1e-5, atol=1e-5)
    biggest = result.items[-1].embedding
    assert biggest.numel() * biggest.element_size() > 4 * 1024 * 1024 > CHUNK_BYTES
    assert torch.equal(result.embedding, torch.cat([i.embedding for i in result.items]))


async def test_bf16_embeddings_match_within_bf16_tolerance(default_model_dir):
    images = [image_bytes(200, 150, seed=7), image_bytes(64, 64, seed=8)]
    expected = reference_features(default_model_dir, images, dtype=torch.bfloat16)
    async with running_server(default_model_dir, dtype=torch.bfloat16) as server:
        async with EncoderReceiver([server.url]) as rx:
            result = await rx.encode("bf16", [{"modality": "image", "data": d} for d in images])
        info = (await rx_info(server.url))
    assert info.dtype == pb.BFLOAT16
    for item, features in zip(result.items, expected):
        assert item.embedding.dtype == torch.bfloat16
        torch.testing.assert_close(item.embedding, features.pooler_output[0], rtol=1.6e-2, atol=1e-2)


async def test_the_header_gives_the_image_size_as_loaded(two_servers):
    """`ItemHeader.image_size` is the image after its EXIF orientation: a JPEG stored turned reports the size it
    is shown at."""
    data = image_set()["jpeg-exif-rotated"]
    assert Image.open(io.BytesIO(data)).size == KIND_SIZE[::-1]
    async with EncoderReceiver([two_servers[0].url]) as rx:
        (item,) = (await rx.encode("exif", [{"data": data}])).items
    assert item.image_size == KIND_SIZE


async def rx_info(url: str) -> pb.ModelInfo:
    async with EncoderReceiver([url]) as rx:
        return (await rx.model_info())[url]


async def test_items_come_back_in_order_over_2_and_3_encoders_for_many_seeds(default_model_dir, two_servers):
    images = [image_bytes(28 * (i + 1), 28 * (5 - i), seed=i) for i in range(5)]
    async with running_server(default_model_dir) as third:
        for urls in ([s.url for s in two_servers], [s.url for s in two_servers] + [third.url]):
            async with EncoderReceiver([urls[0]]) as single:
                baseline = await single.encode("baseline", [{"data": d} for d in images], num_items_assigned=[5])
            used = set()
            for seed in range(12):
                async with EncoderReceiver(urls, seed=seed) as rx:
                    result = await rx.encode(f"seed-{seed}", [{"modality": "image", "data": d} for d in images])
                assert [item.index for item in result.items] == [0, 1, 2, 3, 4]
                for got, want in zip(result.items, baseline.items):
                    torch.testing.assert_close(got.embedding, want.embedding, rtol=1e-5, atol=1e-5)
                used |= {item.encoder_url for item in result.items}
            assert used == set(urls)


async def test_urls_file_and_data_uri_are_read_on_the_receiver(two_servers, tmp_path):
    png = image_bytes(56, 84, seed=1)
    path = tmp_path / "cat.png"
    path.write_bytes(png)
    items = [
        {"modality": "image", "url": path.as_uri()},
        {"modality": "image", "url": "data:image/png;base64," + base64.b64encode(png).decode()},
        {"modality": "image", "data": png},
    ]
    async with EncoderReceiver([s.url for s in two_servers], seed=0) as rx:
        result = await rx.encode("urls", items)
    # Equal up to float noise: the items may share a batch or not.
    torch.testing.assert_close(result.items[0].embedding, result.items[1].embedding, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.items[0].embedding, result.items[2].embedding, rtol=1e-5, atol=1e-5)
    assert result.items[0].grid_thw == (1, 6, 4)



async def test_image_only_rule_raises_before_any_rpc(two_servers):
    async with EncoderReceiver([s.url for s in two_servers]) as rx:
        calls = []
        for endpoint in rx.endpoints:
            original = endpoint.encode
            endpoint.encode = lambda *a, _o=original, **k: calls.append(a) or _o(*a, **k)
        with pytest.raises(UnsupportedModalityError) as raised:
            await rx.encode(
                "mixed",
                [
                    {"modality": "image", "data": image_bytes(8, 8)},
                    {"modality": "video", "url": "file:///clip.mp4"},
                    {"modality": "audio", "data": b"RIFF"},
                ],
            )
    assert isinstance(raised.value, NotImplementedError)
    assert str(raised.value) == "gRPC encode only supports IMAGE modality, got: ['video', 'audio']"
    assert calls == []


async def test_server_rejects_non_image_items_with_invalid_argument(two_servers):
    async with grpc.aio.insecure_channel(two_servers[0].url.removeprefix("grpc://")) as channel:
        encode = channel.unary_stream(
            "/encoder.v1.EncoderService/Encode",
            request_serializer=pb.EncodeRequest.SerializeToString,
            response_deserializer=pb.EncodeResponse.FromString,
        )
        request = pb.EncodeRequest(request_id="v", items=[pb.ImageItem(index=0, modality=pb.VIDEO, data=b"x")])
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in encode(request):
                pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "gRPC encode only supports IMAGE modality, got: ['video']"


async def test_generated_stub_reads_the_framed_stream(two_servers):
    """The fast framing is plain protobuf to any client: the generated stub parses it."""
    from protos import encoder_pb2_grpc

    async with grpc.aio.insecure_channel(two_servers[0].url.removeprefix("grpc://")) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        request = pb.EncodeRequest(request_id="stub", items=[pb.ImageItem(index=4, modality=pb.IMAGE, data=image_bytes(640, 480))])
        messages = [m async for m in stub.Encode(request)]
    header = messages[0].header
    chunks = [m.chunk for m in messages[1:]]
    assert header.index == 4 and header.num_tokens == 391 and list(header.grid_thw) == [1, 34, 46]
    assert sum(map(len, chunks)) == header.payload_bytes == 391 * 2048 * 4
    assert max(map(len, chunks)) <= CHUNK_BYTES


async def test_concurrent_requests_on_one_receiver_each_get_their_own(two_servers):
    images = [image_bytes(28 * (1 + i % 4), 28 * (1 + i % 3), seed=100 + i) for i in range(20)]
    async with EncoderReceiver([two_servers[0].url], seed=0) as single:
        alone = [await single.encode(f"alone-{i}", [{"data": d}]) for i, d in enumerate(images)]
    async with EncoderReceiver([s.url for s in two_servers], seed=1) as rx:
        together = await asyncio.gather(
            *(rx.encode(f"req-{i}", [{"data": d}, {"data": images[(i + 1) % 20]}]) for i, d in enumerate(images))
        )
    for i, result in enumerate(together):
        assert result.request_id == f"req-{i}"
        torch.testing.assert_close(result.items[0].embedding, alone[i].items[0].embedding, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result.items[1].embedding, alone[(i + 1) % 20].items[0].embedding, rtol=1e-5, atol=1e-5)


async def test_bad_image_fails_its_shard_with_a_typed_error_naming_encoder_request_and_items(two_servers):
    async with EncoderReceiver([two_servers[0].url]) as rx:
        with pytest.raises(ShardError) as raised:
            await rx.encode("bad", [{"data": image_bytes(8, 8)}, {"data": b"not an image"}])
    error = raised.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.encoder_url == two_servers[0].url and error.request_id == "bad"
    assert "item 1" in str(error) and "not an image" in str(error)
    async with EncoderReceiver([two_servers[0].url]) as rx:  # and the server keeps serving
        assert (await rx.encode("after", [{"data": image_bytes(8, 8)}])).items[0].num_tokens == 4
